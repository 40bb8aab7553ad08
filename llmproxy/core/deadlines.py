"""Many deadlines on one timed call.

A timed call per wait costs more than the wait's own work when nearly every
wait ends well before its deadline (an engine's response headers against
header_timeout_seconds): Twisted's reactor makes a DelayedCall, runs its
timed-call pass on the next turn to file it, and sweeps it out once
cancelled. `Deadlines` keeps every pending deadline in a dict and one timed
call at the earliest: adding a deadline no sooner than that one (the usual
case: one timeout for all, later arrivals, later deadlines) and removing one
cost a dict operation. When the call runs, it expires what is due and is set
again for the earliest left.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from twisted.internet.interfaces import IDelayedCall, IReactorTime

_SLACK = 1e-9     # seconds


class Deadlines:
    """Deadlines of many waits on `clock`; each expires by calling its own
    function, at its time, unless removed first."""

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._due: dict[Hashable, tuple[float, Callable[[], None]]] = {}
        self._call: IDelayedCall | None = None
        self._at = 0.0                     # when `_call` runs

    def add(self, key: Hashable, seconds: float, expire: Callable[[], None]) -> None:
        """Call `expire()` in `seconds` unless `key` is removed first."""
        deadline = self._clock.seconds() + seconds
        self._due[key] = (deadline, expire)
        if self._call is None or deadline < self._at:   # (sooner: a shorter timeout)
            self._arm(deadline)

    def remove(self, key: Hashable) -> None:
        """`key`'s wait ended: nothing expires for it."""
        self._due.pop(key, None)

    def __len__(self) -> int:
        return len(self._due)

    def stop(self) -> None:
        """Drop every deadline and the timed call."""
        self._due.clear()
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _run(self) -> None:
        self._call = None
        now = self._clock.seconds()
        # (A call set for the earliest deadline may run a rounding error before it.)
        due = [key for key, (deadline, _) in self._due.items() if deadline <= now + _SLACK]
        for key in due:
            entry = self._due.pop(key, None)
            if entry is not None:          # (not removed by an earlier one's expiry)
                entry[1]()
        if self._due:
            self._arm(min(deadline for deadline, _ in self._due.values()))

    def _arm(self, earliest: float) -> None:
        """The timed call at `earliest`, unless it runs sooner (an expiry may
        have added a deadline and set it)."""
        delay = max(0.0, earliest - self._clock.seconds())
        if self._call is None:
            self._call = self._clock.callLater(delay, self._run)
        elif earliest < self._at:
            self._call.reset(delay)
        else:
            return
        self._at = earliest
