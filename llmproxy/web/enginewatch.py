"""The reference engine client's watch over its connections' bytes: each
response head held to web.enginehead's rules, and a chunked body's framing to
the rules llhttp (the fast client's parser, speedups/engineconnection.py) holds
it to, before Twisted's parser reads either. So both clients give the same
engine bytes the same outcome, on public Twisted API alone (a ProtocolWrapper
between the transport and Twisted's HTTP client protocol).

A chunked body's framing, as llhttp reads it (where Twisted 26.10's
_ChunkedTransferDecoder takes more):

- A chunk size is hex digits, at most 2**64 - 1 (Twisted takes any size).
- Its extensions are `;name[=value]`, the name a token (maybe empty), the value
  a token, a quoted string or a token then a quoted string; no whitespace
  around them, no `;` at the end of the line (Twisted takes any printable
  byte after a `;`, and refuses a backslash and a control character).
- Every line ends with CRLF (Twisted waits for one), and the chunk's data with
  CRLF.
- A trailer line is a header line (web.enginehead.field_line), never a
  Content-Length (Twisted does not look at trailers).

Data that came before a fault in the same read reaches Twisted's parser first,
so the client gets it before the body ends in failure, as llhttp delivers it.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from errno import ECONNRESET, EPIPE
from typing import Any, cast

from twisted.internet.interfaces import (
    IDelayedCall,
    IHalfCloseableProtocol,
    IProtocol,
    IReactorTime,
    ITCPTransport,
)
from twisted.internet.protocol import connectionDone
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from zope.interface import implementer

from llmproxy.web.enginehead import MAX_HEAD, TCHAR, BadResponse, HeadWatch, field_line

MAX_SIZE_LINE = 1024          # Twisted's maxChunkSizeLineLength: it refuses longer ones
MAX_CHUNK_SIZE = 2**64 - 1    # llhttp's chunk size is 64 bits

_T = re.escape(TCHAR)
UNREAD_GRACE = 0.25   # seconds an unanswered connection waits, after a close, for a reset


def refused_after_close(transport: Any) -> bool:
    """Whether the engine's kernel, after the engine's close (EOF), has answered
    bytes sent here with a reset: the engine's program never read them (it
    closed with them unread, or they came after its close). RFC 9112 9.3.1's
    "some means to detect that the original request was never applied", so
    even a POST may go again. An engine that read a request whole and closed
    sends no reset. Asked while the socket is still open here; only a TCP
    socket tells (TLS, a test double: False)."""
    try:
        sock = transport.getHandle()
    except AttributeError:
        return False
    if not isinstance(sock, socket.socket) or sock.fileno() < 0:
        return False
    try:
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except OSError:
        return False
    return error in (EPIPE, ECONNRESET)     # (EPIPE: a reset after the peer's FIN)


def close_after_eof(transport: Any, clock: IReactorTime | None, unanswered: bool,
                    unread: Callable[[], None]) -> IDelayedCall | None:
    """An engine connection's half of IHalfCloseableProtocol.readConnectionLost:
    the engine closed (EOF). A connection whose request has no byte of an answer
    yet stays open up to UNREAD_GRACE for the engine's reset (the request may
    still be on its way out of this side's buffer, or the reset on its way
    back), and `unread()` is called if it comes; then the connection closes,
    as it would have at once without this interface. The timer it returns is
    for the caller to cancel when the connection is lost first."""
    if unanswered and refused_after_close(transport):
        unread()
    elif unanswered and clock is not None:
        def settle() -> None:
            if refused_after_close(transport):
                unread()
            transport.loseConnection()
        return clock.callLater(UNREAD_GRACE, settle)
    transport.loseConnection()
    return None


_QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
# A size line without its CRLF, as llhttp takes it: the size, then extensions.
_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]+)(?:;(?!\Z)[" + _T + rb"]*(?:=[" + _T + rb"]*(?:"
                        + _QUOTED + rb")?)?)*")
# A whole chunk's head with a bare size (at most 16 hex digits: within 64 bits
# and MAX_SIZE_LINE), which the rules always take: ChunkWatch's fast path.
_PLAIN_HEAD = re.compile(rb"([0-9A-Fa-f]{1,16})\r\n")
_SIZE, _DATA, _CRLF, _TRAILER = range(4)


class _Refused(Exception):
    """The framing breaks a rule (`reason`) on a line that begins at `at` in
    the read (0 when it began in an earlier one)."""

    def __init__(self, at: int, reason: BadResponse) -> None:
        super().__init__(at, reason)
        self.at, self.reason = at, reason


class ChunkWatch:
    """A chunked body's framing, checked as its bytes arrive (see the module
    docstring). `feed(data)`: where in `data` the first line the rules refuse
    begins (`why` says how), or -1; `done` once the last chunk and its
    trailers are in (nothing after them is looked at)."""

    def __init__(self) -> None:
        self.done = False
        self.why = ""
        self._state = _SIZE
        self._left = 0            # _DATA: bytes of the chunk to come; _CRLF: of its CRLF seen
        self._line = bytearray()  # a size or trailer line cut between reads

    def feed(self, data: bytes) -> int:
        pos, end = 0, len(data)
        try:
            while pos < end and not self.done:
                state = self._state
                if state == _SIZE and not self._line:
                    pos = self._whole_chunks(data, pos)
                    if pos == end:
                        break
                if state == _DATA:
                    take = min(self._left, end - pos)
                    pos += take
                    self._left -= take
                    if not self._left:
                        self._state = _CRLF
                elif state == _CRLF:
                    pos = self._crlf(data, pos)
                else:
                    pos = self._next_line(data, pos)
        except _Refused as refused:
            self.why = str(refused.reason)
            return refused.at
        return -1

    @staticmethod
    def _whole_chunks(data: bytes, pos: int) -> int:
        """The fast path: past the whole non-empty chunks from `pos` (at a
        size line's start) whose size line is a bare size, each in one scan
        (the rules take every such chunk whole, and leave the state as they
        found it: at a size line). Where the first other one begins, for the
        line-by-line path."""
        match, ends_line = _PLAIN_HEAD.match, data.startswith
        head = match(data, pos)
        while head is not None:
            size = int(head.group(1), 16)
            stop = head.end() + size
            if not size or not ends_line(b"\r\n", stop):
                break
            pos = stop + 2
            head = match(data, pos)
        return pos

    def _crlf(self, data: bytes, pos: int) -> int:
        """The CRLF after a chunk's data (perhaps cut between reads), from `pos`."""
        expected = b"\r\n"[self._left:]
        got = data[pos:pos + len(expected)]
        if not expected.startswith(got):
            raise _Refused(pos, BadResponse("chunked body: a chunk longer than its size"))
        self._left += len(got)
        if self._left == 2:
            self._state = _SIZE
        return pos + len(got)

    def _next_line(self, data: bytes, pos: int) -> int:
        """A size or trailer line from `pos` (held while it is cut), checked
        once it ends; where the next one begins."""
        eol = data.find(b"\n", pos)
        if eol < 0:
            self._line += data[pos:]
            if len(self._line) > (MAX_SIZE_LINE if self._state == _SIZE else MAX_HEAD):
                raise _Refused(pos, BadResponse("chunked body: a size or trailer line too long"))
            return len(data)
        line = data[pos:eol]
        if self._line:
            line, self._line = bytes(self._line + line), bytearray()
        try:
            if not line.endswith(b"\r") or b"\r" in line[:-1]:
                raise BadResponse("chunked body: a bare LF or CR in its framing")
            if self._state == _SIZE:
                self._size(line[:-1])
            else:
                self._trailer(line[:-1])
        except BadResponse as e:
            raise _Refused(pos, e) from None
        return eol + 1

    def _size(self, line: bytes) -> None:
        found = _SIZE_LINE.fullmatch(line)
        if found is None or len(line) >= MAX_SIZE_LINE:
            raise BadResponse(f"chunked body: bad chunk size line {line[:40]!r}")
        size = int(found.group(1), 16)
        if size > MAX_CHUNK_SIZE:
            raise BadResponse(f"chunked body: a chunk size over 64 bits {line[:40]!r}")
        self._state, self._left = (_DATA, size) if size else (_TRAILER, 0)

    def _trailer(self, line: bytes) -> None:
        if not line:
            self.done = True          # the empty line after the trailers: the body's end
            return
        name, _ = field_line(line)
        if name.lower() == b"content-length":
            raise BadResponse("chunked body: a Content-Length trailer")


@implementer(IHalfCloseableProtocol)
class WatchedConnection(ProtocolWrapper):
    """Between an engine connection's transport and Twisted's HTTP client
    protocol. `heard`: a byte came since the request went out (`expect`);
    `unread`: the engine closed and then refused what was sent since without a
    byte of an answer (`refused_after_close`), so it never read the request. Each
    response head is held to web.enginehead's rules, and a chunked body's
    framing to ChunkWatch's, before the protocol reads them: a read that breaks
    them reaches the protocol only up to the line at fault (the data before it),
    then the protocol loses its connection with BadResponse as the reason (its
    request fails around it, or its body ends so), and the connection is aborted."""

    heard = False
    unread = False
    refused = False
    _settle: IDelayedCall | None = None

    def __init__(self, factory: WrappingFactory[WatchedConnection],
                 wrappedProtocol: IProtocol) -> None:
        super().__init__(factory, wrappedProtocol)
        self.watch = HeadWatch()
        self.chunks: ChunkWatch | None = None

    def expect(self, no_body: bool = False) -> None:
        """A request goes out on this connection: watch its answer (`no_body`:
        it is a HEAD request's)."""
        self.heard = self.unread = False
        self.watch.expect(no_body)
        self.chunks = None

    def dataReceived(self, data: bytes) -> None:
        self.heard = True
        if self.refused:
            return
        watch, body = self.watch, data
        if watch.watching:
            why = watch.feed(data)
            if why is not None:
                self._refuse(why, b"")
                return
            body, watch.rest = watch.rest, b""
            if not watch.chunked:          # (still in the heads, or no chunked body)
                super().dataReceived(data)
                return
            self.chunks = ChunkWatch()
        chunks = self.chunks
        if chunks is not None:
            at = chunks.feed(body)
            if at >= 0:
                self._refuse(chunks.why, data[:len(data) - len(body) + at])
                return
            if chunks.done:
                self.chunks = None
        super().dataReceived(data)

    def _refuse(self, why: str, before: bytes) -> None:
        """The rules refuse what came after `before` (the start of this read):
        that reaches the protocol, then the loss with BadResponse."""
        if before:
            super().dataReceived(before)
        self.refused = True
        self.wrappedProtocol.connectionLost(Failure(BadResponse(why)))
        cast(ITCPTransport, self.transport).abortConnection()   # TCP or TLS

    def readConnectionLost(self) -> None:
        """The engine closed (EOF): see close_after_eof."""
        self._settle = close_after_eof(self.transport, self.factory.clock, not self.heard,
                                       self._unread)

    def _unread(self) -> None:
        self.unread = True

    def writeConnectionLost(self) -> None:
        """Never half-closed here."""

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._settle is not None and self._settle.active():
            self._settle.cancel()
        if not self.refused:
            super().connectionLost(reason)
            return
        # The protocol already lost it, with the reason: as ProtocolWrapper, without that.
        self.factory.unregisterProtocol(self)
        self.wrappedProtocol = None  # type: ignore[assignment]


class WatchedFactory(WrappingFactory[WatchedConnection]):
    """Makes each engine connection a WatchedConnection; `clock` times the wait
    for an engine's reset (close_after_eof; without one, none)."""

    protocol = WatchedConnection
    noisy = False

    def __init__(self, wrappedFactory: Any, clock: IReactorTime | None = None) -> None:
        super().__init__(wrappedFactory)
        self.clock = clock
