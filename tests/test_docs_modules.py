"""Every module the docs name by its path exists: the walks of docs/architecture.md (a
request, an upgrade, an engine crash) and the other pages name modules as `package/module.py`
(under llmproxy/) or by their path from the repository's root, and a module renamed or
deleted must take its mentions with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"])
NAMED = re.compile(r"`((?:[a-z0-9_]+/)+[a-z0-9_]+\.py)`")


def named_modules(text: str) -> set[str]:
    return set(NAMED.findall(text))


def test_the_pattern_finds_what_the_walks_write() -> None:
    assert named_modules("`web/relay.py` and `llmproxy/hosts/host.py`, not `stop.py`") == {
        "web/relay.py", "llmproxy/hosts/host.py"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_module_a_page_names_exists(page: Path) -> None:
    missing = sorted(name for name in named_modules(page.read_text())
                     if not (ROOT / "llmproxy" / name).exists() and not (ROOT / name).exists())
    assert missing == [], f"{page.name} names modules that do not exist"


def test_the_request_walk_names_the_modules_it_enters() -> None:
    """The architecture page's walks are there and name modules (the check above holds them
    to the tree)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    for walk in ("## A request's walk", "## An upgrade's walk", "## An engine crash's walk"):
        start = text.index(walk)
        end = text.find("\n## ", start + 1)
        assert len(named_modules(text[start:end])) >= 5, walk
