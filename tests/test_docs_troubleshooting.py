"""docs/troubleshooting.md quotes messages word for word: each `### `...`` heading must still
appear in llmproxy's code, so the page cannot describe a message the proxy no longer prints."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = re.compile(r"^### `(.+)`$", re.M)


def sources() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "llmproxy").rglob("*.py")))


def test_every_quoted_message_is_in_the_code() -> None:
    quoted = HEADING.findall((ROOT / "docs" / "troubleshooting.md").read_text())
    assert len(quoted) >= 15
    code = sources()
    missing = [q for q in quoted if q not in code]
    assert missing == []
