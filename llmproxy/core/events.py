"""The events: small frozen records of what happened, each published once by the
part that knows it (see `core.hub`). Each says how it reads in the log
(`line()`), so the log is one subscriber among others, not a second path.

An event is small and its line is one line: a field that holds what a client
chose (a request's method, path and model) or quotes an engine (`detail`)
holds it as `core.text.shown` makes it, bounded and escaped, by its publisher
(`observe.inflight.Exchange`); `line()` writes fields as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

INFO, WARN = "info", "warn"
_names: dict[type, tuple[str, ...]] = {}


@dataclass(frozen=True)
class Event:
    """Base of every event: what happened (`type`) and when (clock seconds)."""

    type: ClassVar[str] = "event"
    namespace: ClassVar[str] = "llmproxy.events"
    time: float

    def fields(self) -> dict[str, Any]:
        """The event as plain JSON-able values, `type` included."""
        names = _names.get(type(self)) or _names.setdefault(
            type(self), tuple(f.name for f in fields(self)))
        doc = {name: getattr(self, name) for name in names}   # all flat values: no copy
        doc["type"] = self.type
        return doc

    def line(self) -> tuple[str, str] | None:
        """(level, text) of its log line; None: it is not logged."""
        return None


# -- requests ----------------------------------------------------------------
@dataclass(frozen=True)
class RequestRouted(Event):
    """A request's model resolved to a host and the request goes there now; on a
    managed host it holds a lease on `engine`, which it streams from until it ends."""

    type: ClassVar[str] = "request.start"
    request_id: str
    method: str
    path: str
    model: str
    host: str
    engine: str | None = None
    streaming: bool = False
    key: str | None = None       # the API key's name (never its secret)


@dataclass(frozen=True)
class RequestEnded(Event):
    """A request is over (one per request): its access line."""

    type: ClassVar[str] = "request.end"
    namespace: ClassVar[str] = "llmproxy.access"
    request_id: str
    method: str
    path: str
    client: str
    model: str | None
    host: str | None
    engine: str | None
    status: int | None
    bytes: int
    duration: float
    outcome: str
    detail: str | None = None
    cut: bool = False            # a drain deadline ended it
    routed: bool = False         # a RequestRouted was published for it
    ttfb: float | None = None    # seconds to its first byte to the client
    prompt_tokens: int | None = None       # as the engine reported them (usage)
    completion_tokens: int | None = None
    key: str | None = None       # the API key's name (never its secret)
    events: int = 0              # server-sent events relayed to the client
    energy_joules: float | None = None   # its GPUs' energy (observe/energy.py), if measured

    def line(self) -> tuple[str, str]:
        ttfb = "-" if self.ttfb is None else f"{self.ttfb:.3f}s"
        key = f"key={self.key} " if self.key is not None else ""
        text = (f"{self.request_id} {self.method} {self.path} model={self.model or '-'} "
                f"host={self.host or '-'} {key}"
                f"status={self.status if self.status is not None else '-'} "
                f"bytes={self.bytes} duration={self.duration:.3f}s ttfb={ttfb} "
                f"outcome={self.outcome}")
        if self.prompt_tokens is not None or self.completion_tokens is not None:
            text += f" tokens={self.prompt_tokens or 0}+{self.completion_tokens or 0}"
        text += "" if self.energy_joules is None else f" energy={self.energy_joules:.1f}J"
        if self.cut:
            text += f" age={self.duration:.1f}s: cut at the drain deadline"
        elif self.detail:
            text += f" ({self.detail})"
        return (INFO if self.outcome == "completed" else WARN), text


@dataclass(frozen=True)
class RouteFallback(Event):
    """No host of `model` could take a request and nothing of it was sent
    (`reason`: every host down or cordoned, its queue full, its engine failed to
    start): it goes to the next model of the chain, `fallback`."""

    type: ClassVar[str] = "route.fallback"
    request_id: str | None
    model: str
    fallback: str
    reason: str

    def line(self) -> tuple[str, str]:
        return WARN, (f"{self.request_id or 'a request'} for {self.model}: no host could take "
                      f"it ({self.reason}), nothing was sent: falling back to {self.fallback}")


# -- hosts and engines ---------------------------------------------------------
@dataclass(frozen=True)
class RosterRead(Event):
    """One host's roster read ended: `outcome` ok, failed (`error` says why) or
    stale (an older read that finished after a newer one was stored: dropped)."""

    type: ClassVar[str] = "roster"
    host: str
    outcome: str
    read: int                    # the read's number
    models: int = 0
    error: str | None = None
    stored: int = 0              # stale: the newer read already stored

    def line(self) -> tuple[str, str] | None:
        if self.outcome == "failed":
            return WARN, f"roster of {self.host}: read {self.read} failed: {self.error}"
        if self.outcome == "stale":
            return INFO, (f"roster of {self.host}: dropped read {self.read}, older than "
                          f"stored {self.stored}")
        return None


@dataclass(frozen=True)
class EngineSwitch(Event):
    """A managed host's engine switch: `stage` waiting (`reason` busy: requests on
    the old engine, `waiting_for` of them; protected: a predecessor streams from
    it; residency: its min_engine_seconds are not over), begun, done or failed
    (`reason`: the agent's)."""

    type: ClassVar[str] = "engine.switch"
    host: str
    stage: str
    engine: str
    previous: str | None = None
    waiting_for: int = 0
    reason: str | None = None
    elapsed: float | None = None

    def line(self) -> tuple[str, str]:
        head = (f"switching {self.host} from {self.previous} to {self.engine}"
                if self.previous is not None else f"starting {self.engine} on {self.host}")
        if self.stage == "waiting" and self.reason == "memory":
            return INFO, (f"{head}: waiting for {self.previous or 'a stop'} to fall idle "
                          "(the host's memory_gb)")
        if self.stage == "waiting" and self.reason == "residency":
            return INFO, (f"{head}: waiting while {self.previous} is resident "
                          "(min_engine_seconds)")
        if self.stage == "waiting" and self.reason == "protected":
            return INFO, (f"{head}: waiting while the previous llmproxy still uses "
                          f"{self.previous}")
        if self.stage == "waiting":
            return INFO, f"{head}: waiting for {self.waiting_for} request(s) on {self.previous}"
        if self.stage == "begun":   # a start beside the others says it once
            return INFO, head if self.previous is None else f"{head}: starting {self.engine}"
        if self.stage == "done":
            return INFO, f"engine {self.engine} on {self.host} ready in {self.elapsed or 0:.1f}s"
        return WARN, f"switching {self.host} to {self.engine} failed: {self.reason}"


@dataclass(frozen=True)
class IdleStop(Event):
    """A stop of a managed host's engine the proxy decided: `stage` begun, done
    or failed; `why` idle (the top-level idle_stop_seconds), ttl (the engine's
    own), operator (one engine of a budgeted host), or `evicted for E` (room
    for E in the host's memory_gb)."""

    type: ClassVar[str] = "engine.idle_stop"
    host: str
    stage: str
    engine: str
    reason: str | None = None
    elapsed: float | None = None
    why: str = "idle"

    def line(self) -> tuple[str, str]:
        head = (f"idle stop of {self.engine} on {self.host}" if self.why == "idle"
                else f"stop of {self.engine} on {self.host} ({self.why})")
        if self.stage == "begun":
            return INFO, head
        if self.stage == "done":
            return INFO, f"{head}: stopped in {self.elapsed or 0:.1f}s"
        return WARN, f"{head} failed: {self.reason}"


@dataclass(frozen=True)
class EngineExit(Event):
    """A managed engine died without the proxy stopping it: how (`exit`: exit
    status, signal), the last lines of its log, and what follows: a start in
    `restart_in` seconds, nothing (`restart: never`), or `failed` after a crash
    loop (`crashes` within 10 minutes)."""

    type: ClassVar[str] = "engine.exit"
    host: str
    engine: str
    exit: str
    log_tail: tuple[str, ...] = ()
    restart_in: float | None = None
    failed: bool = False
    crashes: int = 0

    def line(self) -> tuple[str, str]:
        last = f": {self.log_tail[-1][:200]}" if self.log_tail else ""
        then = (f"failed after {self.crashes} crashes within 10 minutes" if self.failed
                else f"restarting in {self.restart_in:g}s" if self.restart_in is not None
                else "not restarted (restart: never)")
        return WARN, f"engine {self.engine} on {self.host} died ({self.exit}){last}; {then}"


@dataclass(frozen=True)
class EngineUnhealthy(Event):
    """A managed engine is hung: its health check failed for `seconds` while none
    of its responses in flight sent a byte. It is being stopped (its stuck
    requests end cut), which counts as a crash: what follows is as after
    `EngineExit` (`restart_in`, nothing with `restart: never`, or `failed`)."""

    type: ClassVar[str] = "engine.unhealthy"
    host: str
    engine: str
    seconds: float
    restart_in: float | None = None
    failed: bool = False
    crashes: int = 0

    def line(self) -> tuple[str, str]:
        then = (f"failed after {self.crashes} crashes within 10 minutes" if self.failed
                else f"restarting in {self.restart_in:g}s" if self.restart_in is not None
                else "not restarted (restart: never)")
        return WARN, (f"engine {self.engine} on {self.host} hung: its health check failed "
                      f"for {self.seconds:.1f}s and no response sent a byte; stopping it, "
                      f"{then}")


@dataclass(frozen=True)
class HostLease(Event):
    """A managed host's lease as its watch says: held by another proxy (`held`
    False, `holder` describing it: this proxy waits), or taken by this one
    (`held` True, `holder` whom it had, if anyone), which then adopts what runs
    there."""

    type: ClassVar[str] = "host.lease"
    host: str
    held: bool
    holder: str | None = None

    def line(self) -> tuple[str, str]:
        if self.held:
            after = f" ({self.holder} let go)" if self.holder else ""
            return INFO, f"took the lease of {self.host}{after}: adopting what runs there"
        return WARN, (f"host {self.host} is {self.holder}: this proxy does not manage it and "
                      "waits for its lease")


# -- the process -------------------------------------------------------------
@dataclass(frozen=True)
class Ready(Event):
    """The proxy accepts and serves (after start-up, or as an upgrade's new process)."""

    type: ClassVar[str] = "ready"
    address: str | None
    origin: str
    summary: str
    failed_hosts: tuple[str, ...] = ()
    generation: int = 1
    scheme: str = "http"         # https with a `tls` listener

    def line(self) -> tuple[str, str]:
        failed = f" (no roster from {', '.join(self.failed_hosts)})" if self.failed_hosts else ""
        return INFO, (f"ready: listening on {self.scheme}://{self.address} ({self.origin}), "
                      f"{self.summary}{failed}")


@dataclass(frozen=True)
class ReloadDone(Event):
    """A reload ended: `outcome` applied or kept; `message` says what and why."""

    type: ClassVar[str] = "reload"
    outcome: str
    message: str
    generation: int

    def line(self) -> tuple[str, str]:
        return (INFO if self.outcome == "applied" else WARN), self.message


@dataclass(frozen=True)
class UpgradeStage(Event):
    """An upgrade's progress. On the old process: `stage` ignored, started,
    failed, handed_over; on the new one: serving (it took over from `pid`), then
    predecessor_exited (`pid` has drained and exited: the upgrade is over), and
    state_late (`pid`'s keys' use did not come within `elapsed` seconds)."""

    type: ClassVar[str] = "upgrade"
    stage: str
    pid: int                           # the old process
    candidate_pid: int | None = None   # the new one
    generation: int | None = None      # the new process's generation
    reason: str | None = None
    old_version: str | None = None
    new_version: str | None = None
    elapsed: float | None = None       # ready: seconds from the start to the ready line

    def line(self) -> tuple[str, str]:
        pid, new, generation = self.pid, self.candidate_pid, self.generation
        text = {
            "ignored": f"upgrade: ignored SIGUSR1: {self.reason}",
            "started": f"upgrade: started candidate pid {new} for generation {generation}",
            "failed": f"upgrade: failed, this process keeps serving: {self.reason}",
            "ready": f"upgrade: {self.old_version} (pid {pid}) -> {self.new_version} (pid {new}) "
                     f"ready in {self.elapsed or 0:.1f}s",
            "handed_over": f"upgrade: handed over to pid {new} (generation {generation}); this "
                           "process stops accepting, drains and exits",
            "predecessor_exited": f"upgrade: predecessor pid {pid} drained and exited",
            "state_late": f"upgrade: predecessor pid {pid} sent its keys' rate-limit and energy "
                          f"use not within {self.elapsed or 0:g}s: keys with limits are judged "
                          "without it",
        }.get(self.stage, f"upgrade: generation {generation} ready; predecessor pid {pid} "
                          "stops accepting and drains")
        return (WARN if self.stage in ("failed", "state_late") else INFO), text


@dataclass(frozen=True)
class StopStage(Event):
    """The graceful stop's progress: `stage` signal (`reason` names it), begun
    (`reason`: the budget), drained, cut (`in_flight` of them)."""

    type: ClassVar[str] = "stop"
    stage: str
    in_flight: int = 0
    reason: str | None = None

    def line(self) -> tuple[str, str]:
        if self.stage == "signal":
            return INFO, f"received {self.reason}: stopping gracefully"
        if self.stage == "begun":
            return INFO, f"stopping: {self.in_flight} request(s) in flight, budget {self.reason}"
        if self.stage == "drained":
            return INFO, "drained, exiting"
        return WARN, f"drain time over: cut {self.in_flight} request(s)"


@dataclass(frozen=True)
class Http2Goaway(Event):
    """An HTTP/2 connection's drain at a stop or an upgrade: `stage` first (a GOAWAY with the
    last stream id 2^31-1, and a PING), final (the real last stream id, after `reason`: the
    PING's ack or the 1 s cap; `streams` still in flight finish), closed (its last stream
    ended), or single (the two-phase drain is off, `reason` says why: one GOAWAY once idle)."""

    type: ClassVar[str] = "http2.goaway"
    stage: str
    peer: str
    last_stream_id: int | None = None
    streams: int = 0
    reason: str | None = None

    def line(self) -> tuple[str, str]:
        head = f"http2 drain {self.peer}"
        if self.stage == "first":
            return INFO, (f"{head}: GOAWAY last stream {self.last_stream_id} (no new streams) "
                          f"and a PING; {self.streams} stream(s) in flight")
        if self.stage == "final":
            return INFO, (f"{head}: GOAWAY last stream {self.last_stream_id} after "
                          f"{self.reason}; {self.streams} stream(s) in flight finish")
        if self.stage == "closed":
            return INFO, f"{head}: closed after its last stream"
        return WARN, (f"{head}: one GOAWAY once idle (Twisted's own); the two-phase GOAWAY "
                      f"is off: {self.reason}")


@dataclass(frozen=True)
class Http2Closed(Event):
    """An HTTP/2 connection ended on its client's fault, or one `stream` left unread reset."""

    type: ClassVar[str] = "http2.closed"
    peer: str
    reason: str
    stream: int | None = None

    def line(self) -> tuple[str, str]:
        what = "connection closed" if self.stream is None else f"stream {self.stream} reset"
        return WARN, f"http2 {self.peer}: {what}: {self.reason}"
