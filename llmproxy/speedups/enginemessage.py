"""The pieces of an engine exchange around the connection (engineconnection):
a request's head, a body producer's chunk framing, a response's headers and
chunk size lines, and the response as the proxy's code sees it (Twisted's
IResponse: `code`, `phrase`, `headers`, `length`, `deliverBody`), which holds
body bytes that arrive before `deliverBody`. What a response head may hold is
web.enginehead's (BadResponse is its error)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers, InvalidHeaderName, _nameEncoder

from llmproxy.web.enginehead import BadResponse

MAX_SIZE_LINE = 1024          # a chunk's size line (extensions included)
_HEX = b"0123456789abcdefABCDEF"


def checked_name(name: bytes) -> bytes:
    """A header name Headers has not seen yet, canonicalized; BadResponse if it
    is not a token."""
    try:
        return _nameEncoder.encode(name)
    except InvalidHeaderName:
        raise BadResponse(f"bad header name: {name[:100]!r}") from None


# The names Headers has canonicalized so far (its own cache), looked up first.
_canonical = getattr(_nameEncoder, "_canonicalHeaderCache", {}).get
# Kept out of a response's `headers`: the framing headers and Keep-Alive, which
# the connection reads itself (Twisted's client keeps them apart too).
# Connection stays in, for the relay to drop it and the headers it names (RFC
# 9110 §7.6.1).
_FRAMING_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"keep-alive"})


def response_headers(lines: list[bytes]
                     ) -> tuple[Headers, int | None, bool, bool, float | None]:
    """A response head's end-to-end headers and its Connection header (its
    `lines` after the status line, the head's bytes already checked by
    web.enginehead.check_bytes: no CR, LF or NUL in them), its Content-Length,
    whether its body is chunked, whether it says `Connection: close`, the idle
    timeout its `Keep-Alive` gives. BadResponse for a head the proxy cannot read."""
    raw: dict[bytes, list[bytes]] = {}
    length: int | None = None
    chunked = close = False
    idle: float | None = None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise BadResponse(f"bad header line: {line[:100]!r}")
        lower, value = name.lower(), value.strip()
        if lower not in _FRAMING_HEADERS:
            # As Headers.addRawHeader: a canonical name (the value has no CR or LF).
            name = _canonical(name) or checked_name(name)
            values = raw.get(name)
            if values is None:
                raw[name] = [value]
            else:
                values.append(value)
            if lower == b"connection" and b"close" in value.lower():
                close = True
        elif lower == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise BadResponse(f"bad Content-Length: {value[:40]!r}")
            length = int(value)
        elif lower == b"transfer-encoding":
            chunked = value.lower() == b"chunked"
            if not chunked:
                raise BadResponse(f"unsupported Transfer-Encoding: {value[:40]!r}")
        else:
            idle = keep_alive_timeout(value)
    headers = Headers()
    headers._rawHeaders = raw
    return headers, length, chunked, close, idle


def keep_alive_timeout(value: bytes) -> float | None:
    """The seconds a server keeps an idle connection open, as a `Keep-Alive`
    header's `timeout` says (llama-server's cpp-httplib sends `timeout=5,
    max=100`); None without a timeout of whole seconds."""
    for part in value.split(b","):
        name, equals, seconds = part.partition(b"=")
        seconds = seconds.strip()
        if equals and name.strip().lower() == b"timeout" and seconds.isdigit() \
                and len(seconds) <= 9:
            return float(seconds)
    return None


def chunk_size(line: bytes) -> int:
    """A chunk size line's size (extensions ignored); -1 when it is not one."""
    if 0 < len(line) <= 15 and not line.strip(_HEX):
        return int(line, 16)           # plain hex, the usual line
    digits = line.split(b";", 1)[0].strip()
    if not digits or len(digits) > 15 or digits.strip(_HEX):
        return -1
    return int(digits, 16)


def whole_chunks(data: bytes) -> tuple[int, int]:
    """How far `data` begins with whole chunks (each a size line of plain hex,
    its data, CRLF; not the last chunk), and how many bytes of data they hold:
    (0, 0) when it does not begin with one."""
    pos = total = 0
    end = len(data)
    while True:
        eol = data.find(b"\r\n", pos)
        if not 0 < eol - pos <= 15:
            break
        line = data[pos:eol]
        if line.strip(_HEX):
            break
        size = int(line, 16)
        after = eol + 2 + size
        if not size or after + 2 > end or data[after:after + 2] != b"\r\n":
            break
        total += size
        pos = after + 2
    return pos, total


def unframe(framed: bytes, size: int) -> bytes:
    """The `size` bytes of data in whole chunks as an engine framed them (what
    `whole_chunks` found)."""
    eol = framed.find(b"\r\n")
    if eol + size + 4 == len(framed):
        return framed[eol + 2:-2]          # one chunk, the usual
    out, pos = [], 0
    while pos < len(framed):
        eol = framed.find(b"\r\n", pos)
        end = eol + 2 + int(framed[pos:eol], 16)
        out.append(framed[eol + 2:end])
        pos = end + 2
    return b"".join(out)


def request_head(method: bytes, path: bytes, host: bytes, headers: Headers,
                 length: int | None) -> bytes:
    """A request's head: `length` None for no body, -1 for a chunked one."""
    out = [method, b" ", path, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    for name, values in headers._rawHeaders.items():   # getAllRawHeaders, without its generator
        for value in values:
            out += (name, b": ", value, b"\r\n")
    if length == -1:
        out.append(b"Transfer-Encoding: chunked\r\n")
    elif length is not None:
        out.append(b"Content-Length: %d\r\n" % length)
    out.append(b"\r\n")
    return b"".join(out)


class _BodyTransport:
    """What a body protocol sees as its transport: pause, resume or stop the
    engine connection (stop closes it: the rest of the body is not wanted), and
    where the body's whole chunks go (`take_chunks`)."""

    def __init__(self, connection: Any, response: UpstreamResponse) -> None:
        self._connection = connection
        self._response = response

    def take_chunks(self, handler: Callable[[bytes, int], None] | None) -> None:
        """From now on the body's whole chunks go to `handler` (framed, as
        `chunkReceived` takes them); None: to the protocol's `chunkReceived`
        again."""
        response = self._response
        response.chunk = response._chunked if handler is None else handler

    def pauseProducing(self) -> None:
        self._connection.transport.pauseProducing()

    def resumeProducing(self) -> None:
        self._connection.transport.resumeProducing()

    def stopProducing(self) -> None:
        self._connection.transport.abortConnection()

    abortConnection = stopProducing


def _nowhere(*_: object) -> None:
    """Where a body's bytes would go after its end (nowhere: none come)."""


class UpstreamResponse:
    """An engine's response: status, headers and the body, delivered once."""

    version = (b"HTTP", 1, 1)
    request = None
    previousResponse = None

    def __init__(self, code: int, phrase: bytes, headers: Headers, length: int | object,
                 connection: Any) -> None:
        self.code, self.phrase, self.headers, self.length = code, phrase, headers, length
        self._connection = connection
        self._protocol: Protocol | None = None
        self._early: list[bytes] = []          # body bytes before deliverBody
        self._end: Failure | None = None       # how the body ended, before deliverBody
        # Where body bytes go: held until deliverBody, then straight to the protocol.
        self.receive: Callable[[bytes], None] = self._early.append
        # Where whole chunks go as the engine framed them (`size` bytes of data
        # in all; one chunk, usually): to a protocol that takes them so
        # (`chunkReceived`, see relay.py), else their data to `receive`.
        self.chunk: Callable[[bytes, int], None] = self._unframed
        self._chunked: Callable[[bytes, int], None] = self._unframed   # the protocol's way for them

    def _unframed(self, framed: bytes, size: int) -> None:
        self.receive(unframe(framed, size))

    def deliverBody(self, protocol: Protocol) -> None:
        self._protocol = protocol
        self._chunked = getattr(protocol, "chunkReceived", self._unframed)
        protocol.makeConnection(_BodyTransport(self._connection, self))
        early, self._early = self._early, []
        self.receive = protocol.dataReceived
        self.chunk = self._chunked
        for data in early:
            protocol.dataReceived(data)
        if self._end is not None:
            self._let_go()
            protocol.connectionLost(self._end)

    def _ended(self, reason: Failure) -> None:
        protocol = self._protocol
        if protocol is None:
            self._end = reason
        else:
            self._let_go()
            protocol.connectionLost(reason)

    def _let_go(self) -> None:
        """The body is over: the response lets go of its protocol (and of its
        own methods), so it, the protocol and their body transport are freed by
        their reference counts when the exchange is over, not left as a cycle
        for the garbage collector (a request's whole record hangs off a relay)."""
        self._protocol = None
        self.receive = self.chunk = self._chunked = _nowhere


class ChunkedConsumer:
    """A request body's consumer that frames each write as a chunk."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        if data:
            self._transport.writeSequence([b"%x\r\n" % len(data), data, b"\r\n"])

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass
