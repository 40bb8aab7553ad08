"""Priority classes in a host's queue: the order in which its waiters are
considered (the Scheduler keeps them in this order before each pass).

A waiter's class is its key's `priority` (high, normal, low). The order is
arrival order, except that a waiter moves ahead of earlier ones of a lower
class; two bounds keep the queue's other promises:

- no starvation: a low waiter that has waited longer than half the host's
  `queue_timeout_seconds` counts as normal (never as high: a steady flood of
  low requests never goes ahead of fresh high ones);
- the fairness bound of an engine switch holds: no waiter moves ahead of an
  earlier one that waits for an engine that does not run (a switch, a start, an
  operator's stop). Requests for the running engine pass such a waiter only as
  the queue's own rule lets them, at most `fairness` per switch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

HIGH, NORMAL, LOW = 0, 1, 2
RANKS = {"high": HIGH, "normal": NORMAL, "low": LOW}


class Waiting(Protocol):
    """What the order reads of a waiter."""

    @property
    def priority(self) -> int: ...

    @property
    def arrived(self) -> float: ...

    @property
    def seq(self) -> int: ...


W = TypeVar("W", bound=Waiting)


def rank(priority: str | None) -> int:
    """The class of a key's `priority` (None: a request without a key: normal)."""
    return RANKS.get(priority or "normal", NORMAL)


def ordered(waiters: Sequence[W], now: float, aged_after: float,
            barrier: Callable[[W], bool]) -> list[W]:
    """`waiters` in the order a queue considers them (see the module's
    docstring): by class, then arrival, never ahead of an earlier waiter that
    is a `barrier` (waits for an engine that does not run)."""
    out: list[W] = []
    floor = 0       # nothing is placed before this index: the last barrier's, plus one
    for waiter in sorted(waiters, key=lambda w: w.seq):
        mine = _effective(waiter, now, aged_after)
        at = len(out)
        while at > floor and _effective(out[at - 1], now, aged_after) > mine:
            at -= 1
        out.insert(at, waiter)
        if barrier(waiter):
            floor = at + 1
    return out


def _effective(waiter: Waiting, now: float, aged_after: float) -> int:
    return min(waiter.priority, NORMAL) if now - waiter.arrived > aged_after else waiter.priority
