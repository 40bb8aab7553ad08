"""An engine's log read over ssh: the agent's ``log`` order (llmproxy/agent/logs.py) run as
an `AgentStream`, its lines handed on one by one as they come.

`log_engine` says which engine's log a request means (the one named, else the host's running
engine, else its only one) or why there is none to read (`LogRefused`). `EngineLog` is one
reading: `ended` fires with None once the agent has sent what was asked (the last lines;
with ``follow``, never on its own: only when `stop` or `kill` ended it), or with the reason
it could not (the agent's own error, or the ssh session's end: exit status and stderr).

A log being followed never outlives the proxy: when the reactor begins to shut down, the
session is stopped (`shutdown` then says so), its agent's stdin closed and its process
group killed past agentstream.STOP_GRACE, so no session keeps the proxy from exiting.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorCore

from llmproxy.agent.protocol import LOG, OP_FIELD, AgentEvent, LogLine, Refused
from llmproxy.config import HostConfig
from llmproxy.core.reactors import IProcessClock
from llmproxy.core.text import shown
from llmproxy.hosts.agentclient import IAgentTransport, SSHAgentTransport
from llmproxy.hosts.agentstream import AgentStream, StreamEnded
from llmproxy.hosts.host import Host

DEFAULT_LINES = 50
MAX_LINES = 10000         # the agent's own bound (llmproxy.agent.logs.MAX_LINES)
MAX_REASON = 500          # the most of an agent's error that is passed on
_CLEAN_EXIT = re.compile(r": exit status 0(;|$)")

OnLine = Callable[[str, str], None]           # (engine, line)
OpenStream = Callable[[HostConfig, dict[str, Any], Callable[[AgentEvent], None]],
                      AgentStream]


class LogRefused(Exception):
    """No log to read: `kind` is ``unknown_host``, ``not_managed``, ``engine_needed``,
    ``unknown_engine`` or ``no_ssh``; str() says why, for a person."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def log_engine(host: str, known: bool, manager: Host | None,
               engine: str | None) -> str:
    """The engine whose log a request for `engine` on `host` means (`known`: the config has
    the host; `manager`: its manager if it is managed); LogRefused if none."""
    if manager is None:
        if not known:
            raise LogRefused("unknown_host", f"no host named '{shown(host)}'")
        raise LogRefused("not_managed", f"host {host} is not managed (no ssh target, no "
                         "engines): its engines' logs are not the proxy's to read")
    engines = sorted(manager.host.engines)
    if engine is not None:
        if engine not in manager.host.engines:
            raise LogRefused("unknown_engine", f"host {host} has no engine '{shown(engine)}' "
                             f"(its engines: {', '.join(engines)})")
        return engine
    running = manager.running_engines()
    if len(running) == 1:
        return running[0]
    if len(engines) == 1:
        return engines[0]
    raise LogRefused("engine_needed", f"host {host} has several engines and "
                     f"{'several run' if running else 'none runs'}: name one of "
                     f"{', '.join(engines)} (engine=E)")


class EngineLog:
    """One engine's log read through `open_stream` (see the module docstring): each line to
    `on_line(engine, line)`."""

    def __init__(self, host: HostConfig, engine: str, lines: int, follow: bool,
                 on_line: OnLine, open_stream: OpenStream, reactor: object = None) -> None:
        self.host = host.name
        self.engine = engine
        self.follow = follow
        self.shutdown = False          # ended by the proxy's stop
        self.ended: Deferred[str | None] = Deferred()
        self._on_line = on_line
        self._error: str | None = None
        self._stopped = False
        self._reactor = reactor if IReactorCore.providedBy(reactor) else None
        self._trigger: Any = None
        if self._reactor is not None:
            self._trigger = self._reactor.addSystemEventTrigger(
                "before", "shutdown", self._at_shutdown)
        order = {OP_FIELD: LOG, "engine": engine, "lines": lines, "follow": follow}
        self._stream = open_stream(host, order, self._event)
        self._stream.ended.addCallback(self._ended)

    def stop(self) -> None:
        """End the reading: the agent's stdin closes; its session is killed past STOP_GRACE."""
        self._stopped = True
        self._stream.stop()

    def kill(self) -> None:
        """End the reading now: its session's process group is killed."""
        self._stopped = True
        self._stream.kill()

    def _at_shutdown(self) -> None:
        self.shutdown = True
        self.stop()

    def _event(self, event: AgentEvent) -> None:
        if isinstance(event, LogLine):
            self._on_line(event.engine if event.engine is not None else self.engine, event.line)
        elif isinstance(event, Refused) and self._error is None:
            self._error = event.error

    def _ended(self, why: StreamEnded) -> None:
        if self._trigger is not None and self._reactor is not None:
            self._reactor.removeSystemEventTrigger(self._trigger)
            self._trigger = None
        if self._error is not None:
            self.ended.callback(f"agent on {self.host}: {self._error[:MAX_REASON]}")
        elif self._stopped or (not self.follow and _CLEAN_EXIT.search(str(why))):
            self.ended.callback(None)
        else:                  # ssh failed, or a follow that ended by itself
            self.ended.callback(str(why)[:MAX_REASON])


def open_engine_log(reactor: IProcessClock, transport: IAgentTransport, host: HostConfig,
                    engine: str, lines: int, follow: bool, on_line: OnLine) -> EngineLog:
    """An EngineLog over ssh; LogRefused (``no_ssh``) when the proxy reaches its agents
    otherwise (a test's or the demo's stand-in transport has no session to stream)."""
    if not isinstance(transport, SSHAgentTransport) or not host.ssh:
        raise LogRefused("no_ssh", f"host {host.name}: engine logs are read over ssh, and "
                         "this proxy has no ssh session to its agent")
    ssh = transport

    def open_stream(h: HostConfig, order: dict[str, Any],
                    on_event: Callable[[AgentEvent], None]) -> AgentStream:
        return AgentStream(reactor, ssh, h, order, on_event)

    return EngineLog(host, engine, lines, follow, on_line, open_stream, reactor)
