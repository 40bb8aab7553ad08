"""New requests take turns with the streams already running.

A request's set-up (its door, its body's JSON, its route and lease, the engine
client's request) is the costliest thing the proxy does per request, and the
reactor does nothing else meanwhile: 200 requests that arrive together are
200 set-ups in one turn of the loop, and the events of the streams already
running wait behind all of them (on the reference path about 0.9 ms each,
180 ms in all). `Turns` lets the set-ups of one loop turn run for at most
SLICE seconds; the rest wait for the next turns, each after the reactor's
I/O, SLICE at a time. A lone request never waits: the first set-ups of a turn
run at once, as before. Other work that can wait takes its turns in the same
line: the packing of a large capture (lifecycle/assemble.py).

It rests on two facts of Twisted's loop: a `callLater(0, f)` made now runs at
the start of the next turn, after this turn's I/O, and the I/O that turn
polls for comes after every timed call due (ReactorBase.runUntilCurrent,
then doIteration).
"""

from __future__ import annotations

from collections import deque

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime

SLICE = 0.002   # seconds of new requests' set-up per turn of the loop, once it is busy


class Turns:
    """Whose set-up runs now (`take()` fired) and whose waits for a later turn
    of the loop (queued in order of arrival). Timed on `clock`: its seconds
    measure the slice, its `callLater(0, ...)` marks the next turn."""

    def __init__(self, clock: IReactorTime, slice_seconds: float = SLICE) -> None:
        self._clock = clock
        self._slice = slice_seconds
        self._since: float | None = None        # when this turn's set-ups began
        self._waiting: deque[Deferred[None]] = deque()
        self._next_turn = False                 # a callLater(0) is pending

    @property
    def waiting(self) -> int:
        """How many set-ups wait for a later turn."""
        return len(self._waiting)

    def take(self) -> Deferred[None]:
        """Fires when this set-up may run: at once while this turn's set-ups
        have run for less than the slice and none waits, else in a later turn."""
        now = self._clock.seconds()
        if not self._waiting and (self._since is None or now - self._since < self._slice):
            if self._since is None:
                self._since = now
                self._turn_ends()
            return succeed(None)
        waiter: Deferred[None] = Deferred(self._waiting.remove)
        self._waiting.append(waiter)
        self._turn_ends()
        return waiter

    def _turn_ends(self) -> None:
        if not self._next_turn:
            self._next_turn = True
            self._clock.callLater(0, self._turn)

    def _turn(self) -> None:
        """A new turn of the loop, after the last one's I/O: the waiting set-ups
        run, a slice's worth."""
        self._next_turn = False
        self._since = None
        if not self._waiting:
            return
        self._since = start = self._clock.seconds()
        while self._waiting and self._clock.seconds() - start < self._slice:
            self._waiting.popleft().callback(None)
        self._turn_ends()
