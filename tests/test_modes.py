"""tests/modes.py, the rule that picks what the reference run repeats, holds for this code: the
switch is read only where the rule looks, and it marks what it should."""

from __future__ import annotations

import ast

import pytest

from tests import modes

READERS = {"select", "switched_on", "SWITCH"}


def test_the_switch_is_read_only_in_the_parts_the_rule_follows() -> None:
    """Outside llmproxy/speedups/, only modules of the parts `modes.SWITCHED` names take the
    switch's readers: a test that reaches none of them runs the same code in both modes."""
    readers = set()
    for path in sorted((modes.ROOT / "llmproxy").rglob("*.py")):
        name = ".".join(path.relative_to(modes.ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.module == "llmproxy.speedups"
                    and READERS.intersection(a.name for a in node.names)):
                readers.add(name)
    assert readers, "no module reads the switch: the rule has lost its anchor"
    assert {n for n in readers
            if not any(n == s or n.startswith(s + ".") for s in modes.SWITCHED)} == set()


@pytest.mark.parametrize(("module", "switched"), [
    ("tests.test_integration_proxy", True),          # a proxy process
    ("tests.test_integration_page_keys", True),      # through the page module's proxy
    ("tests.test_proxy", True),                      # the service built in process
    ("tests.test_relaychunks", True),                # a speedup itself
    ("tests.test_agent", False),                     # the agent: stdlib only
    ("tests.test_config", False),
    ("tests.test_hosts", False),
])
def test_what_it_marks(module: str, switched: bool) -> None:
    assert modes.switched(module) is switched


def test_a_test_on_both_paths_itself_is_not_repeated() -> None:
    path = modes.ROOT / "tests" / "test_bodies.py"
    assert modes.switched("tests.test_bodies")
    assert not modes.both_modes(path, ["on_both_paths", "tmp_path"])
    assert modes.both_modes(path, ["tmp_path"])
