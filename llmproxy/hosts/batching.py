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
  pass a waiting switch only while the oldest waiter for another engine has
  waited less than the host's `max_wait_seconds`; from then on none passes it.
  Within that, a request that waited in the queue for a slot passes freely
  (it is part of the running engine's batch) unless a waiter it passes is of
  a higher class; one that arrives while the switch waits (or is of a lower
  class) passes at most `fairness` times per switch, and once refused it
  stays behind the switch, so a steady flow of new requests cannot hold the
  switch back either.

In `batch`, the engines that wait for a switch are also kept in the order of
their first waiter in the queue's order (hosts/priority.py): by class, then
the engine whose oldest waiter has waited longest goes next, with all its
waiters together, so the queue lists the order it is served in. An
operator's stop is never moved and nothing is moved across it; requests for
a running engine keep their places (they pass only as above). In both, a
switch never cuts a stream: it waits for the running engine's requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from llmproxy.config import HostConfig
from llmproxy.hosts.priority import Waiting, ordered

ARRIVAL, BATCH = "arrival", "batch"   # a host's `schedule` (config/capacity.py)

T = TypeVar("T")


class Queued(Waiting, Protocol):
    """What the order reads of a waiter besides its class and arrival."""

    @property
    def engine(self) -> str | None: ...

    @property
    def stop(self) -> bool: ...

    @property
    def waited(self) -> bool: ...

    @property
    def held_back(self) -> bool: ...


Q = TypeVar("Q", bound=Queued)


def may_overtake(host: HostConfig, now: float, blocked: Sequence[Waiting], waiter: Queued, *,
                 resident: bool, jumped: int, fairness: int) -> tuple[bool, bool]:
    """Whether one more request (`waiter`) for a running engine may pass the
    waiters `blocked` on a switch or start (by `host`'s schedule; its `waited`:
    it waited in the queue, not just arriving), and whether that pass counts
    against `fairness` (`jumped` so far this switch)."""
    if resident:
        return True, False      # the residency is its own bound (min_engine_seconds)
    if host.schedule == BATCH:
        if blocked and now - min(w.arrived for w in blocked) >= host.max_wait_seconds:
            return False, False
        if waiter.waited and not waiter.held_back and \
                all(waiter.priority <= w.priority for w in blocked):
            return True, False
    return jumped < fairness, True


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
