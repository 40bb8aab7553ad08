"""Energy per request, measured from the GPUs' power draw (docs/energy.md).

A managed host's watch reports its GPUs' ``power.draw`` (agent/gpus.py): each 10 s while the
host is idle, each second while requests are in flight on it (this meter asks for that pace,
agent/protocol.PACE). The host's power is the sum over its GPUs and is held from one sample
to the next (zero-order hold): the energy of any stretch of time is that power times its
length, so what the meter hands out sums to what it measured, to rounding.

Each stretch between two changes (a sample, a request in or out, a start beginning or ending)
is one `_Stretch` of the host:
- requests in flight on the host: the stretch's energy is theirs, split by their token rates
  (tokens over time in flight, prompt and completion), each request's tokens taken as spread
  evenly over its time in flight. A request takes its share when it ends (`finish`), the rate
  of one still running estimated from what it streamed so far (`progress`, one event a token),
  or the mean of the known rates when it streamed nothing; the last one out takes the rest;
- none, while an engine starts: its loading energy, said with its start's end
  (`EngineLoadEnergy`);
- none otherwise: idle energy of the engines running (evenly), or of no engine.
A host without samples for STALE seconds (its watch lost) measures nothing meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from twisted.internet.interfaces import IReactorTime

from llmproxy.core.energy import EngineLoadEnergy
from llmproxy.core.events import (
    EngineExit,
    EngineSwitch,
    Event,
    IdleStop,
    RequestEnded,
    RequestRouted,
)
from llmproxy.core.hub import Publish

STALE = 35.0        # seconds a power sample is held at most (3.5 idle samples)
# A request's token rate is taken over at least this long: over a clock that barely
# moved (a step far below any real clock's) it would be infinite, and its share NaN.
MIN_ELAPSED = 1e-9
NO_ENGINE = "-"     # the idle energy of a host no engine runs on; a request without a key


@dataclass
class _Stretch:
    """Energy of requests in flight not yet handed out, and who shares it."""

    joules: float
    sharing: set[str]


@dataclass
class _Request:
    started: float
    engine: str | None
    tokens: float | None = None       # prompt + completion, once it ended
    stretches: list[_Stretch] = field(default_factory=list)   # those it shares


@dataclass
class HostMeter:
    """One host's power and what its energy went to (see the module docstring)."""

    host: str
    clock: IReactorTime
    progress: Callable[[str], int] = lambda request_id: 0
    watts: float | None = None
    sampled_at: float | None = None
    since: float = 0.0
    measured: float = 0.0              # joules since the meter began
    to_requests: float = 0.0
    idle: dict[str, float] = field(default_factory=dict)
    loading: dict[str, float] = field(default_factory=dict)     # all starts, by engine
    starting: dict[str, tuple[float, float]] = field(default_factory=dict)  # (t0, joules)
    running: set[str] = field(default_factory=set)
    requests: dict[str, _Request] = field(default_factory=dict)
    last: _Stretch | None = None       # the latest stretch of requests, while it has sharers

    def __post_init__(self) -> None:
        self.since = self.clock.seconds()

    def close(self) -> float:
        """Account for the time since the last change; now."""
        now = self.clock.seconds()
        held = 0.0
        if self.watts is not None and self.sampled_at is not None:
            held = max(0.0, min(now, self.sampled_at + STALE) - self.since)
        joules = (self.watts or 0.0) * held
        self.since = now
        if joules <= 0:
            return now
        self.measured += joules
        if self.requests:
            self.to_requests += joules
            sharing = set(self.requests)
            if self.last is not None and self.last.sharing == sharing:
                self.last.joules += joules    # the same sharers: the same split
            else:
                self.last = _Stretch(joules, sharing)
                for request_id in sharing:
                    self.requests[request_id].stretches.append(self.last)
        elif self.starting:
            each = joules / len(self.starting)
            for engine, (t0, spent) in self.starting.items():
                self.starting[engine] = (t0, spent + each)
        else:
            engines = sorted(self.running) or [NO_ENGINE]
            for engine in engines:
                self.idle[engine] = self.idle.get(engine, 0.0) + joules / len(engines)
        return now

    def sample(self, watts: float | None) -> None:
        """A power sample arrived: the stretch before it at the previous power."""
        self.close()
        if watts is not None:
            self.watts, self.sampled_at = watts, self.since

    def _rate(self, request_id: str, now: float) -> float | None:
        r = self.requests[request_id]
        elapsed = max(now - r.started, MIN_ELAPSED)
        if r.tokens is not None:
            return r.tokens / elapsed
        seen = self.progress(request_id)
        return seen / elapsed if seen > 0 else None

    def _shares(self, request_id: str, now: float) -> list[tuple[_Stretch, float]]:
        """Each stretch `request_id` shares, and its share of it now."""
        out = []
        for stretch in self.requests[request_id].stretches:
            if len(stretch.sharing) == 1:
                out.append((stretch, stretch.joules))
                continue
            rates = {r: self._rate(r, now) for r in stretch.sharing}
            known = [v for v in rates.values() if v is not None]
            mean = sum(known) / len(known) if known else 1.0
            weights = {r: mean if v is None else v for r, v in rates.items()}
            total = sum(weights.values())
            part = (weights[request_id] / total if total > 0
                    else 1.0 / len(stretch.sharing))
            out.append((stretch, stretch.joules * part))
        return out

    def begin(self, request_id: str, engine: str | None) -> bool:
        """A request is in flight on the host now; True when it is the first. Its engine
        runs (one adopted at start-up is known so)."""
        now = self.close()
        self.requests[request_id] = _Request(now, engine)
        if engine is not None:
            self.running.add(engine)
        return len(self.requests) == 1

    def so_far(self, request_id: str) -> float | None:
        """The joules a request in flight has used so far (its provisional share)."""
        if request_id not in self.requests or self.sampled_at is None:
            return None
        now = self.close()
        return sum(share for _, share in self._shares(request_id, now))

    def finish(self, request_id: str, tokens: int | None) -> float | None:
        """A request ended, with its tokens (None: not known): the joules it takes."""
        if request_id not in self.requests:
            return None
        now = self.close()
        if tokens is not None:
            self.requests[request_id].tokens = float(tokens)
        taken = 0.0
        for stretch, share in self._shares(request_id, now):
            stretch.joules -= share
            stretch.sharing.discard(request_id)
            taken += share
        if self.last is not None and not self.last.sharing:
            self.last = None
        del self.requests[request_id]
        return taken if self.sampled_at is not None else None

    def engine_event(self, event: Event) -> EngineLoadEnergy | None:
        """Follow the host's engines: starts (loading), ready and stopped ones (idle)."""
        self.close()
        if isinstance(event, EngineSwitch) and event.stage == "begun":
            self.starting.setdefault(event.engine, (self.since, 0.0))
        elif isinstance(event, EngineSwitch) and event.stage in ("done", "failed"):
            t0, spent = self.starting.pop(event.engine, (self.since, 0.0))
            if event.stage == "done":
                self.running.add(event.engine)
            self.loading[event.engine] = self.loading.get(event.engine, 0.0) + spent
            return EngineLoadEnergy(self.since, self.host, event.engine, round(spent, 3),
                                    round(self.since - t0, 3), event.stage,
                                    measured=self.sampled_at is not None)
        elif (isinstance(event, IdleStop) and event.stage == "done") or \
                isinstance(event, EngineExit):
            self.running.discard(event.engine)
        return None

    def snapshot(self) -> dict[str, Any]:
        """For /status: the power now and where the energy went, in joules."""
        self.close()
        return {"power_watts": self.watts, "measured_joules": round(self.measured, 3),
                "requests_joules": round(self.to_requests, 3),
                "idle_joules": {e: round(j, 3) for e, j in sorted(self.idle.items())},
                "loading_joules": {e: round(j, 3) for e, j in sorted(self.loading.items())},
                "in_flight": len(self.requests)}


class Energy:
    """The hosts' meters, fed by the hub (requests routed, engines starting and stopping)
    and by the watches' GPU samples (`sample`); `finish` is what a request's end asks
    (observe/inflight.InFlight). `pace(host, busy)` tells a host's watch how often to
    sample: busy from its first request in flight to its last."""

    def __init__(self, clock: IReactorTime, publish: Publish,
                 progress: Callable[[str], int] = lambda request_id: 0,
                 pace: Callable[[str, bool], object] = lambda host, busy: None) -> None:
        self._clock = clock
        self._publish = publish
        self._progress = progress
        self._pace = pace
        self.hosts: dict[str, HostMeter] = {}
        self._where: dict[str, str] = {}        # request id -> host
        self._carried: dict[str, float] = {}    # the joules of a request's earlier hosts
        self.by_use: dict[tuple[str, str], float] = {}   # (model, key) -> joules of requests

    def meter(self, host: str) -> HostMeter:
        if host not in self.hosts:
            self.hosts[host] = HostMeter(host, self._clock, self._progress)
        return self.hosts[host]

    def listener(self, host: str) -> Callable[[float | None], None]:
        """What a host's watch hands its power samples to (hosts/watch.HostWatch.on_power)."""
        return partial(self.sample, host)

    def sample(self, host: str, watts: float | None) -> None:
        """A host's watch said its GPUs' power draw, summed (None: no GPU said it)."""
        self.meter(host).sample(watts)

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestRouted):
            if event.request_id in self._where:     # routed again (another host or model)
                before = self.finish(event.request_id, None, final=False)
                self._carried[event.request_id] = before or 0.0
            self._where[event.request_id] = event.host
            if self.meter(event.host).begin(event.request_id, event.engine):
                self._pace(event.host, True)
        elif isinstance(event, RequestEnded) and event.energy_joules is not None:
            use = (event.model or NO_ENGINE, event.key or NO_ENGINE)
            self.by_use[use] = self.by_use.get(use, 0.0) + event.energy_joules
        elif isinstance(event, (EngineSwitch, IdleStop, EngineExit)):
            said = self.meter(event.host).engine_event(event)
            if said is not None:
                self._publish(said)

    def so_far(self, request_id: str) -> float | None:
        """The joules a request in flight has used so far; None when not measured."""
        host = self._where.get(request_id)
        return None if host is None else self.hosts[host].so_far(request_id)

    def finish(self, request_id: str, tokens: int | None, final: bool = True) -> float | None:
        """A request ended: its joules (None: its host's power is not measured)."""
        host = self._where.pop(request_id, None)
        carried = self._carried.pop(request_id, None) if final else None
        if host is None:
            return carried
        meter = self.hosts[host]
        joules = meter.finish(request_id, tokens)
        if not meter.requests:
            self._pace(host, False)
        return joules if carried is None else carried + (joules or 0.0)

    def snapshot(self) -> dict[str, Any]:
        """For /status: each measured host's meter (one whose power was sampled), and the
        requests' joules by model and key."""
        return {"hosts": {name: m.snapshot() for name, m in sorted(self.hosts.items())
                          if m.sampled_at is not None},
                "requests": [{"model": model, "key": key, "joules": round(j, 3)}
                             for (model, key), j in sorted(self.by_use.items())]}
