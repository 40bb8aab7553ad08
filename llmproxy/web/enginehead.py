"""The rules an engine's response head is held to before anything of it reaches
a client, and the watch that holds Twisted's client to them.

Both engine clients refuse the same heads: the fast one
(speedups/engineconnection.py) in its own parse, the reference one
(web/engineclient.py) through `WatchedConnection`, which reads each head's
bytes before Twisted's parser does. A refused head is `BadResponse`: the request
fails with ResponseNeverReceived (or ResponseFailed) around it, its connection is
aborted, and the client gets the proxy's 502 `upstream_failed`.

- Line breaks are CRLF. A bare LF, a CR outside a CRLF, or a NUL anywhere in a
  head is refused (Twisted 26.10's HTTPClientParser takes a bare LF for a line
  break, so `200 OK\\nSet-Cookie: x` would hand on a header of the engine's
  making, and it keeps a NUL in a value).
- The status line is `HTTP/1.<digit> <code>[ <phrase>]`, the code 100 to 599
  (RFC 9110 §15: any other is invalid). The phrase never reaches a client: the
  proxy writes the standard one for the code.
- An interim (1xx) head is passed over, at most MAX_INTERIM of them before the
  final one; a 101 Switching Protocols is refused (the proxy never asks for an
  upgrade, and its client's connection would not switch).
- No folded header line (obs-fold; RFC 9112 §5.2 lets a proxy answer 502), and
  no head over MAX_HEAD bytes.
"""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.interfaces import IProtocol, ITCPTransport
from twisted.internet.protocol import connectionDone
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure

MAX_HEAD = 64 * 1024          # status line and headers of one response
MAX_INTERIM = 32              # interim (1xx) heads before a request's final one


class BadResponse(Exception):
    """The engine's response is not HTTP/1.1 the proxy can read; str() says how."""


def check_bytes(head: bytes, more: bool = False) -> None:
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
    if line[:7] != b"HTTP/1." or not line[7:8].isdigit() or line[8:9] != b" " or \
            line[12:13] not in (b"", b" ") or not code.isdigit() or \
            not b"100" <= code <= b"599":
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


class HeadWatch:
    """The response heads of one request, checked as their bytes arrive (the
    body after the final head is not looked at). `expect()` when a request goes
    out; `feed(data)` with each read before the parser has it: BadResponse's
    text, or None. `connection`: the final head's Connection values."""

    def __init__(self) -> None:
        self.watching = False
        self.connection: list[bytes] = []
        self._buf = b""
        self._checked = 0         # _buf up to here passed check_bytes
        self._interim = 0

    def expect(self) -> None:
        """A request went out: its answer's head comes next."""
        self.watching, self.connection = True, []
        self._buf, self._checked, self._interim = b"", 0, 0

    def feed(self, data: bytes) -> str | None:
        """Why the heads so far are refused, or None (watching stops either way
        at the end of the final head)."""
        try:
            self._feed(data)
        except BadResponse as e:
            self.watching, self._buf = False, b""
            return str(e)
        return None

    def _feed(self, data: bytes) -> None:
        buf = self._buf + data
        while self.watching:
            end = buf.find(b"\r\n\r\n", max(0, self._checked - 3))
            check_bytes(buf[self._checked:] if end < 0 else buf[self._checked:end], end < 0)
            if (len(buf) if end < 0 else end) > MAX_HEAD:
                raise BadResponse(f"response headers over {MAX_HEAD} bytes")
            if end < 0:
                # Each byte is checked once; a CR at the end again with what follows.
                self._buf, self._checked = buf, len(buf) - buf.endswith(b"\r")
                return
            self._head(buf[:end])
            buf, self._checked = buf[end + 4:], 0
        self._buf = b""

    def _head(self, head: bytes) -> None:
        """One whole head (its bytes checked): an interim one counted, the final
        one ends the watch."""
        lines = head.split(b"\r\n")
        if interim(status_code(lines[0]), self._interim):
            self._interim += 1
            return
        for line in lines[1:]:
            if line[:1] in (b" ", b"\t"):
                raise BadResponse(f"a folded header line: {line[:100]!r}")
            name, _, value = line.partition(b":")
            if name.lower() == b"connection":
                self.connection.append(value.strip())
        self.watching = False

    def connection_header(self, response: Any) -> Any:
        """`response` (Twisted's, at its head) with the engine's Connection
        header on its headers, where Twisted's parser does not leave it: the
        relay drops it and the headers it names (RFC 9110 §7.6.1)."""
        if self.connection:
            response.headers.setRawHeaders(b"Connection", self.connection)
        return response


class WatchedConnection(ProtocolWrapper):
    """Between an engine connection's transport and Twisted's HTTP client
    protocol. `heard`: a byte came since the request went out (`expect`). Each
    response head is held to this module's rules before the protocol reads
    it: a read that breaks them never reaches the protocol, which loses its
    connection with BadResponse as the reason (its request fails around it),
    and the connection is aborted."""

    heard = False
    refused = False

    def __init__(self, factory: WrappingFactory[WatchedConnection],
                 wrappedProtocol: IProtocol) -> None:
        super().__init__(factory, wrappedProtocol)
        self.watch = HeadWatch()

    def expect(self) -> None:
        """A request goes out on this connection: watch its answer's head."""
        self.heard = False
        self.watch.expect()

    def dataReceived(self, data: bytes) -> None:
        self.heard = True
        if self.refused:
            return
        why = self.watch.feed(data) if self.watch.watching else None
        if why is None:
            super().dataReceived(data)
            return
        self.refused = True
        self.wrappedProtocol.connectionLost(Failure(BadResponse(why)))
        cast(ITCPTransport, self.transport).abortConnection()   # TCP or TLS

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if not self.refused:
            super().connectionLost(reason)
            return
        # The protocol already lost it, with the reason: as ProtocolWrapper, without that.
        self.factory.unregisterProtocol(self)
        self.wrappedProtocol = None  # type: ignore[assignment]


class WatchedFactory(WrappingFactory[WatchedConnection]):
    """Makes each engine connection a WatchedConnection."""

    protocol = WatchedConnection
    noisy = False
