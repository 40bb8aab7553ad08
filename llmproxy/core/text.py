"""Client-chosen text as the proxy shows it: in an event, a log line or an error body.

A client picks its model name, its path and its header values; any of them may
be a megabyte long or carry a line break. `shown` is the one way such a string
leaves the request that brought it: a bounded prefix, on one line, with every
character that is not printable escaped, so one request stays one log line and
one small event whatever the client sent.
"""

from __future__ import annotations

from collections.abc import Iterable

MARKER = "…"        # ends a shown string that was cut
SHOWN = 256         # the default bound, in characters of the result


def _escaped(char: str) -> str:
    """A character as Python writes it in a string literal's escape."""
    if char == "\\":
        return "\\\\"
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def shown(value: str, limit: int = SHOWN) -> str:
    """`value` as it may be shown: at most `limit` characters, then MARKER if
    anything was cut. Every character `str.isprintable` refuses (control
    characters, line and paragraph separators, lone surrogates, format
    characters such as bidirectional overrides) and the backslash are written
    as their Python escape (`\\x0a`, `\\u2028`, `\\\\`), so the result holds no
    line break, encodes to UTF-8, and reads back unambiguously; an escape is
    never cut in half. Costs O(limit), not O(len(value))."""
    head = value[:limit]
    if head.isprintable() and "\\" not in head:
        return head if len(value) <= limit else head + MARKER
    out: list[str] = []
    used = 0
    for char in head:
        piece = char if char.isprintable() and char != "\\" else _escaped(char)
        if used + len(piece) > limit:
            return "".join(out) + MARKER
        out.append(piece)
        used += len(piece)
    return "".join(out) if len(value) <= limit else "".join(out) + MARKER


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """` (did you mean "X"?)` naming the one of `known` closest to a misspelt
    `word` (difflib's ratio of at least 0.7), or "" when none is close."""
    import difflib

    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.7)
    return f' (did you mean "{close[0]}"?)' if close else ""
