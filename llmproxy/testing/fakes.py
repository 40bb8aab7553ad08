"""Test doubles that ship with the package: a fake upstream HTTP client, and an
in-memory way to talk HTTP to a Site (as twisted.internet.testing does for
transports)."""

from __future__ import annotations

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
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH
from twisted.web.server import Site
from zope.interface import implementer

from llmproxy.hosts.queue import Gate, Lease


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
        lines = [f"{method} {path} HTTP/1.1", "Host: proxy"]
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


# Doubles for engine management: a fake agent transport and a fake process reactor.
from twisted.internet.error import ProcessDone, ProcessTerminated  # noqa: E402
from twisted.internet.task import Clock  # noqa: E402

from llmproxy.config import HostConfig  # noqa: E402
from llmproxy.hosts.agentclient import AgentError, IAgentTransport  # noqa: E402


@dataclass
class AgentCall:
    """One order the code under test sent to a host's agent; the test answers it."""

    host: HostConfig
    order: dict[str, Any]
    timeout: float
    deferred: Deferred[dict[str, Any]]

    def answer(self, answer: dict[str, Any]) -> None:
        """The agent's JSON answer (``"ok": false`` ones too)."""
        self.deferred.callback(answer)

    def fail(self, reason: str) -> None:
        """No answer could be had (ssh failed, timeout...)."""
        self.deferred.errback(AgentError(reason))


@implementer(IAgentTransport)
@dataclass
class FakeAgentTransport:
    """An IAgentTransport that records every call; each answer is given by the test
    through the call's Deferred (AgentCall.answer / AgentCall.fail)."""

    calls: list[AgentCall] = field(default_factory=list)

    def call(self, host: HostConfig, order: dict[str, Any],
             timeout: float) -> Deferred[dict[str, Any]]:
        d: Deferred[dict[str, Any]] = Deferred()
        self.calls.append(AgentCall(host, order, timeout, d))
        return d

    def kill_all(self) -> int:
        """Fail every pending call as killed; how many."""
        pending = self.pending
        for call in pending:
            call.deferred.errback(AgentError(f"agent on {call.host.name}: killed"))
        return len(pending)

    @property
    def orders(self) -> list[dict[str, Any]]:
        return [c.order for c in self.calls]

    @property
    def pending(self) -> list[AgentCall]:
        """Calls not answered yet."""
        return [c for c in self.calls if not c.deferred.called]

    def last(self, op: str | None = None) -> AgentCall:
        """The latest call (of op `op`)."""
        return [c for c in self.calls if op is None or c.order.get("op") == op][-1]


class FakeProcess:
    """A process spawned on FakeProcessReactor: what it was given, and controls for the
    test to play the child's part (output, exit)."""

    def __init__(self, protocol: Any, executable: str, args: list[str],
                 env: dict[str, str] | None, pid: int) -> None:
        self.protocol = protocol
        self.executable = executable
        self.args = args
        self.env = env
        self.pid: int | None = pid
        self.stdin = b""
        self.stdin_closed = False
        self.signals: list[str | int] = []

    # IProcessTransport, as far as process protocols use it
    def write(self, data: bytes) -> None:
        assert not self.stdin_closed, "write after closeStdin"
        self.stdin += data

    def writeSequence(self, data: list[bytes]) -> None:
        for chunk in data:
            self.write(chunk)

    def closeStdin(self) -> None:
        self.stdin_closed = True

    def closeStdout(self) -> None:
        pass

    def closeStderr(self) -> None:
        pass

    def closeChildFD(self, fd: int) -> None:
        if fd == 0:
            self.stdin_closed = True

    def loseConnection(self) -> None:
        self.stdin_closed = True

    def signalProcess(self, signal: str | int) -> None:
        self.signals.append(signal)

    # the child's part
    def out(self, data: bytes) -> None:
        self.protocol.childDataReceived(1, data)

    def err(self, data: bytes) -> None:
        self.protocol.childDataReceived(2, data)

    def exit(self, code: int = 0, signal: int | None = None) -> None:
        """The child ends: pipes close, then it is reaped."""
        reason = Failure(ProcessDone(0) if code == 0 and signal is None
                         else ProcessTerminated(code if signal is None else None, signal))
        for fd in (0, 1, 2):
            self.protocol.childConnectionLost(fd)
        self.pid = None
        self.protocol.processExited(reason)
        self.protocol.processEnded(reason)


class FakeProcessReactor(Clock):
    """A task.Clock that also records spawnProcess calls (as FakeProcess objects) instead
    of running anything; set `spawn_error` to make the next spawn raise."""

    def __init__(self) -> None:
        super().__init__()
        self.processes: list[FakeProcess] = []
        self.spawn_error: OSError | None = None
        self._next_pid = 4000

    def spawnProcess(self, processProtocol: Any, executable: str, args: Any = (),
                     env: dict[str, str] | None = None, path: str | None = None,
                     uid: int | None = None, gid: int | None = None, usePTY: bool = False,
                     childFDs: dict[int, Any] | None = None) -> FakeProcess:
        if self.spawn_error is not None:
            error, self.spawn_error = self.spawn_error, None
            raise error
        self._next_pid += 1
        process = FakeProcess(processProtocol, executable, list(args), env, self._next_pid)
        self.processes.append(process)
        processProtocol.makeConnection(process)
        return process


class Acquire:
    """One `acquire()` on a host's queue (a Gate, or a HostManager, which is one)
    and what became of it: a Lease, a failure, or still waiting."""

    def __init__(self, gate: Gate, engine: str | None = None, name: str = "") -> None:
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
