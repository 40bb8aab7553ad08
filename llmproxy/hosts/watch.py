"""Each managed host watched: one long-lived ``llmproxy-agent watch`` session
over ssh (agentstream), its events handed on, reopened with backoff when it
breaks.

`HostWatch` holds what the agent last said: which engines' health checks pass,
the GPUs' figures (shown while they are fresh: an nvidia-smi that stopped
answering leaves none, not old ones), when it last heard from the agent. While the session is
down the host counts as unreachable (`connected` is False, `down_since` says
since when); each reopening waits 1, 2, 4, ... up to 60 s, and a session that
lived a minute starts the count again.

The session also holds the host's lease (llmproxy/agent/lease.py): the agent says
``lease`` first, ``held: true`` once this session holds it, else ``held: false`` with the
holder (this proxy then waits, the session open, for the holder to let go). `lease` says what
was last heard: ``held`` (True, False, or None while no session says), and ``holder``.

Events reach `on_event(host, record)` as the typed records of the protocol module
(llmproxy/agent/protocol.py: `LeaseState`, `Exit`, `Health`, `Gpu`, `AgentWarning`, `Tick`,
`Hello`); what they mean for the engines is the managers' business (supervision), not
this module's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from llmproxy.agent.protocol import (
    OP_FIELD,
    PACE,
    WATCH,
    AgentEvent,
    AgentWarning,
    Exit,
    Gpu,
    Health,
    Hello,
    LeaseState,
)
from llmproxy.config import HostConfig
from llmproxy.core.reactors import IProcessClock
from llmproxy.hosts.agentstream import AgentStream, StreamEnded
from llmproxy.hosts.supervise import backoff

STABLE_SECONDS = 60.0     # a session that lived this long resets the backoff
TELEMETRY_SECONDS = 10     # how often the agent samples the GPUs
WATCH_ORDER = {OP_FIELD: WATCH, "interval": 0.5, "telemetry_seconds": TELEMETRY_SECONDS,
               "health_seconds": 2}
GPUS_STALE = 3.5 * TELEMETRY_SECONDS  # older GPU figures are not shown

OpenStream = Callable[[HostConfig, dict[str, Any], Callable[[AgentEvent], None]], AgentStream]


def host_watts(sample: Gpu) -> float | None:
    """The sum of the GPUs' power draw in watts; None when no GPU says it."""
    figures = [g.get("power_watts") for g in sample.gpus]
    known = [float(f) for f in figures
             if isinstance(f, (int, float)) and not isinstance(f, bool) and f >= 0]
    return sum(known) if known else None


class HostWatch:
    """The watch session of one managed host (see the module docstring)."""

    log = Logger()

    def __init__(self, host: HostConfig, clock: IProcessClock, open_stream: OpenStream,
                 on_event: Callable[[str, AgentEvent], None]) -> None:
        self.host = host
        self.connected = False
        self.down_since: float | None = clock.seconds()
        self.last_heard: float | None = None
        self.last_error: str | None = None
        self.healthy: dict[str, bool] = {}
        self.gpus: list[dict[str, Any]] = []
        self.gpus_at: float | None = None
        self.held: bool | None = None      # the lease: ours, another's, or not known
        self.holder: dict[str, Any] | None = None
        self._clock = clock
        self._open = open_stream
        self._on_event = on_event
        self._stream: AgentStream | None = None
        self._opened_at = 0.0
        self._failures = 0
        self._retry: IDelayedCall | None = None
        self._running = False
        self.busy = False                  # requests in flight on the host (`pace`)
        self._power: list[Callable[[float | None], object]] = []

    def on_power(self, heard: Callable[[float | None], object]) -> None:
        """Hand each GPU sample's power draw (`host_watts`) to `heard` (the energy meter)."""
        self._power.append(heard)

    def pace(self, busy: bool) -> None:
        """Requests are in flight on the host (`busy`) or no more: the agent samples the
        GPUs each second while busy (protocol.PACE); a session opened later is told after
        its hello."""
        if busy != self.busy:
            self.busy = busy
            self._tell_pace()

    def _tell_pace(self) -> None:
        if self._stream is not None and self.connected:
            self._stream.send({OP_FIELD: PACE, "busy": self.busy})

    def start(self) -> None:
        self._running = True
        self._connect()

    def stop(self) -> None:
        """No more sessions; the open one ends."""
        stream = self._halt()
        if stream is not None:
            stream.stop()

    def kill(self) -> None:
        """No more sessions, and the open one's process group killed now."""
        stream = self._halt()
        if stream is not None:
            stream.kill()

    def is_connected(self) -> bool:
        return self.connected

    def reopen(self) -> None:
        """Reopen a broken session now, its backoff skipped (its host answers again)."""
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
            self._failures = 0
            self._connect()

    def _halt(self) -> AgentStream | None:
        """No reopening from now on; the open session, if any."""
        self._running = False
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        return self._stream

    def snapshot(self, now: float) -> dict[str, Any]:
        """For /status: the session's state, health checks and GPUs."""
        fresh = self.gpus_at is not None and now - self.gpus_at <= GPUS_STALE
        return {"connected": self.connected, "last_error": self.last_error,
                "down_seconds": None if self.down_since is None
                else round(now - self.down_since, 1),
                "healthy": dict(self.healthy), "gpus": list(self.gpus) if fresh else [],
                "lease": {"held": self.held, "holder": self.holder}}

    def _connect(self) -> None:
        self._retry = None
        if not self._running:
            return
        self._opened_at = self._clock.seconds()
        self._stream = self._open(self.host, dict(WATCH_ORDER), self._event)
        self._stream.ended.addCallback(self._ended)

    def _event(self, event: AgentEvent) -> None:
        now = self._clock.seconds()
        self.last_heard = now
        if not self.connected:
            self.connected, self.down_since = True, None
            self.log.info("watching the engines of {host}", host=self.host.name)
        if isinstance(event, LeaseState):
            self.held, self.holder = event.held, dict(event.holder)
        elif isinstance(event, Hello):
            self.healthy = {e.engine: e.healthy for e in event.engines}
            if self.busy:
                self._tell_pace()
        elif isinstance(event, Health):
            self.healthy[event.engine] = event.healthy
        elif isinstance(event, Gpu):
            self.gpus, self.gpus_at = [dict(g) for g in event.gpus], now
        elif isinstance(event, Exit):
            self.healthy.pop(event.engine, None)
        elif isinstance(event, AgentWarning):
            self.log.warn("agent on {host}: {message}", host=self.host.name,
                          message=event.message[:300])
        self._on_event(self.host.name, event)
        if isinstance(event, Gpu):
            for heard in self._power:
                heard(host_watts(event))

    def _ended(self, why: StreamEnded) -> None:
        self._stream = None
        now = self._clock.seconds()
        self._failures = 1 if now - self._opened_at >= STABLE_SECONDS else self._failures + 1
        self.last_error = str(why)
        self.held = None     # the agent let go with the session; the next one says again
        if self.connected:
            self.connected, self.down_since = False, now
        if not self._running:
            return
        delay = backoff(self._failures)
        self.log.warn("{why}: the watch of {host} reopens in {delay:g}s", why=str(why),
                      host=self.host.name, delay=delay)
        self._retry = self._clock.callLater(delay, self._connect)
