"""An engine that stops sending in the middle of an answer: how long the proxy
waits (`engine_read_timeout_seconds`), and who is to blame.

Once an engine's headers have come (before them, `header_timeout_seconds`
holds), a relay's progress is what it has written to the client. The engine is
silent when that stays the same for the timeout while the client was not
holding the engine back: while the client's socket is full the relay's
producer is paused, and the client's own write stall rule
(`client_write_stall_seconds`, web/timers.py and web/cutoff.py) judges that
case, never this one.

One sweep every quarter of the timeout looks at every answer under way (one
timed call for all of them, never one per answer or per event), so an answer
is cut between the timeout and 1.25 times it after its last progress. It runs
on the injected reactor (task.Clock in tests)."""

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


class Watch:
    """One answer under watch: what it has sent (`progress`), whether its
    client holds it back (`paused`), and what to call once it is silent."""

    __slots__ = ("last", "paused", "progress", "quiet", "silent")

    def __init__(self, progress: Callable[[], int], paused: Callable[[], bool],
                 silent: Callable[[float], None]) -> None:
        self.progress = progress
        self.paused = paused
        self.silent = silent
        self.last = progress()
        # Sweeps in a row that saw no progress and no pause; the first sweep
        # after the start counts as progress (the start is the last one seen).
        self.quiet = -1


class SilenceWatches:
    """Every answer under way, swept by one timed call every quarter of the
    timeout (`seconds()`, read at each sweep; 0 or less: nothing is watched).
    An answer silent for CHECKS_PER_TIMEOUT sweeps in a row is `silent(seconds)`
    once and leaves the watch. Adding and removing an answer cost a set
    operation: no timed call per answer."""

    def __init__(self, clock: IReactorTime, seconds: Callable[[], float]) -> None:
        self._clock = clock
        self._seconds = seconds
        self._watched: set[Watch] = set()
        self._call: IDelayedCall | None = None

    def add(self, progress: Callable[[], int], paused: Callable[[], bool],
            silent: Callable[[float], None]) -> Watch | None:
        """Watch one answer (None when the timeout is off)."""
        if self._seconds() <= 0:
            return None
        watch = Watch(progress, paused, silent)
        self._watched.add(watch)
        if self._call is None:
            self._arm()
        return watch

    def remove(self, watch: Watch | None) -> None:
        """The answer is over. (The sweep stops at its next turn once none is left.)"""
        if watch is not None:
            self._watched.discard(watch)

    def __len__(self) -> int:
        return len(self._watched)

    def stop(self) -> None:
        """Watch nothing more, and leave no timed call."""
        self._watched.clear()
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _arm(self) -> None:
        self._call = self._clock.callLater(self._seconds() / CHECKS_PER_TIMEOUT, self._sweep)

    def _sweep(self) -> None:
        self._call = None
        seconds = self._seconds()
        for watch in list(self._watched):
            now = watch.progress()
            if now != watch.last or watch.paused():
                watch.last, watch.quiet = now, 0
                continue
            watch.quiet += 1
            if watch.quiet >= CHECKS_PER_TIMEOUT:
                self._watched.discard(watch)
                watch.silent(seconds)
        if self._watched and seconds > 0:
            self._arm()
