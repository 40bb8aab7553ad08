"""Doubles for engine management: a fake agent transport whose calls the test answers (in
the agent's protocol 3 shapes, which `engine_found` and `status_answer` build), and a fake
process reactor for the real transport's spawns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from zope.interface import implementer

from llmproxy.agent.protocol import OP_FIELD, PROTOCOL
from llmproxy.config import HostConfig
from llmproxy.hosts.agentclient import AgentError, IAgentTransport, protocol_error


def engine_found(engine: str, command: Sequence[str] = (), *, pid: int = 77,
                 healthy: bool = True, started_at: float = 0.0,
                 health_url: str = "http://10.0.0.5:8081/health") -> dict[str, Any]:
    """One engine as a status answer lists it."""
    return {"engine": engine, "pid": pid, "command": list(command), "health_url": health_url,
            "healthy": healthy, "started_at": started_at}


def status_answer(*engines: dict[str, Any]) -> dict[str, Any]:
    """The agent's answer to ``status`` when `engines` (see `engine_found`) run."""
    return {"ok": True, "protocol": PROTOCOL, "engines": list(engines)}


@dataclass
class AgentCall:
    """One order the code under test sent to a host's agent; the test answers it."""

    host: HostConfig
    order: dict[str, Any]
    timeout: float
    deferred: Deferred[dict[str, Any]]

    def answer(self, answer: dict[str, Any]) -> None:
        """The agent's JSON answer (``"ok": false`` ones too); ``"protocol"`` defaults to this
        proxy's, and an answer of another protocol fails the call as the real transport does."""
        answer = {"protocol": PROTOCOL, **answer}
        mismatch = protocol_error(self.host.name, answer)
        if mismatch is not None:
            self.deferred.errback(AgentError(mismatch))
        else:
            self.deferred.callback(answer)

    def fail(self, reason: str) -> None:
        """No answer could be had (ssh failed, timeout...)."""
        self.deferred.errback(AgentError(reason))


@implementer(IAgentTransport)
@dataclass
class FakeAgentTransport:
    """An IAgentTransport that records every call (its order as the caller gave it, without
    the protocol stamp the real transport adds); each answer is given by the test through the
    call's Deferred (AgentCall.answer / AgentCall.fail)."""

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
        return [c for c in self.calls if op is None or c.order.get(OP_FIELD) == op][-1]


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
