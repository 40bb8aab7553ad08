"""The arithmetic of a host's queue estimate: ordinals, a running median, and
the estimated wait (ETA) of each waiter in served order.

An ETA is an estimate, never a promise, and never negative. The model, kept
simple on purpose (docs/managed-engines.md says the same):

- the queue is served in the order of its waiters (the scheduler's last pass);
- a waiter whose engine is the one that runs (or is being started) takes the
  next free slot: a slot held by a request frees after that engine's median
  request duration (measured from its lease to its end);
- a waiter for another engine (one engine at a time) waits for the slots of
  the engine before it to drain, then for its engine's start: the median of
  its last measured starts on that host, or its declared
  `start_timeout_seconds` until one is measured; a start under way counts
  what is left of that figure;
- on a host with `memory_gb` (engines together) each engine is its own line:
  a waiter for an engine that does not run waits for its start only;
- a figure never measured (a request duration) makes the ETAs that depend on
  it unknown (None), never a guess.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median

UNKNOWN = math.inf   # an unmeasured figure inside the arithmetic; shown as None


def ordinal(n: int) -> str:
    """`n` as an English ordinal: 1st 2nd 3rd 4th ... 11th 12th 13th ... 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class RunningMedian:
    """The median of the last `size` samples (None before the first)."""

    def __init__(self, size: int) -> None:
        self._samples: deque[float] = deque(maxlen=size)

    def add(self, sample: float) -> None:
        self._samples.append(max(0.0, sample))

    def value(self) -> float | None:
        return float(median(self._samples)) if self._samples else None

    def __len__(self) -> int:
        return len(self._samples)


@dataclass(frozen=True)
class Need:
    """What a waiter waits for: `engine` (None: whichever runs), or a `stop`
    (an operator's stop: the engines drain, nothing starts)."""

    engine: str | None
    stop: bool = False


@dataclass(frozen=True)
class Line:
    """The state one line of the queue starts from: the engine that runs (or is
    being started, `ready_in` seconds from now), its requests in flight and slots."""

    engine: str | None
    in_flight: int = 0
    ready_in: float = 0.0


Figure = Callable[[str | None], float | None]   # an engine's median, None: unmeasured
Slots = Callable[[str | None], int | None]      # an engine's slots, None: no limit


def _known(value: float | None) -> float:
    return UNKNOWN if value is None else value


def etas(queue: Sequence[Need], line: Line, start: Figure, duration: Figure,
         slots: Slots) -> list[float | None]:
    """The ETA of each waiter of a one-engine-at-a-time queue, in its order
    (see the module docstring); None: unknown."""
    cur, base = line.engine, max(0.0, line.ready_in)
    busy = [base + _known(duration(cur))] * line.in_flight
    heapq.heapify(busy)
    out: list[float | None] = []
    for need in queue:
        engine = cur if need.engine is None else need.engine
        if need.stop or engine != cur:
            drained = max([base, *busy])
            base = drained + (0.0 if need.stop else _known(start(engine)))
            cur, busy = (None if need.stop else engine), []
            if need.stop:
                out.append(None if math.isinf(drained) else drained)
                continue
        limit = slots(cur)
        at = base if limit is None or len(busy) < limit else max(base, heapq.heappop(busy))
        heapq.heappush(busy, at + _known(duration(cur)))
        out.append(None if math.isinf(at) else at)
    return out


def etas_together(queue: Sequence[Need], lines: dict[str, Line], start: Figure,
                  duration: Figure, slots: Slots) -> list[float | None]:
    """The ETA of each waiter of a host whose engines run together: each engine
    its own line (one that does not run starts first)."""
    out: list[float | None] = [None] * len(queue)
    by_engine: dict[str | None, list[int]] = {}
    for i, need in enumerate(queue):
        by_engine.setdefault(None if need.stop else need.engine, []).append(i)
    for engine, indexes in by_engine.items():
        if engine is None:
            continue     # a stop, or a request for no engine in particular: unknown
        line = lines.get(engine) or Line(None, 0, 0.0)
        found = etas([Need(engine) for _ in indexes], line, start, duration, slots)
        for i, eta in zip(indexes, found, strict=True):
            out[i] = eta
    return out
