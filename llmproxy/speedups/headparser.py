"""A request head parsed in one pass, as Twisted 26.10's HTTPChannel parses it
line by line (`lineReceived`, `headerReceived`, `_maybeChooseTransferDecoder`,
`_parseRequestLine`): the request line, the headers as `Headers` keeps them
(canonical names, in order), the one header that frames the body. A head this
parser does not take whole and plainly valid is None: Twisted's own parser then
answers it (with the channel's `web.headerlimits`: a second Host header, which
Twisted alone would take, is None here and a 400 there). Part of the
request_head speedup (requesthead.py), whose guard covers the Twisted code this
follows.
"""

from __future__ import annotations

from twisted.web.http_headers import InvalidHeaderName, _nameEncoder

# The names Headers has canonicalized so far (its own bounded cache), looked up
# before asking it: one call less per header.
_canonical = getattr(_nameEncoder, "_canonicalHeaderCache", {}).get

LENGTH, _ENCODING = b"Content-Length", b"Transfer-Encoding"
_HOST = b"Host"
_FRAMING = (LENGTH, _ENCODING)


class Head:
    """A parsed head: request line, headers as Headers keeps them, the one
    header that sets the body's length (if any), and the figures the limits
    count."""

    __slots__ = ("command", "count", "framing", "headers", "path", "size", "version")

    def __init__(self, command: bytes, path: bytes, version: bytes,
                 headers: dict[bytes, list[bytes]], framing: tuple[bytes, bytes] | None,
                 count: int, size: int) -> None:
        self.command, self.path, self.version = command, path, version
        self.headers, self.framing, self.count, self.size = headers, framing, count, size


def _framing(name: bytes, value: bytes) -> tuple[bytes, bytes] | bool | None:
    """What a Content-Length or Transfer-Encoding header does to the body: sets
    its framing (the header), nothing (identity, as Twisted ignores it: None), or
    makes the request bad (False)."""
    if name == _ENCODING:
        kind = value.lower()
        return None if kind == b"identity" else (name, value) if kind == b"chunked" else False
    return (name, value) if value.isdigit() else False


# The bytes Twisted's _parseRequestLine takes in a request target (33 to 176).
_TARGET_BYTES = bytes(range(33, 177))
_VERSIONS = frozenset({b"HTTP/1.1", b"HTTP/1.0"})


def request_line(line: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(method, target, version) of a plain request line, as Twisted's
    _parseRequestLine gives them, at C speed (it tests the target a byte at a
    time in Python); None for any line it does not take, or whose method is not
    letters alone (Twisted's path judges those)."""
    parts = line.split(b" ")
    if len(parts) != 3:
        return None
    method, target, version = parts
    if not method.isalpha() or not target or target.translate(None, _TARGET_BYTES) or \
            version not in _VERSIONS:
        return None
    return method, target, version


def parse_head(head: bytes, max_line: int, max_size: int, max_headers: int) -> Head | None:
    """`head` (up to, not including, its blank line) parsed, or None when it is
    not plainly valid and within the limits (Twisted's path then answers it)."""
    lines = head.split(b"\r\n")
    size = len(head) - 2 * (len(lines) - 1)          # as Twisted counts: lines, no CRLFs
    first = lines[0]
    if size > max_size or len(lines) - 1 > max_headers or not first or len(first) > max_line:
        return None
    # No NUL, CR or LF within a line: the split took each line break's CR and
    # LF, so any other is a stray. Counted over the whole head at once (and
    # not with `in`: Python 3.11's `bytes in bytes` first tries its operand as
    # an integer, and raises and clears a TypeError on every test).
    breaks = len(lines) - 1
    if head.count(b"\r") != breaks or head.count(b"\n") != breaks or head.find(b"\x00") >= 0:
        return None
    parsed = request_line(first)
    if parsed is None:
        return None
    command, path, version = parsed
    headers: dict[bytes, list[bytes]] = {}
    framing: tuple[bytes, bytes] | None = None
    for line in lines[1:]:
        # Plain: not folded, a name, a colon; a name Headers takes (canonical,
        # as it stores it).
        name, colon, value = line.partition(b":")
        if not colon or len(line) > max_line or line[0] in b" \t":
            return None
        canonical = _canonical(name)
        if canonical is None:
            try:
                canonical = _nameEncoder.encode(name)
            except InvalidHeaderName:
                return None
        name, value = canonical, value.strip(b" \t")
        if name in _FRAMING:
            sets = _framing(name, value)
            if sets is False or (sets is not None and framing is not None):
                return None               # a bad one, or two: a 400
            if isinstance(sets, tuple):
                framing = sets
        values = headers.get(name)
        if values is None:
            headers[name] = [value]
        else:
            values.append(value)
    # A second Host header: a 400 (RFC 9112 section 3.2).
    return None if len(headers.get(_HOST, ())) > 1 else \
        Head(command, path, version, headers, framing, len(lines) - 1, size)
