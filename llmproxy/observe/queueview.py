"""Each host's queue as clients and operators see it (QueueView): every waiter's
position and estimated wait, from the figures it measures as a hub subscriber.

It learns, per host and engine, kept in memory only (a restart starts again):
- the engine's start time: a successful switch's `elapsed` (engine.switch done),
  the running median of the last START_SAMPLES;
- its request duration: from a request's lease (request.start) to its end
  (request.end), the running median of the last DURATION_SAMPLES;
- when a start under way began (engine.switch begun).

Positions are the order of the host scheduler's `waiters` (the order it serves
them in); the ETA arithmetic is observe/queueeta.py's. A queue change (a
request queued, served, gone or refused, a switch's progress) publishes one
`queue.update` event per host, folded into one per reactor turn.

What it shows of a waiter: its position, engine, priority class, request id,
seconds waited and ETA; never a key or a client address.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from llmproxy.core.capacity import Queued, QueueLeft, QueueRejected
from llmproxy.core.events import EngineSwitch, Event, RequestEnded, RequestRouted
from llmproxy.core.hub import Publish
from llmproxy.hosts.host import Host
from llmproxy.hosts.waiter import OFF
from llmproxy.observe.queueeta import Line, Need, RunningMedian, etas, etas_together, ordinal

START_SAMPLES = 5
DURATION_SAMPLES = 20
MAX_OPEN = 10_000          # requests in flight remembered for their duration
CLASSES = ("high", "normal", "low")


@dataclass(frozen=True)
class QueueUpdate(Event):
    """A host's queue changed: its waiters in served order, each a dict of
    position, engine, priority, request_id, waited_seconds, eta_seconds."""

    type: ClassVar[str] = "queue.update"
    host: str
    waiters: tuple[dict[str, Any], ...] = ()


def comment(host: str, position: int, eta: float | None) -> str:
    """A waiting streaming client's SSE comment line (without the blank line)."""
    wait = "wait unknown" if eta is None else f"about {math.ceil(max(0.0, eta))} s"
    return f": queued {ordinal(position)} for {host}, {wait}"


class QueueView:
    """A hub subscriber that measures start times and request durations and
    shows each host's queue with positions and ETAs (see the module docstring)."""

    def __init__(self, clock: IReactorTime, gates: Any, publish: Publish | None = None) -> None:
        self._clock = clock
        self._gates = gates            # () -> {host name: Host}
        self._publish = publish
        self._starts: dict[tuple[str, str], RunningMedian] = {}
        self._durations: dict[tuple[str, str | None], RunningMedian] = {}
        self._begun: dict[str, tuple[str, float]] = {}     # host -> (engine, when)
        self._open: dict[str, tuple[str, str | None, float]] = {}
        self._due: dict[str, IDelayedCall] = {}

    # -- what it hears ----------------------------------------------------------------
    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestRouted):
            if len(self._open) >= MAX_OPEN:
                self._open.pop(next(iter(self._open)))
            self._open[event.request_id] = (event.host, event.engine, event.time)
        elif isinstance(event, RequestEnded):
            opened = self._open.pop(event.request_id, None)
            if opened is not None and event.outcome == "completed":
                host, engine, at = opened
                self._durations.setdefault((host, engine), RunningMedian(
                    DURATION_SAMPLES)).add(event.time - at)
        elif isinstance(event, EngineSwitch):
            if event.stage == "begun":
                self._begun[event.host] = (event.engine, event.time)
            elif event.stage in ("done", "failed"):
                self._begun.pop(event.host, None)
                if event.stage == "done" and event.elapsed is not None:
                    self._starts.setdefault((event.host, event.engine), RunningMedian(
                        START_SAMPLES)).add(event.elapsed)
            self._changed(event.host)
        elif isinstance(event, Queued | QueueLeft | QueueRejected):
            self._changed(event.host)

    def _changed(self, host: str) -> None:
        if self._publish is None or host in self._due:
            return
        self._due[host] = self._clock.callLater(0, self._announce, host)

    def _announce(self, host: str) -> None:
        del self._due[host]
        gate = self._gates().get(host)
        if gate is not None and self._publish is not None:
            self._publish(QueueUpdate(self._clock.seconds(), host, tuple(self.queue(gate))))

    # -- the figures --------------------------------------------------------------------
    def start_time(self, gate: Host, engine: str | None) -> float | None:
        """The median measured start of `engine` on the host, else its declared
        start_timeout_seconds."""
        if engine is None or engine == OFF:
            return 0.0
        measured = self._starts.get((gate.host.name, engine))
        if measured is not None and len(measured):
            return measured.value()
        preset = gate.host.engines.get(engine)
        return preset.start_timeout_seconds if preset is not None else None

    def duration(self, gate: Host, engine: str | None) -> float | None:
        """The median measured request duration of `engine` on the host; None: unmeasured."""
        measured = self._durations.get((gate.host.name, engine))
        return measured.value() if measured is not None else None

    # -- what it shows ------------------------------------------------------------------
    def queue(self, gate: Host) -> list[dict[str, Any]]:
        """The host's waiters in served order: position, engine, priority,
        request_id, waited_seconds, eta_seconds (None: unknown)."""
        now = self._clock.seconds()
        waiters = list(gate.scheduler.waiters)
        found = self._etas(gate, [Need(w.engine, w.stop or w.engine == OFF)
                                  for w in waiters], now)
        return [{"position": i + 1, "engine": None if w.engine == OFF else w.engine,
                 "stop": w.stop or w.engine == OFF,
                 "priority": CLASSES[w.priority] if 0 <= w.priority < 3 else str(w.priority),
                 "request_id": w.request_id, "waited_seconds": round(now - w.arrived, 3),
                 "eta_seconds": None if eta is None else round(eta, 1)}
                for i, (w, eta) in enumerate(zip(waiters, found, strict=True))]

    def place(self, gate: Host, request_id: str) -> tuple[int, float | None] | None:
        """(position, ETA) of the request `request_id` in the host's queue; None:
        it does not wait there (any more)."""
        waiters = gate.scheduler.waiters
        for i, waiter in enumerate(waiters):
            if waiter.request_id == request_id:
                found = self._etas(gate, [Need(w.engine, w.stop or w.engine == OFF)
                                          for w in waiters[:i + 1]], self._clock.seconds())
                return i + 1, found[i]
        return None

    def _line(self, gate: Host, engine: str | None, now: float) -> Line:
        begun = self._begun.get(gate.host.name)
        if begun is not None and begun[0] == engine and gate.busy:
            start = self.start_time(gate, engine)
            left = math.inf if start is None else max(0.0, start - (now - begun[1]))
            return Line(engine, 0, left)
        runs = engine is not None and gate.runs(engine)
        return Line(engine if runs else None, gate.in_flight(engine) if runs else 0)

    def _etas(self, gate: Host, needs: list[Need], now: float) -> list[float | None]:
        def start(engine: str | None) -> float | None:
            return self.start_time(gate, engine)

        def duration(engine: str | None) -> float | None:
            return self.duration(gate, engine)

        def slots(engine: str | None) -> int | None:
            return gate.limit(engine)

        if gate.host.budgeted:
            lines = {n.engine: self._line(gate, n.engine, now) for n in needs
                     if n.engine is not None and not n.stop}
            return etas_together(needs, lines, start, duration, slots)
        begun = self._begun.get(gate.host.name)
        if begun is not None and gate.busy and gate.controller is not None \
                and gate.controller.target == begun[0]:
            line = self._line(gate, begun[0], now)
        else:
            running = gate.running
            line = Line(running, gate.in_flight() if running is not None or
                        not gate.host.managed else 0)
        return etas(needs, line, start, duration, slots)
