"""The pieces of an engine exchange around the connection (h1client): a
request's head, a body producer's chunk framing, and the response as the proxy's
code sees it (Twisted's IResponse: `code`, `phrase`, `headers`, `length`,
`deliverBody`), which holds body bytes that arrive before `deliverBody`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers


def request_head(method: bytes, path: bytes, host: bytes, headers: Headers,
                 length: int | None) -> bytes:
    """A request's head: `length` None for no body, -1 for a chunked one."""
    out = [method, b" ", path, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    for name, values in headers.getAllRawHeaders():
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
    engine connection (stop closes it: the rest of the body is not wanted)."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def pauseProducing(self) -> None:
        self._connection.transport.pauseProducing()

    def resumeProducing(self) -> None:
        self._connection.transport.resumeProducing()

    def stopProducing(self) -> None:
        self._connection.transport.abortConnection()

    abortConnection = stopProducing


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

    def deliverBody(self, protocol: Protocol) -> None:
        self._protocol = protocol
        protocol.makeConnection(_BodyTransport(self._connection))
        early, self._early = self._early, []
        self.receive = protocol.dataReceived
        for data in early:
            protocol.dataReceived(data)
        if self._end is not None:
            protocol.connectionLost(self._end)

    def _ended(self, reason: Failure) -> None:
        if self._protocol is None:
            self._end = reason
        else:
            self._protocol.connectionLost(reason)


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
