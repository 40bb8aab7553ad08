"""The rules an engine's response head is held to before anything of it reaches
a client, and `HeadWatch`, which holds a connection's heads to them.

Both engine clients refuse the same heads, with the same code: the fast one
(speedups/engineconnection.py) runs each read through a HeadWatch before its
parser (httptools) has it, and the reference one (web/engineclient.py) does the
same before Twisted's parser has it (web.enginewatch.WatchedConnection). A
refused head is `BadResponse`: the request fails with ResponseNeverReceived (or
ResponseFailed) around it, its connection is aborted, and the client gets the
proxy's 502 `upstream_failed`. Where the two parsers differ (llhttp and
Twisted 26.10's HTTPClientParser), a rule here refuses what either would
refuse, so that both paths give a head the same outcome.

- Line breaks are CRLF. A bare LF, a CR outside a CRLF, or a NUL anywhere in a
  head is refused (Twisted's parser takes a bare LF for a line break, so
  `200 OK\\nSet-Cookie: x` would hand on a header of the engine's making, and
  it keeps a NUL in a value).
- The status line is `HTTP/1.1` or `HTTP/1.0`, a space, the code (100 to 599:
  RFC 9110 §15), then a space and a phrase or nothing (llhttp refuses other
  versions, Twisted takes any `HTTP/1.x`). The phrase never reaches a client:
  the proxy writes the standard one for the code.
- A header line is a token, a colon and a value with no control character but
  HTAB (RFC 9110 §5.5 and §5.6.2: llhttp refuses one, Twisted keeps it). No
  folded line (obs-fold; RFC 9112 §5.2 lets a proxy answer 502), no head over
  MAX_HEAD bytes.
- The body's framing is not ambiguous (RFC 9112 §6.3; a proxy that reads it
  one way while a client behind it reads it another is how responses are
  smuggled): a Transfer-Encoding is one header that says `chunked` (the proxy
  decodes no other coding, and a coding list or a second header may be read
  another way downstream); a Content-Length is one header of at most
  MAX_LENGTH_DIGITS digits (no list of lengths, however equal), and never beside
  a Transfer-Encoding. llhttp refuses a repeated Content-Length, a list and one
  beside Transfer-Encoding; Twisted takes them all.
- An interim (1xx) head is passed over, at most MAX_INTERIM of them before the
  final one; it is HTTP/1.1 and does not say `Connection: close` (the final
  answer comes on the same connection: llhttp stops reading at such a close),
  and is never a 101 Switching Protocols (the proxy never asks for an upgrade,
  and its client's connection would not switch).
"""

from __future__ import annotations

import re
from typing import Any

MAX_HEAD = 64 * 1024          # status line and headers of one response
MAX_INTERIM = 32              # interim (1xx) heads before a request's final one
MAX_LENGTH_DIGITS = 18        # a Content-Length (llhttp counts in 64 bits)

# RFC 9110 §5.6.2's tchar; what may not be in a field value (§5.5: CTLs but HTAB).
TCHAR = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_VERSIONS = (b"HTTP/1.1 ", b"HTTP/1.0 ")


class BadResponse(Exception):
    """The engine's response is not HTTP/1.1 the proxy can read; str() says how."""


def check_bytes(head: bytes | bytearray, more: bool = False) -> None:
    """BadResponse if `head` (bytes of a response head, its line breaks in it)
    holds a NUL, a bare LF or a CR outside a CRLF. `more`: the head goes on after
    these bytes, so a CR at their end may begin a CRLF."""
    if b"\0" in head:
        raise BadResponse("a NUL in the response head")
    crlf = head.count(b"\r\n")
    if head.count(b"\n") != crlf:
        raise BadResponse("a bare LF (without its CR) in the response head")
    if head.count(b"\r") - (more and head.endswith(b"\r")) != crlf:
        raise BadResponse("a CR (without its LF) in the response head")


def status_code(line: bytes) -> int:
    """The code of a status line; BadResponse if it is not one (see the module
    docstring)."""
    code = line[9:12]
    if line[:9] not in _VERSIONS or line[12:13] not in (b"", b" ") or \
            not code.isdigit() or not b"100" <= code <= b"599":
        raise BadResponse(f"bad status line: {line[:100]!r}")
    return int(code)


def interim(code: int, seen: int) -> bool:
    """Whether a head with `code`, after `seen` interim ones, is an interim one
    to pass over; BadResponse for a 101 or one interim head too many."""
    if code >= 200:
        return False
    if code == 101:
        raise BadResponse("101 Switching Protocols: the proxy's connection does not switch")
    if seen >= MAX_INTERIM:
        raise BadResponse(f"more than {MAX_INTERIM} interim (1xx) responses")
    return True


def field_line(line: bytes) -> tuple[bytes, bytes]:
    """A header (or trailer) line's name and its value, without the whitespace
    around it; BadResponse if it is not `token ":" value` with no control
    character but HTAB in the value, or is folded (its bytes already passed
    `check_bytes`)."""
    if line[:1] in (b" ", b"\t"):
        raise BadResponse(f"a folded header line: {line[:100]!r}")
    name, colon, value = line.partition(b":")
    if not colon or not name or name.translate(None, TCHAR):
        raise BadResponse(f"bad header line: {line[:100]!r}")
    value = value.strip(b" \t")
    if _CONTROL.search(value):
        raise BadResponse(f"a control character in a header value: {line[:100]!r}")
    return name, value


def chunked_framing(lengths: list[bytes], codings: list[bytes]) -> bool:
    """Whether a head whose Content-Length values are `lengths` and whose
    Transfer-Encoding values are `codings` frames its body chunked (else by its
    length, or by the close); BadResponse where the framing is ambiguous (see
    the module docstring)."""
    if codings:
        if len(codings) > 1 or codings[0].lower() != b"chunked":
            raise BadResponse(f"unsupported Transfer-Encoding: {b', '.join(codings)[:60]!r}")
        if lengths:
            raise BadResponse("a Content-Length beside Transfer-Encoding: chunked")
        return True
    if lengths and (len(lengths) > 1 or not lengths[0].isdigit() or
                    len(lengths[0]) > MAX_LENGTH_DIGITS):
        raise BadResponse(f"bad Content-Length: {b', '.join(lengths)[:60]!r}")
    return False


def says_close(connection: list[bytes]) -> bool:
    """Whether Connection header values name `close`."""
    return any(token.strip(b" \t").lower() == b"close"
               for value in connection for token in value.split(b","))


class HeadWatch:
    """The response heads of one request, checked as their bytes arrive (the
    body after the final head is not looked at). `expect()` when a request goes
    out; `feed(data)` with each read before the parser has it: BadResponse's
    text, or None. Once the final head is in: `connection`, its Connection
    values; `chunked`, whether a chunked body follows it; `rest`, the bytes of
    the last read after it."""

    def __init__(self) -> None:
        self.watching = False
        self.connection: list[bytes] = []
        self.chunked = False
        self.rest = b""
        self._no_body = False
        self._buf = bytearray()   # a head not whole yet
        self._checked = 0         # _buf up to here passed check_bytes
        self._interim = 0

    def expect(self, no_body: bool = False) -> None:
        """A request went out: its answer's head comes next (`no_body`: the
        request is a HEAD, whose answer has no body whatever its head says)."""
        self.watching, self.connection, self.chunked, self.rest = True, [], False, b""
        self._no_body = no_body
        self._buf, self._checked, self._interim = bytearray(), 0, 0

    def feed(self, data: bytes) -> str | None:
        """Why the heads so far are refused, or None (watching stops either way
        at the end of the final head)."""
        try:
            self._feed(data)
        except BadResponse as e:
            self.watching, self._buf = False, bytearray()
            return str(e)
        return None

    def _feed(self, data: bytes) -> None:
        buf: bytes | bytearray = data
        if self._buf:
            buf = self._buf
            buf += data           # (in place: a head cut into many reads costs no more)
        while self.watching:
            end = buf.find(b"\r\n\r\n", max(0, self._checked - 3))
            check_bytes(buf[self._checked:] if end < 0 else buf[self._checked:end], end < 0)
            if (len(buf) if end < 0 else end) > MAX_HEAD:
                raise BadResponse(f"response headers over {MAX_HEAD} bytes")
            if end < 0:
                # Each byte is checked once; a CR at the end again with what follows.
                self._buf = buf if isinstance(buf, bytearray) else bytearray(buf)
                self._checked = len(buf) - buf.endswith(b"\r")
                return
            self._head(bytes(buf[:end]))
            buf, self._checked = buf[end + 4:], 0
        self._buf, self.rest = bytearray(), bytes(buf)

    def _head(self, head: bytes) -> None:
        """One whole head (its bytes checked): an interim one counted, the final
        one ends the watch."""
        lines = head.split(b"\r\n")
        code = status_code(lines[0])
        lengths: list[bytes] = []
        codings: list[bytes] = []
        connection: list[bytes] = []
        for line in lines[1:]:
            name, value = field_line(line)
            lower = name.lower()
            if lower == b"content-length":
                lengths.append(value)
            elif lower == b"transfer-encoding":
                codings.append(value)
            elif lower == b"connection":
                connection.append(value)
        chunked = chunked_framing(lengths, codings)
        if interim(code, self._interim):
            if lines[0][:9] != b"HTTP/1.1 " or says_close(connection):
                raise BadResponse("an interim (1xx) response that closes the connection")
            self._interim += 1
            return
        self.connection, self.watching = connection, False
        self.chunked = chunked and code not in (204, 304) and not self._no_body

    def connection_header(self, response: Any) -> Any:
        """`response` (Twisted's, at its head) with the engine's Connection
        header on its headers, where Twisted's parser does not leave it: the
        relay drops it and the headers it names (RFC 9110 §7.6.1)."""
        if self.connection:
            response.headers.setRawHeaders(b"Connection", self.connection)
        return response
