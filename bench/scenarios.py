"""The figures of one run, phase by phase.

- latency: sequential small non-streamed completions on one keep-alive connection per
  target, the targets interleaved request by request; request sent to last body byte.
- ttfb: the same with short streams; request sent to the first complete event.
- throughput: concurrent unpaced streams; events received per second of wall time, and the
  target's CPU per 1,000 events.
- cpu: concurrent paced streams at a load every target keeps up with, so each event is
  relayed on its own: the target's CPU per 1,000 relayed events, over the whole phase
  and over its steady window (every stream started, none ended yet: the budgeted figure).
- paced: concurrent streams at a fixed rate each, started over a ramp at well-spread
  moments (`start_offset`) so their ticks do not fall together; the lag of each event
  (received minus the engine's send time in the event), and the target's CPU per 1,000
  relayed events (cheaper-looking when the target fell behind and relayed events in
  batches: `kept_up` says whether it did).
- burst: as paced, but every stream started at once and in one batch of the engine,
  which writes one event to every stream in the same step (as a batched engine,
  llama-server `-np` or vLLM, emits one token per sequence per decode step): the events
  reach the target together, and the lag's tail is events waiting behind each other.
- rss: many concurrent paced streams; how many completed whole, and the target's peak RSS
  (VmHWM, reset at the start of the phase).
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bench.client import Connection, Exchange, chat_request
from bench.stats import per_thousand, summary_ms
from bench.targets import (
    HOST,
    Target,
    cpu_seconds,
    memory_kib,
    reset_peak_rss,
    runqueue_wait_seconds,
)


@dataclass(frozen=True)
class Plan:
    """The size of each phase (the full run's defaults; `quick()` for a smoke run)."""

    latency_requests: int = 400
    latency_warmup: int = 50
    ttfb_requests: int = 200
    ttfb_warmup: int = 20
    ttfb_events: int = 4
    throughput_streams: int = 16
    throughput_events: int = 2000
    throughput_rounds: int = 5
    paced_streams: int = 200
    paced_rate: float = 50.0
    paced_events: int = 200
    paced_ramp: float = 1.0
    burst_streams: int = 200
    burst_rate: float = 50.0
    burst_events: int = 200
    cpu_streams: int = 150
    cpu_rate: float = 30.0
    cpu_events: int = 150
    cpu_ramp: float = 1.0
    cpu_rounds: int = 2          # each a pass forwards and one backwards (passes.py)
    rss_streams: int = 1000
    rss_rate: float = 10.0
    rss_events: int = 50
    rss_ramp: float = 1.0

    @classmethod
    def quick(cls) -> Plan:
        return cls(latency_requests=100, latency_warmup=20, ttfb_requests=50, ttfb_warmup=5,
                   throughput_rounds=1, cpu_events=90, cpu_rounds=1, paced_streams=200,
                   paced_events=50, burst_events=50, rss_streams=1000, rss_events=20, rss_ramp=1.0)


PHASES = ("latency", "ttfb", "throughput", "cpu", "paced", "burst", "rss")


class Quiet:
    """No cyclic GC in the client while a phase measures (collected before it)."""

    def __enter__(self) -> None:
        gc.collect()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        gc.enable()


class CpuMeter:
    """CPU seconds used while it is entered (it may be entered several times): by the
    target's processes, by the engine and by this client; and how long the target waited
    for a CPU. The target's CPU is the budgeted figure; the rest tell how much of the
    machine the harness took and how much the machine held the target back."""

    def __init__(self, target: Target) -> None:
        self._pids = target.pids()
        self._engine = target.engine_pids()
        self._start = (0.0, 0.0, 0.0, 0.0)
        self.target = self.engine = self.client = self.waited = 0.0

    def _now(self) -> tuple[float, float, float, float]:
        return (cpu_seconds(self._pids), cpu_seconds(self._engine), time.process_time(),
                runqueue_wait_seconds(self._pids))

    def __enter__(self) -> None:
        self._start = self._now()

    def __exit__(self, *exc: object) -> None:
        target, engine, client, waited = self._now()
        self.target += target - self._start[0]
        self.engine += engine - self._start[1]
        self.client += client - self._start[2]
        self.waited += waited - self._start[3]

    def figures(self, events: int) -> dict[str, float | None]:
        """Milliseconds of CPU per 1,000 events: the target's (None for direct), the
        engine's and the client's."""
        return {
            "cpu_ms_per_1k": _round(per_thousand(self.target, events)) if self._pids else None,
            "engine_cpu_ms_per_1k": _round(per_thousand(self.engine, events)),
            "client_cpu_ms_per_1k": _round(per_thousand(self.client, events)),
            "runqueue_wait_ms": round(self.waited * 1000, 1) if self._pids else None,
        }


def _complete(ex: Exchange, events: int | None) -> bool:
    return ex.complete and (events is None or (ex.done and ex.events == events))


class _Side:
    """One target's part of an interleaved sequential phase: its keep-alive connection
    (reopened if the server closed it) and its figures."""

    def __init__(self, target: Target, raw: bytes) -> None:
        self.target = target
        self.raw = raw
        self.conn: Connection | None = None
        self.values: list[float] = []
        self.errors: list[str] = []

    async def one(self, keep: bool, sse: bool, events: int | None,
                  figure: Callable[[Exchange], float | None]) -> None:
        if self.conn is None or not self.conn.usable:
            self.conn = await Connection.open(HOST, self.target.port)
        ex = await self.conn.request(self.raw, sse=sse)
        value = figure(ex)
        if not _complete(ex, events) or value is None:
            self.errors.append(ex.error or f"status {ex.status}, {ex.events} events, "
                               f"done={ex.done}")
        elif keep:
            self.values.append(value)

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = summary_ms(self.values)
        out["errors"] = len(self.errors)
        if self.errors:
            out["first_error"] = self.errors[0]
        return out


async def _interleaved(targets: list[Target], stream: bool, events: int, count: int,
                       warmup: int,
                       figure: Callable[[Exchange], float | None]) -> dict[str, dict[str, Any]]:
    """`warmup + count` rounds of one request to each target in turn (the order rotates
    each round), one request in flight at a time: a disturbance of the shared machine
    falls on every target alike instead of on whichever was being measured."""
    sides = [_Side(t, chat_request(HOST, t.port, stream=stream, events=events))
             for t in targets]
    cpu: dict[str, float] = {}
    try:
        with Quiet():
            for i in range(warmup + count):
                if i == warmup:
                    cpu = {side.target.name: cpu_seconds(side.target.pids()) for side in sides}
                for k in range(len(sides)):
                    side = sides[(i + k) % len(sides)]
                    await side.one(i >= warmup, stream, events if stream else None, figure)
    finally:
        for side in sides:
            if side.conn is not None:
                side.conn.close()
    out = {}
    for side in sides:
        pids = side.target.pids()
        used = cpu_seconds(pids) - cpu.get(side.target.name, 0.0)
        out[side.target.name] = {
            **side.figures(),
            "cpu_ms_per_request": round(used * 1000 / count, 3) if pids and count else None,
        }
    return out


async def latency(targets: list[Target], plan: Plan) -> dict[str, dict[str, Any]]:
    """Request sent to last byte of a small non-streamed completion."""
    return await _interleaved(
        targets, False, 0, plan.latency_requests, plan.latency_warmup,
        lambda ex: None if ex.t_done is None else ex.t_done - ex.t_sent)


async def ttfb(targets: list[Target], plan: Plan) -> dict[str, dict[str, Any]]:
    """Request sent to the first complete event of a short stream."""
    return await _interleaved(
        targets, True, plan.ttfb_events, plan.ttfb_requests, plan.ttfb_warmup,
        lambda ex: None if ex.t_first is None else ex.t_first - ex.t_sent)


async def throughput(target: Target, plan: Plan) -> dict[str, Any]:
    raw = chat_request(HOST, target.port, stream=True, events=plan.throughput_events)
    rates: list[float] = []
    total_events = 0
    incomplete = 0
    meter = CpuMeter(target)
    for _ in range(plan.throughput_rounds):
        conns = await asyncio.gather(*[Connection.open(HOST, target.port)
                                       for _ in range(plan.throughput_streams)])
        with Quiet(), meter:
            t0 = time.perf_counter()
            exchanges = await asyncio.gather(*[c.request(raw, sse=True) for c in conns])
            elapsed = time.perf_counter() - t0
        for c in conns:
            c.close()
        got = sum(ex.events for ex in exchanges)
        total_events += got
        incomplete += sum(not _complete(ex, plan.throughput_events) for ex in exchanges)
        rates.append(got / elapsed)
    return {
        "streams": plan.throughput_streams,
        "events_per_stream": plan.throughput_events,
        "rounds": [round(r) for r in rates],
        "events_per_s": round(statistics.median(rates)),
        "incomplete": incomplete,
        **meter.figures(total_events),
    }


GOLDEN = (5 ** 0.5 - 1) / 2
STEADY_MARGIN = 0.5  # seconds after the ramp from which the paced phase is "steady"
WARMUP_SECONDS = 0.5  # the ramp and the length of the warm-up streams of a paced phase


def start_offset(i: int, ramp: float) -> float:
    """When the i-th stream of a ramp starts: i times the golden ratio, modulo the ramp.

    Evenly spaced starts (i * ramp / n) would line up with the streams' tick interval
    (200 streams over 1 s are 5 ms apart: 50 of them would tick together every 20 ms),
    so a proxy would see bursts that no real set of clients sends. This sequence fills
    the ramp evenly while its phases against any interval stay spread.
    """
    return ramp * ((i * GOLDEN) % 1.0)


async def _paced_streams(target: Target, streams: int, rate: float, events: int, ramp: float,
                         want_lags: bool,
                         batch: bool = False) -> tuple[list[Exchange], int, float]:
    """Run `streams` paced streams, the i-th started `start_offset(i, ramp)` seconds in
    (`batch`: in one batch of the engine, their events written in the same steps).

    Returns the exchanges, the most streams in flight at once, and the wall time.
    """
    raw = chat_request(HOST, target.port, stream=True, events=events, rate=rate, batch=batch)
    in_flight = 0
    most = 0
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(i: int) -> Exchange:
        nonlocal in_flight, most
        await asyncio.sleep(max(0.0, t0 + start_offset(i, ramp) - loop.time()))
        try:
            conn = await Connection.open(HOST, target.port)
        except OSError as e:
            return Exchange(error=f"connect failed: {e}")
        in_flight += 1
        most = max(most, in_flight)
        try:
            return await conn.request(raw, sse=True, want_lags=want_lags)
        finally:
            in_flight -= 1
            conn.close()

    exchanges = await asyncio.gather(*[one(i) for i in range(streams)])
    return list(exchanges), most, loop.time() - t0


async def _paced_phase(target: Target, streams: int, rate: float, events: int,
                       ramp: float, batch: bool = False) -> dict[str, Any]:
    # Unmeasured, the same number of streams for a moment first: the first time a
    # process holds that many connections costs more (allocations, first code paths)
    # than it does in service.
    await _paced_streams(target, streams, rate, max(2, int(rate * WARMUP_SECONDS)),
                         0.0 if batch else WARMUP_SECONDS, want_lags=False, batch=batch)
    meter = CpuMeter(target)
    # Events the engine sent once every stream had been started (plus a margin for the
    # last requests to reach it) and before the first stream ended: the steady state,
    # without the arrivals and the departures (empty when the streams are too short).
    start = time.time()
    window = (ramp + STEADY_MARGIN, (events - 1) / rate)
    steady_from, steady_until = start + window[0], start + window[1]
    # The target's CPU at both ends of the steady window: the relay cost of an event
    # without the per-request set-up and tear-down.
    loop = asyncio.get_running_loop()
    pids = target.pids()
    at: list[float] = []
    if pids and window[1] > window[0]:
        for offset in window:
            loop.call_at(loop.time() + offset, lambda: at.append(cpu_seconds(pids)))
    with Quiet(), meter:
        exchanges, most, elapsed = await _paced_streams(target, streams, rate, events, ramp,
                                                        want_lags=True, batch=batch)
    lags = [lag for ex in exchanges for lag in (ex.lags or [])]
    steady = [lag for ex in exchanges
              for lag, sent in zip(ex.lags or [], ex.sent_at or [], strict=True)
              if steady_from <= sent < steady_until]
    relayed = sum(ex.events for ex in exchanges)
    s = summary_ms(lags)
    steady_p99 = summary_ms(steady).get("p99_ms")
    return {
        "streams": streams,
        "rate": rate,
        "events_per_stream": events,
        "events": relayed,
        "most_in_flight": most,
        "seconds": round(elapsed, 3),
        "ideal_seconds": round(ideal_seconds(ramp, events, rate), 3),
        "incomplete": sum(not _complete(ex, events) for ex in exchanges),
        "lag_p50_ms": s.get("p50_ms"),
        "lag_p99_ms": s.get("p99_ms"),
        "lag_max_ms": s.get("max_ms"),
        "steady_lag_p99_ms": steady_p99,
        "steady_events": len(steady),
        "steady_cpu_ms_per_1k": (_round(per_thousand(at[1] - at[0], len(steady)))
                                 if len(at) == 2 else None),
        # A target that fell behind in the steady window got several events of a stream
        # per read and relayed them as one: its CPU per event then looks cheaper than it is.
        "kept_up": (steady_p99 if steady_p99 is not None else s.get("p99_ms", 0.0))
        < 1000.0 / rate / 2,
        **meter.figures(relayed),
    }


async def cpu(target: Target, plan: Plan) -> dict[str, Any]:
    """Paced streams at a load every target keeps up with (every event relayed on its
    own): the CPU per relayed event that the CPU budget compares."""
    return await _paced_phase(target, plan.cpu_streams, plan.cpu_rate, plan.cpu_events,
                              plan.cpu_ramp)


async def paced(target: Target, plan: Plan) -> dict[str, Any]:
    """200 streams at 50 events/s: the lag of each event, and the CPU it took."""
    return await _paced_phase(target, plan.paced_streams, plan.paced_rate, plan.paced_events,
                              plan.paced_ramp)


async def burst(target: Target, plan: Plan) -> dict[str, Any]:
    """200 streams at 50 events/s, all started at once, whose events the engine writes
    in the same steps: the lag of each event when they arrive together."""
    return await _paced_phase(target, plan.burst_streams, plan.burst_rate, plan.burst_events,
                              0.0, batch=True)


async def rss(target: Target, plan: Plan) -> dict[str, Any]:
    pids = target.pids()
    before_kib = memory_kib(pids, "VmRSS")
    reset = reset_peak_rss(pids) if pids else False
    with Quiet():
        exchanges, most, elapsed = await _paced_streams(
            target, plan.rss_streams, plan.rss_rate, plan.rss_events, plan.rss_ramp,
            want_lags=False)
    peak_kib = memory_kib(pids, "VmHWM") if pids else 0
    errors = [ex.error for ex in exchanges if ex.error]
    out: dict[str, Any] = {
        "streams": plan.rss_streams,
        "rate": plan.rss_rate,
        "events_per_stream": plan.rss_events,
        "completed": sum(_complete(ex, plan.rss_events) for ex in exchanges),
        "most_in_flight": most,
        "seconds": round(elapsed, 3),
        "ideal_seconds": round(ideal_seconds(plan.rss_ramp, plan.rss_events, plan.rss_rate),
                               3),
        "rss_before_mib": round(before_kib / 1024, 1) if pids else None,
        "peak_rss_mib": round(peak_kib / 1024, 1) if pids else None,
        "peak_reset": reset,
    }
    if errors:
        out["first_error"] = errors[0]
    return out


def ideal_seconds(ramp: float, events: int, rate: float) -> float:
    """About when the last event of the last stream is due: the wall time of a phase whose
    target keeps up (every stream starts within the ramp)."""
    return ramp + (events - 1) / rate


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# Phases measured on all targets at once (interleaved), and one target at a time.
INTERLEAVED: dict[str, Callable[[list[Target], Plan], Awaitable[dict[str, dict[str, Any]]]]] = {
    "latency": latency,
    "ttfb": ttfb,
}
PER_TARGET: dict[str, Callable[[Target, Plan], Awaitable[dict[str, Any]]]] = {
    "throughput": throughput,
    "cpu": cpu,
    "paced": paced,
    "burst": burst,
    "rss": rss,
}
