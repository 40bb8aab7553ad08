"""A request waiting in a host's queue (hosts/scheduler.py), the Lease it gets,
and which waiter a full queue gives up for a request of a higher class
(hosts/priority.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall

from llmproxy.hosts.priority import NORMAL

OFF = ""   # what an operator's stop waits for: no engine (no engine has this name)


@dataclass(eq=False)
class Waiter:
    """One request (or an operator's stop) in a host's queue."""

    engine: str | None
    deferred: Deferred[Any]
    arrived: float
    request_id: str | None = None
    timer: IDelayedCall | None = None
    overdue: bool = False      # timed out while its engine was being started
    stop: bool = False         # an operator's stop of `engine` (a budgeted host's)
    waited: bool = False       # it was not served at once (a Queued event said so)
    priority: int = NORMAL     # its class (hosts/priority.py)
    bounded: bool = True       # a client's request (not an operator's command)
    held_back: bool = False    # refused a pass of a waiting switch once (hosts/batching.py)
    seq: int = field(default_factory=count().__next__)   # arrival order


def evicted(queue: Sequence[Waiter], arrival: Waiter, off: str) -> Waiter | None:
    """The waiter a full queue gives up so that `arrival` may wait: the newest
    of the lowest class below the arrival's (a client's request, not a stop);
    None: the arrival is the one refused."""
    lower = [w for w in queue if w is not arrival and w.bounded and not w.stop
             and w.engine != off and w.priority > arrival.priority]
    return max(lower, key=lambda w: (w.priority, w.seq), default=None)


@dataclass
class Lease:
    """One request's slot on its host and hold on the engine that runs there; the
    engine is not switched or stopped until every lease on it is released."""

    engine: str | None
    _on_release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        """Give the slot back; calling it again does nothing."""
        callback, self._on_release = self._on_release, None
        if callback is not None:
            callback()
