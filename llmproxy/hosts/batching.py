"""The rule of a host's queue for requests of several engines (a host's
`schedule`), used by both placement policies (hosts/placement.py,
hosts/budget.py) through their scheduler (hosts/scheduler.py).

- `arrival`: a request for a running engine may pass an earlier one that waits
  for a switch (or a start) freely while the running engine is resident, then
  at most `fairness` of them per switch.
- `batch` (the default): the waiting requests of a running engine are served
  first, then the host switches once for all the waiters of the next engine.
  During the running engine's residency requests for it pass freely, as in
  `arrival` (that wait is `min_engine_seconds`' own bound). After it, they
  pass a waiting switch freely (new arrivals too) while the oldest waiter for
  another engine has waited less than the host's `max_wait_seconds` because
  of the batch (`batch_wait`: counted from its arrival, or from the end of
  the start that began the running engine's batch if that came later); from
  then on none passes it, and the switch begins once the streams in flight
  end. So no request waits more than `max_wait_seconds` (plus the longest
  stream in flight) because of batching. A request of a lower class than a
  waiter it passes passes at most `fairness` times per switch, and once
  refused a request stays behind the switch.

In `batch`, a running engine that falls idle (nothing in flight or queued
for it) while a switch waits keeps the host a while (`idle_hold`): for as long
after its last request as its own last start took, within the batch's
`max_wait_seconds`. A request for it in that time is served without two loads
(away and back); waiting that long at most costs the waiters no more than the
load a switch back would cost (the rule of renting skis: wait up to the price
of buying).

In `batch`, the engines that wait for a switch are also kept in the order of
their first waiter in the queue's order (hosts/priority.py): by class, then
the engine whose oldest waiter has waited longest goes next, with all its
waiters together, so the queue lists the order it is served in. An
operator's stop is never moved and nothing is moved across it; requests for
a running engine keep their places (they pass only as above). In both, a
switch never cuts a stream: it waits for the running engine's requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from twisted.internet.interfaces import IReactorTime

from llmproxy.config import HostConfig
from llmproxy.hosts.priority import Waiting, ordered
from llmproxy.hosts.waiter import OFF

ARRIVAL, BATCH = "arrival", "batch"   # a host's `schedule` (config/capacity.py)

T = TypeVar("T")


class Queued(Waiting, Protocol):
    """What the order reads of a waiter besides its class and arrival."""

    @property
    def engine(self) -> str | None: ...

    @property
    def stop(self) -> bool: ...

    @property
    def held_back(self) -> bool: ...


Q = TypeVar("Q", bound=Queued)


def may_overtake(host: HostConfig, now: float, blocked: Sequence[Waiting], waiter: Queued,
                 resident: bool, jumped: int, fairness: int,
                 since: float = -math.inf) -> tuple[bool, bool]:
    """Whether one more request (`waiter`) for a running engine may pass the
    waiters `blocked` on a switch or start (by `host`'s schedule), and whether
    that pass counts against `fairness` (`jumped` so far this switch). `since`:
    when the host's last start was done (its batch began; `batch_wait`)."""
    if resident:
        return True, False      # the residency is its own bound (min_engine_seconds)
    if host.schedule == BATCH:
        if blocked and batch_wait(now, blocked, since) >= host.max_wait_seconds:
            return False, False
        if not waiter.held_back and all(waiter.priority <= w.priority for w in blocked):
            return True, False
    return jumped < fairness, True


def batch_wait(now: float, blocked: Sequence[Waiting], since: float) -> float:
    """How long the oldest of `blocked` has waited because of the running
    engine's batch: since its arrival, or since the batch began (the start that
    made the engine run, `since`) if later; the wait for that start is the
    start's own, not the batch's."""
    return now - max(since, min(w.arrived for w in blocked))


class QueueReads(Protocol):
    """What `idle_hold` reads of a host's scheduler (hosts/scheduler.py)."""

    host: HostConfig
    clock: IReactorTime
    batch_began: float
    engine_used: dict[str | None, float]

    @property
    def waiters(self) -> Sequence[Queued]: ...


def idle_hold(q: QueueReads, engine: str | None, runs: Callable[[str | None], bool],
              last_switch: Mapping[str, Any] | None) -> float | None:
    """In `batch`, until when `engine`, running and fallen idle, keeps the host
    from a waiting switch or start (None: it does not): as long after its last
    request as its own last start took (`last_switch`: the controller's), since
    coming back to it after a switch would cost the GPU that load again, and
    never past `max_wait_seconds` of the waiters' batch (`batch_wait`)."""
    load = last_switch.get("elapsed") if last_switch and last_switch.get("engine") == engine \
        and last_switch.get("outcome") == "ok" else None
    held = blocked(q.waiters, runs, OFF)
    if q.host.schedule != BATCH or not held or not load or engine is None:
        return None
    until = min(q.engine_used.get(engine, 0.0) + load,
                max(q.batch_began, min(w.arrived for w in held)) + q.host.max_wait_seconds)
    return until if q.clock.seconds() < until else None


def blocked(waiters: Sequence[Q], runs: Callable[[str | None], bool], off: str) -> list[Q]:
    """The waiters for an engine that does not run, or an operator's stop."""
    return [w for w in waiters if w.stop or w.engine == off or not runs(w.engine)]


def serving_order(waiters: Sequence[Q], schedule: str, now: float, aged_after: float,
                  held: Sequence[Q], off: str) -> list[Q]:
    """`waiters` in the order they are served: by class (hosts/priority.py;
    `held`: those waiting for an engine that does not run, or a stop), then,
    in `batch`, grouped by engine (`grouped`; `off`: what a stop waits for)."""
    out = ordered(waiters, now, aged_after, held.__contains__)
    if schedule != BATCH:
        return out
    return grouped(out, lambda w: w.engine, lambda w: w.stop or w.engine == off,
                   lambda w: w not in held)


def grouped(waiters: Sequence[T], engine_of: Callable[[T], object],
            fixed: Callable[[T], bool], kept: Callable[[T], bool]) -> list[T]:
    """`waiters` (in the queue's order) with each engine's waiters moved up to
    its first one. A `fixed` waiter (an operator's stop) keeps its place and
    nothing is moved across it; a `kept` one (for a running engine) keeps its
    place among the others."""
    out: list[T] = []
    segment: list[T] = []

    def flush() -> None:
        seen: set[object] = set()
        for w in segment:
            if kept(w):
                out.append(w)
            elif engine_of(w) not in seen:
                seen.add(engine_of(w))
                out.extend(x for x in segment
                           if not kept(x) and engine_of(x) == engine_of(w))
        segment.clear()

    for w in waiters:
        if fixed(w):
            flush()
            out.append(w)
        else:
            segment.append(w)
    flush()
    return out
