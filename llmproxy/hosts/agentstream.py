"""A long-lived call to a GPU host's agent (``watch``, ``log``): one JSON order
in, JSON lines out as they come, until either side ends it.

`AgentStream` runs ``setsid --wait SSH... TARGET AGENT...`` like a one-shot
call (llmproxy/hosts/agentclient.py), but keeps the agent's stdin open: the
agent watches for as long as it stays open, so closing it (`stop`) ends the
session, and the ssh session's death ends it too (`ended` fires with why).
Every line is bounded (MAX_LINE): a longer one ends the stream. A line that is
not a JSON object, an event the protocol module cannot decode (unknown, or
malformed), or a hello of another protocol, ends it too, saying why: an agent
that speaks otherwise is never misread. A host that runs the agent this proxy
brings gets it first (`SSHAgentTransport.ready`); one that answers it has none
(its cache cleaned) ends the stream, and the next stream installs it again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from llmproxy.agent.protocol import PROTOCOL, AgentEvent, BadEvent, Hello, decode
from llmproxy.config import HostConfig
from llmproxy.core.reactors import IProcessClock
from llmproxy.hosts.agentclient import SSHAgentTransport, ended_text

MAX_LINE = 64 * 1024      # one event; the agent's are far smaller
STOP_GRACE = 2.0          # after stdin closes, the session's group is killed past this


class StreamEnded(Exception):
    """Why an agent stream ended: str() says it (the ssh exit, a bad line...)."""


class _StreamProcess(ProcessProtocol):
    def __init__(self, stream: AgentStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.stderr = b""

    def outReceived(self, data: bytes) -> None:
        self.buffer += data
        while b"\n" in self.buffer and not self.stream.ended.called:
            line, self.buffer = self.buffer.split(b"\n", 1)
            if line.strip():
                self.stream.received(line)
        if len(self.buffer) > MAX_LINE:
            self.stream.finish(f"a line of over {MAX_LINE} bytes")

    def errReceived(self, data: bytes) -> None:
        self.stderr = (self.stderr + data)[-4096:]

    def processEnded(self, reason: Failure) -> None:
        tail = self.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        self.stream.finish(ended_text(reason) + (f"; stderr: {tail[0][:300]}" if tail else ""),
                         kill=False)


class AgentStream:
    """One streaming call: `on_event(record)` for each event line, decoded once
    (llmproxy/agent/protocol.py); `ended` fires with a StreamEnded (never errbacks) once
    the session is over."""

    def __init__(self, reactor: IProcessClock, transport: SSHAgentTransport, host: HostConfig,
                 order: dict[str, Any], on_event: Callable[[AgentEvent], None], *,
                 killpg: Callable[[int, int], None] = os.killpg) -> None:
        self.host = host
        self.ended: Deferred[StreamEnded] = Deferred()
        self._on_event = on_event
        self._reactor = reactor
        self._killpg = killpg
        self._kill_timer: IDelayedCall | None = None
        self._process: Any = None
        self._transport = transport
        ready = transport.ready(host)
        ready.addCallbacks(lambda _: self._spawn(order),
                           lambda f: self.finish(f.getErrorMessage(), kill=False))

    def _spawn(self, order: dict[str, Any]) -> None:
        if self.ended.called:
            return                     # stopped while the agent's code was being sent
        argv = self._transport.argv(self.host)
        process = _StreamProcess(self)
        try:
            self._process = self._reactor.spawnProcess(process, argv[0], argv,
                                                       env=self._transport.env())
        except OSError as e:
            self.finish(f"cannot run {argv[0]}: {e}")
            return
        line = json.dumps(self._transport.stamp(order, self.host)).encode() + b"\n"
        self._process.write(line)

    def send(self, message: dict[str, Any]) -> None:
        """Write one JSON line on the agent's stdin after its order (protocol.PACE); a
        session not running yet or over takes nothing."""
        if self._process is None or self.ended.called:
            return
        with contextlib.suppress(Exception):
            self._process.write(json.dumps(message).encode() + b"\n")

    def stop(self) -> None:
        """End the session: the agent's stdin closes (it stops watching), and its
        process group is killed if it has not ended within STOP_GRACE."""
        if self.ended.called:
            return
        if self._process is None:
            self.finish("stopped before it started", kill=False)
            return
        with contextlib.suppress(Exception):
            self._process.closeStdin()
        self._kill_timer = self._reactor.callLater(STOP_GRACE, self.kill)

    def kill(self) -> None:
        """SIGKILL the session's process group now."""
        pid = getattr(self._process, "pid", None)
        if pid is not None and not self.ended.called:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                self._killpg(pid, signal.SIGKILL)

    def received(self, line: bytes) -> None:
        """One line of the agent's output (the process protocol hands it over)."""
        try:
            doc = json.loads(line)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            self.finish(f"not a JSON event: {line[:200]!r}")
            return
        if doc.get("bundle_missing"):
            self._transport.forget(self.host)
            self.finish(str(doc.get("error")))
            return
        try:
            event = decode(doc)
        except BadEvent as e:
            self.finish(str(e))
            return
        if isinstance(event, Hello) and event.protocol != PROTOCOL:
            self.finish(f"the agent on {self.host.name} speaks protocol "
                        f"{event.protocol}, this proxy speaks {PROTOCOL}")
            return
        self._on_event(event)

    def finish(self, why: str, kill: bool = True) -> None:
        """The session is over (`kill`: its process group may still live)."""
        if self.ended.called:
            return
        if self._kill_timer is not None and self._kill_timer.active():
            self._kill_timer.cancel()
        if kill:
            self.kill()                # a session ended by a bad line: nothing of it lives on
        self.ended.callback(StreamEnded(f"agent on {self.host.name}: {why}"))
