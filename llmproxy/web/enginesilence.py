"""An engine that stops sending in the middle of an answer: how long the proxy
waits (`engine_read_timeout_seconds`), and who is to blame.

Once an engine's headers have come (before them, `header_timeout_seconds`
holds), a relay's progress is what it has written to the client. The engine is
silent when that stays the same for the timeout while the client was not
holding the engine back: while the client's socket is full the relay's
producer is paused, and the client's own write stall rule
(`client_write_stall_seconds`, web/timers.py and web/cutoff.py) judges that
case, never this one.

The watch looks every quarter of the timeout (one timed call per answer, never
one per event), so it fires between the timeout and 1.25 times it after the
last progress. It runs on the injected reactor (task.Clock in tests)."""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from zope.interface import implementer

CHECKS_PER_TIMEOUT = 4


@implementer(IPushProducer)
class Pausing:
    """An engine connection as a response's producer, which remembers whether
    the client's side has paused it (`paused`)."""

    def __init__(self, producer: IPushProducer) -> None:
        self._producer = producer
        self.paused = False

    def pauseProducing(self) -> None:
        self.paused = True
        self._producer.pauseProducing()

    def resumeProducing(self) -> None:
        self.paused = False
        self._producer.resumeProducing()

    def stopProducing(self) -> None:
        self._producer.stopProducing()


class SilenceWatch:
    """Calls `silent(seconds)` once, when `progress()` has not changed for
    `seconds` (within a quarter of them) while `paused()` was false all along;
    a pause starts the count again once it ends. `stop()` ends the watch (the
    answer is over); a timeout of 0 or less watches nothing."""

    def __init__(self, clock: IReactorTime, seconds: float, progress: Callable[[], int],
                 paused: Callable[[], bool], silent: Callable[[float], None]) -> None:
        self._clock = clock
        self._seconds = seconds
        self._progress = progress
        self._paused = paused
        self._silent = silent
        self._last = progress()
        self._quiet = 0          # checks in a row that saw no progress and no pause
        self._call: IDelayedCall | None = None

    def start(self) -> SilenceWatch:
        if self._seconds > 0:
            self._arm()
        return self

    def stop(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _arm(self) -> None:
        self._call = self._clock.callLater(self._seconds / CHECKS_PER_TIMEOUT, self._check)

    def _check(self) -> None:
        self._call = None
        now = self._progress()
        if now != self._last or self._paused():
            self._last, self._quiet = now, 0
        else:
            self._quiet += 1
            if self._quiet >= CHECKS_PER_TIMEOUT:
                self._silent(self._seconds)
                return
        self._arm()
