"""Bytes to one streaming client (an event stream, an engine's log) as fast as
it reads them, and no faster.

`PausedSend` is the push producer a long-lived response registers on its
request: what is sent while the client's transport takes it is written at
once; while the transport is paused, it waits here, and once more than
`limit` bytes wait, `overflow()` is called once (the client does not read: the
caller drops it) and nothing more is queued. `flush()` writes what waits, for a
clean end. A stop (the transport going away) calls `stopped()`.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer


@implementer(IPushProducer)
class PausedSend:
    """See the module docstring."""

    def __init__(self, write: Callable[[bytes], None], limit: int,
                 overflow: Callable[[], None], stopped: Callable[[], None]) -> None:
        self._write = write
        self._limit = limit
        self._overflow = overflow
        self._stopped = stopped
        self.paused = False
        self.overflowed = False
        self.queued = 0
        self._queue: list[bytes] = []

    def send(self, data: bytes) -> None:
        if self.overflowed:
            return
        if not self.paused:
            self._write(data)
            return
        self._queue.append(data)
        self.queued += len(data)
        if self.queued > self._limit:
            self.overflowed = True
            self._queue, self.queued = [], 0
            self._overflow()

    def flush(self) -> None:
        """Write what waits, paused or not (the response ends next)."""
        queue, self._queue, self.queued = self._queue, [], 0
        for data in queue:
            self._write(data)

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        queue, self._queue, self.queued = self._queue, [], 0
        for data in queue:
            self.send(data)

    def stopProducing(self) -> None:
        self._stopped()
