"""The shape of the package, as docs/architecture.md draws it: every module small,
every function short, and each part importing only the parts it may."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "llmproxy"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# Who may import whom (llmproxy.<part>); a part may always import itself.
ALLOWED = {
    "core": set(),
    "config": {"core"},
    "agent": set(),
    "hosts": {"core", "config", "agent"},     # the agent's wire protocol only (below)
    "observe": {"core", "config", "hosts"},
    "web": {"core", "config", "hosts", "observe"},
    "speedups": {"core", "config", "hosts", "observe", "web"},
    "compat": {"core"},
    "lifecycle": {"core", "config", "hosts", "observe", "web", "speedups", "compat"},
    "testing": {"core", "config", "hosts", "observe", "web", "lifecycle", "agent", "speedups"},
    # doctor calls the agent as the proxy does (hosts.agentclient, never the reactor) and
    # reads nvidia-smi's answer with the agent's parser; check runs twistd's loader
    # (lifecycle.accessfiles)
    "cli": {"config", "hosts", "agent", "lifecycle"},
}
# Top-level entry points: tap (twistd's plugin), and the package's __init__.
ENTRY_POINTS = {"tap", "__init__"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_parts(tree: ast.AST) -> set[str]:
    parts = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            bits = name.split(".")
            if bits[0] == "llmproxy" and len(bits) > 1 and bits[1] != "__version__":
                parts.add(bits[1])
    return parts


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_functions_are_small(path: Path) -> None:
    """No module over 400 lines, no function or method over 60 (def to last line)."""
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_part_imports_only_what_it_may(path: Path) -> None:
    """core imports nothing of llmproxy; the agent nothing at all; hosts never web,
    observe or lifecycle; web never lifecycle; no production part imports testing."""
    part = part_of(path)
    used = imported_parts(ast.parse(path.read_text())) - {part}
    if part in ENTRY_POINTS:
        return
    assert used <= ALLOWED[part], f"{part} may not import {sorted(used - ALLOWED[part])}"


def test_the_proxy_shares_only_the_wire_protocol_with_the_agent() -> None:
    """In the proxy's process (every part but the agent, testing and the command line),
    llmproxy.agent is imported only for its protocol module: one version number for both
    ends, no agent code in the proxy."""
    for path in modules():
        if part_of(path) in ("agent", "testing", "cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name == "llmproxy.agent" or name.startswith("llmproxy.agent."):
                    assert name == "llmproxy.agent.protocol", (path, name)


def test_core_and_config_need_no_twisted_web() -> None:
    """Failure descriptions, events and the config load without twisted.web."""
    for path in [*(PACKAGE / "core").glob("*.py"), *(PACKAGE / "config").glob("*.py")]:
        tree = ast.parse(path.read_text())
        modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in modules if m.startswith("twisted.web")], path


def test_the_agent_needs_only_the_standard_library() -> None:
    """The agent runs on a GPU host from a bare install: no Twisted, no zope."""
    for path in (PACKAGE / "agent").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] in {"__future__", "llmproxy"} or \
                    node.module.split(".")[0] in _stdlib(), node.module
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] in _stdlib(), alias.name


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names)


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))


@pytest.mark.parametrize("package", packages(), ids=lambda p: p.name)
def test_each_package_docstring_lists_its_modules(package: Path) -> None:
    """A package's docstring names each of its modules (and sub-packages) in
    backquotes, and its `Modules:` list (`- `name`: ...` lines) names only
    modules that exist: a newcomer reads the package's map from __init__."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    present = {p.stem for p in package.glob("*.py") if not p.stem.startswith("__")}
    present |= {p.name + "/" for p in package.iterdir() if p.is_dir()
                and not p.name.startswith("__") and any(p.iterdir())}
    named = set(re.findall(r"`([a-z0-9_]+/?)`", doc))
    listed = set(re.findall(r"^- `([a-z0-9_]+/?)`", doc, re.MULTILINE))
    assert present - named == set(), f"modules the docstring does not name: {present - named}"
    assert listed - present == set(), f"listed modules that do not exist: {listed - present}"
    assert listed, "the docstring has no `Modules:` list"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_another_modules_private_names(path: Path) -> None:
    """`from llmproxy.x import _name` is refused: what another module uses is
    public, and named so."""
    private = [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmproxy")
               for alias in node.names
               if alias.name.startswith("_") and not alias.name.endswith("__")]
    assert private == []


# -- the suite's own fixtures --------------------------------------------------------------
TESTS = Path(__file__).resolve().parent
# Fixture names that more than one test file defines, each with why the definitions differ.
# Anything shared (sshd, the simulated engine, a second machine, ...) lives in conftest.py.
FIXTURES_DEFINED_AGAIN = {
    "proxy": "each module's proxy process on that module's own configuration",
    "engines": "each module's engine processes, serving that module's own models",
    "setup": "each module's proxy and engine on that module's own keys and configuration",
    "engine": "conftest.py's simulated engine process; a unit test's in-memory engine "
              "(test_engineclient, test_simengine) or a misbehaving raw-socket engine "
              "(test_integration_client_leaves, test_integration_engine_hostile) in its place",
}


def fixture_names(tree: ast.AST) -> set[str]:
    """The names of the functions `tree` decorates as fixtures (pytest's or pytest_twisted's)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if isinstance(target, ast.Attribute) and "fixture" in target.attr:
                    names.add(node.name)
    return names


def test_no_fixture_is_defined_in_two_test_files() -> None:
    """A fixture is defined once, in conftest.py or in the one module that uses it (a
    module imports another's fixture rather than copying it), but for the allowlist's."""
    where: dict[str, list[str]] = {}
    for path in sorted(TESTS.glob("*.py")):
        for name in fixture_names(ast.parse(path.read_text())):
            where.setdefault(name, []).append(path.name)
    again = {name: files for name, files in where.items()
             if len(files) > 1 and name not in FIXTURES_DEFINED_AGAIN}
    assert again == {}, "define these once, in tests/conftest.py"
    unused = {name for name in FIXTURES_DEFINED_AGAIN if len(where.get(name, [])) < 2}
    assert unused == set(), "no longer defined twice: drop them from FIXTURES_DEFINED_AGAIN"
