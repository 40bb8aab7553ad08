"""What a capture never holds: the secrets (the client's credentials, every client
key and engine key), and what the operator's `capture.redact` names (JSON paths
into bodies and stream events, header names). Applied once per request, at its
end, before anything is compressed, kept or written (observe/capture.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from llmproxy.config.capture import ANY, CaptureConfig, Path

REDACTED = "[redacted]"
# Never kept, whatever the config says: credentials of the client and cookies.
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "proxy-authorization", "cookie",
                            "set-cookie"})
_SHORTEST_SECRET = 4     # a shorter "secret" would blank ordinary text


def headers(pairs: Iterable[tuple[bytes, Iterable[bytes]]], config: CaptureConfig
            ) -> dict[str, list[str]]:
    """Header name (lower case) -> its values as text; secret and named headers redacted."""
    named = SECRET_HEADERS.union(config.headers)
    out: dict[str, list[str]] = {}
    for name, values in pairs:
        lower = name.decode("latin-1").lower()
        shown = [REDACTED] if lower in named else [v.decode("latin-1") for v in values]
        out.setdefault(lower, []).extend(shown)
    return out


def _at(doc: Any, path: Path) -> bool:
    """Replace, in `doc` (in place), every value `path` leads to; whether there was one."""
    if not path:
        return False
    step, rest = path[0], path[1:]
    if isinstance(doc, dict):
        keys = list(doc) if step == ANY else [step] if step in doc else []
    elif isinstance(doc, list):
        keys = list(range(len(doc))) if step == ANY else \
            [step] if isinstance(step, int) and step < len(doc) else []
    else:
        return False
    found = False
    for key in keys:
        if rest:
            found = _at(doc[key], rest) or found
        else:
            doc[key] = REDACTED
            found = True
    return found


def json_doc(doc: Any, paths: Iterable[Path]) -> bool:
    """Redact each path's values in `doc` (a parsed JSON document of the capture's
    own, in place); whether any was found."""
    found = False
    for path in paths:
        found = _at(doc, path) or found
    return found


def _event_line(line: str, paths: tuple[Path, ...]) -> str:
    """One line of a stream: a `data:` line's JSON redacted, any other kept."""
    if not line.startswith("data:"):
        return line
    payload = line[5:].strip()
    if not payload.startswith("{"):
        return line
    try:
        doc = json.loads(payload)
    except ValueError:
        return line
    return "data: " + json.dumps(doc, ensure_ascii=False) if json_doc(doc, paths) else line


def body(raw: bytes, config: CaptureConfig, secrets: Iterable[str]) -> str:
    """A body as kept: text (undecodable bytes replaced), the configured JSON paths
    redacted in a JSON body or in each event of a stream, every secret blanked.
    A body (an event) where no path leads anywhere is kept as it came; one where
    one does is written again as JSON (its spacing the capture's own)."""
    text = raw.decode("utf-8", "replace")
    paths = config.json_paths
    if paths and text:
        try:
            doc = json.loads(text)
        except ValueError:
            text = "\n".join(_event_line(line, paths) for line in text.split("\n"))
        else:
            if json_doc(doc, paths):
                text = json.dumps(doc, ensure_ascii=False)
    return scrub(text, secrets)


def raw_body(raw: bytes, config: CaptureConfig, secrets: Iterable[str]) -> bytes:
    """`body`, as UTF-8 bytes; the bytes as they came when there is nothing to
    redact in them (no JSON path configured, no secret found)."""
    if not config.json_paths and not any(
            len(s) >= _SHORTEST_SECRET and s.encode("utf-8", "replace") in raw for s in secrets):
        return raw
    return body(raw, config, secrets).encode("utf-8")


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret (of at least a few characters) replaced."""
    for secret in secrets:
        if len(secret) >= _SHORTEST_SECRET and secret in text:
            text = text.replace(secret, REDACTED)
    return text
