"""The start of an engine's error answer, read within bounds: what the proxy tells a client
whose stream had already begun when the engine answered with another status than 200
(web/forward.py puts it in the stream's error event).

An engine is not trusted to keep its error short or to finish it: `error_text` keeps at most
`limit` bytes, closes the engine connection once it has them, and gives up after `timeout`
seconds, with what came by then. It never fails: a body that ends in failure gives what came
before. (Twisted's `readBody` keeps a body whole, and warns on the body transport of Twisted's
own client, which has no `abortConnection`.)"""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure

ERROR_LIMIT = 4096        # bytes of an error answer kept
ERROR_TIMEOUT = 10.0      # seconds an error answer may take


class _Head(Protocol):
    def __init__(self, limit: int, done: Deferred[bytes]) -> None:
        self.limit, self.done = limit, done
        self.pieces: list[bytes] = []
        self.held = 0

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        self.pieces.append(data[:self.limit - self.held])
        self.held += len(self.pieces[-1])
        if self.held >= self.limit:
            self.done.callback(b"".join(self.pieces))
            self.stop()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if not self.done.called:
            self.done.callback(b"".join(self.pieces))

    def stop(self) -> None:
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()


def error_text(response: Any, clock: IReactorTime, limit: int = ERROR_LIMIT,
               timeout: float = ERROR_TIMEOUT) -> Deferred[bytes]:
    """At most `limit` bytes of `response`'s body: as soon as they are in, when the body ends,
    or after `timeout` seconds (the connection then closed), whichever comes first."""
    done: Deferred[bytes] = Deferred()
    head = _Head(limit, done)
    response.deliverBody(head)
    if not done.called:
        def late() -> None:
            if not done.called:
                done.callback(b"".join(head.pieces))
                head.stop()
        timer = clock.callLater(timeout, late)

        def settled(text: bytes) -> bytes:
            if timer.active():
                timer.cancel()
            return text
        done.addCallback(settled)
    return done
