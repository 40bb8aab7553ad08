"""Test doubles that ship with the package: a fake upstream HTTP client, and an
in-memory way to talk HTTP to a Site (as twisted.internet.testing does for
transports), and a process reactor whose upgrade candidates are ready at once."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH
from twisted.web.server import Site
from zope.interface import implementer

from llmproxy.hosts.host import Host
from llmproxy.hosts.scheduler import Scheduler
from llmproxy.hosts.waiter import Lease


@implementer(IPushProducer)
class FakeBodyTransport:
    """The upstream side of a streaming body: records pause/resume/stop."""

    def __init__(self, response: FakeResponse) -> None:
        self._response = response
        self.paused = self.stopped = False

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        # As a real upstream connection does: closing it ends the body in failure.
        if not self.stopped:
            self.stopped = True
            self._response.lose(Failure(ResponseFailed([Failure(ConnectionDone())])))

    abortConnection = stopProducing     # as the engine connection's body transport has it

    def take_data(self, handler: Callable[[bytes], None] | None) -> None:
        """As the engine connection's body transport: the body's data goes to
        `handler` (None: to the protocol's dataReceived again)."""
        self._response.data_handler = handler


class FakeResponse:
    """An upstream response whose body the test sends piece by piece."""

    def __init__(self, code: int = 200, headers: dict[str, str] | None = None,
                 phrase: bytes = b"OK") -> None:
        self.code = code
        self.phrase = phrase
        headers = dict(headers or {})
        # As in Twisted's client: the length is an attribute, not a header.
        length = next((headers.pop(k) for k in list(headers) if k.lower() == "content-length"),
                      None)
        self.length: object = int(length) if length is not None else UNKNOWN_LENGTH
        self.headers = Headers({k: [v] for k, v in headers.items()})
        self.transport = FakeBodyTransport(self)
        self.protocol: Protocol | None = None
        self.data_handler: Callable[[bytes], None] | None = None
        self._ended = False

    def deliverBody(self, protocol: Protocol) -> None:
        self.protocol = protocol
        protocol.makeConnection(self.transport)

    def send(self, data: bytes) -> None:
        """One read's body data, as the engine client hands it over: to the
        protocol, or where its transport's `take_data` asked."""
        assert self.protocol is not None and not self._ended
        (self.data_handler or self.protocol.dataReceived)(data)

    def finish(self) -> None:
        self.lose(Failure(ResponseDone()))

    def die(self) -> None:
        """The engine crashed mid-body."""
        self.lose(Failure(ResponseFailed([Failure(ConnectionLost("engine went away"))])))

    def lose(self, reason: Failure) -> None:
        if self.protocol is not None and not self._ended:
            self._ended = True
            self.protocol.connectionLost(reason)


@dataclass
class FakeCall:
    """One request the code under test sent upstream."""

    method: str
    url: str
    kwargs: dict[str, Any]
    deferred: Deferred[Any]
    cancelled: bool = False

    @property
    def body(self) -> bytes:
        data: bytes = self.kwargs.get("data", b"")
        return data

    @property
    def headers(self) -> Headers:
        headers: Headers = self.kwargs.get("headers", Headers())
        return headers


@dataclass
class FakeHTTPClient:
    """A treq-like client whose requests the test answers by hand."""

    calls: list[FakeCall] = field(default_factory=list)

    def request(self, method: str, url: str, **kwargs: Any) -> Deferred[Any]:
        def cancel(d: Deferred[Any]) -> None:
            call.cancelled = True
            # What treq does when cancelled before the response headers.
            d.errback(ResponseNeverReceived([Failure(CancelledError())]))

        d: Deferred[Any] = Deferred(cancel)
        call = FakeCall(method, url, kwargs, d)
        self.calls.append(call)
        return d

    def get(self, url: str, **kwargs: Any) -> Deferred[Any]:
        return self.request("GET", url, **kwargs)


@dataclass
class ParsedResponse:
    """An HTTP/1.1 response read back from the bytes a server wrote."""

    status: int
    headers: dict[str, str]
    body: bytes
    complete: bool   # the body reached its declared end (last chunk / Content-Length)

    def json(self) -> Any:
        import json

        return json.loads(self.body)


def parse_response(data: bytes) -> ParsedResponse:
    """Parse one response, tolerating a body that was cut short."""
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size_line, sep, rest = rest.partition(b"\r\n")
            if not sep:
                return ParsedResponse(status, headers, body, False)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                return ParsedResponse(status, headers, body, rest.startswith(b"\r\n"))
            chunk, rest = rest[:size], rest[size + 2:]
            body += chunk
            if len(chunk) < size:
                return ParsedResponse(status, headers, body, False)
    length = headers.get("content-length")
    if length is not None:
        n = int(length)
        return ParsedResponse(status, headers, rest[:n], len(rest) >= n)
    return ParsedResponse(status, headers, rest, False)


class ClientTransport(StringTransport):
    """A StringTransport that can also half-close, as a TCP transport does."""

    write_closed = False

    def loseWriteConnection(self) -> None:
        self.write_closed = True


class Connection:
    """One client connection to a Site, in memory."""

    def __init__(self, site: Site, client_ip: str = "10.1.2.3") -> None:
        self.transport = ClientTransport(
            hostAddress=IPv4Address("TCP", "127.0.0.1", 8080),
            peerAddress=IPv4Address("TCP", client_ip, 40000))
        # Site builds a wrapper that picks HTTP/1.1 or h2; it forwards everything.
        channel: Any = site.buildProtocol(IPv4Address("TCP", client_ip, 40000))
        self.channel = channel
        channel.makeConnection(self.transport)

    def send(self, method: str, path: str, body: bytes = b"",
             headers: dict[str, str] | None = None) -> None:
        lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1:8080"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if method == "POST" or body:
            lines.append(f"Content-Length: {len(body)}")
        self.channel.dataReceived("\r\n".join(lines).encode() + b"\r\n\r\n" + body)

    def response(self) -> ParsedResponse:
        return parse_response(self.transport.value())

    def disconnect(self) -> None:
        self.channel.connectionLost(Failure(ConnectionDone()))

    @property
    def closed(self) -> bool:
        return bool(self.transport.disconnecting)


class Acquire:
    """One `acquire()` on a host's queue (a Host, or its Scheduler) and what
    became of it: a Lease, a failure, or still waiting."""

    def __init__(self, gate: Host | Scheduler, engine: str | None = None, name: str = "") -> None:
        self.name = name
        self.result: Any = None
        self.deferred = gate.acquire(engine, name or None)
        self.deferred.addBoth(self._done)

    def _done(self, result: Any) -> None:
        self.result = result

    @property
    def lease(self) -> Lease:
        assert isinstance(self.result, Lease), self.result
        return self.result

    @property
    def waiting(self) -> bool:
        return self.result is None


def read_body(response: Any) -> Deferred[bytes]:
    """Twisted's readBody, for tests: a response's body, whole. (It warns of the body transport
    of Twisted's own client, which has no abortConnection; a test never cancels the read.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Using readBody with a transport", DeprecationWarning)
        return readBody(response)
