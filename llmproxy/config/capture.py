"""The `capture` block of hosts.json (`CaptureConfig`): opt-in recording of
requests and their answers in a bounded, compressed ring in memory
(observe/capture.py), optionally also written to files that rotate within a size.

```json
"capture": {"max_mb": 64, "bodies": true, "redact": ["$.messages[*].content", "x-user"],
            "dir": "/var/lib/llmproxy/captures", "dir_max_mb": 256}
```

`redact` names what never enters a capture besides the secrets that never do
anyway (`Authorization`, `x-api-key`, `Proxy-Authorization`, `Cookie`, every
client key and engine key): an entry that starts with `$` is a JSON path into
the request's body, the answer's body and each event of a stream (`$.a.b`,
`$.a[0]`, `$.a[*].b`, `$.*`), any other entry a header name. Every error names
its field (`capture.max_mb: must be a positive number`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmproxy.core.text import did_you_mean

KEYS = ("max_mb", "bodies", "redact", "dir", "dir_max_mb", "max_record_kb")
# A JSON path step: .name, .*, [N], [*], ['name'] or ["name"].
_STEP = re.compile(r"""\.([A-Za-z_][A-Za-z0-9_-]*|\*)|\[(\d+|\*)\]|\[(?:'([^']*)'|"([^"]*)")\]""")
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
ANY = "*"
Path = tuple[str | int, ...]      # the steps of a JSON path: a key, an index, or ANY


@dataclass(frozen=True)
class CaptureConfig:
    """What the capture keeps, and where (`max_bytes` in memory; `dir`: also on disk)."""

    max_bytes: int = 64 * 1024 * 1024
    bodies: bool = True
    json_paths: tuple[Path, ...] = ()
    headers: tuple[str, ...] = ()           # lower case, besides the secrets
    dir: str | None = None
    dir_max_bytes: int = 256 * 1024 * 1024
    # Of each body (request, answer), at most this much is copied.
    max_record_bytes: int = 1024 * 1024


def json_path(text: str) -> Path | None:
    """The steps of a JSON path (`$`, then steps), None if it is not one."""
    if not text.startswith("$"):
        return None
    steps: list[str | int] = []
    at = 1
    while at < len(text):
        m = _STEP.match(text, at)
        if m is None:
            return None
        name, index, quoted1, quoted2 = m.groups()
        if name is not None:
            steps.append(name)
        elif index is not None:
            steps.append(ANY if index == ANY else int(index))
        else:
            steps.append(quoted1 if quoted1 is not None else quoted2)
        at = m.end()
    return tuple(steps) if steps else None


def _size(value: object, path: str, unit: int, error: Callable[[str, str], None]) -> int | None:
    """A positive number of `unit`s, in bytes (at least 1 KiB); None (said) if not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        error(path, f"must be a positive number ({'MB' if unit > 1024 else 'KB'})")
        return None
    return max(1024, int(value * unit))


def parse_capture(top: dict[str, Any], error: Callable[[str, str], None]) -> dict[str, Any]:
    """The Config field of a `capture` block, if there is one (else {}: off)."""
    if "capture" not in top:
        return {}
    block = top["capture"]
    if not isinstance(block, dict):
        error("capture", 'must be a JSON object, e.g. {"max_mb": 64}')
        return {}
    fields: dict[str, Any] = {}
    for key in block:
        if key not in KEYS:
            error(f"capture.{key}", "unknown key" + did_you_mean(key, KEYS))
    for key, name, unit in (("max_mb", "max_bytes", 1 << 20),
                            ("dir_max_mb", "dir_max_bytes", 1 << 20),
                            ("max_record_kb", "max_record_bytes", 1 << 10)):
        if key in block:
            fields[name] = _size(block[key], f"capture.{key}", unit, error)
    if "bodies" in block:
        if not isinstance(block["bodies"], bool):
            error("capture.bodies", "must be true or false")
        fields["bodies"] = block["bodies"] is not False
    if "dir" in block:
        if not isinstance(block["dir"], str) or not block["dir"]:
            error("capture.dir", "must be a non-empty string (a directory)")
        else:
            fields["dir"] = block["dir"]
    paths, headers = _redact(block.get("redact", []), error)
    if None in fields.values():
        return {}
    return {"capture": CaptureConfig(**fields, json_paths=paths, headers=headers)}


def _redact(value: object, error: Callable[[str, str], None]
            ) -> tuple[tuple[Path, ...], tuple[str, ...]]:
    """`redact`'s JSON paths and header names (lower case)."""
    if not isinstance(value, list):
        error("capture.redact", 'must be a list of JSON paths ("$.user") and header names')
        return (), ()
    paths: list[Path] = []
    headers: list[str] = []
    for i, entry in enumerate(value):
        where = f"capture.redact[{i}]"
        if not isinstance(entry, str) or not entry:
            error(where, "must be a non-empty string")
        elif entry.startswith("$"):
            path = json_path(entry)
            if path is None:
                error(where, f"{entry!r}: not a JSON path such as $.user, $.messages[*].content"
                      " or $['a b'][0]")
            else:
                paths.append(path)
        elif _HEADER.fullmatch(entry):
            headers.append(entry.lower())
        else:
            error(where, f"{entry!r}: neither a JSON path (starting with $) nor a header name")
    return tuple(paths), tuple(headers)
