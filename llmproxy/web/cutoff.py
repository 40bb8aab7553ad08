"""How the proxy cuts a client off, on HTTP/1.1 and on HTTP/2 alike: an
HTTP/1.1 request's channel is its connection; an HTTP/2 request's channel is
its stream (Twisted's, which has no transport of its own), so dropping it or
ending its body short resets that stream and leaves the connection's other
streams alone.

An HTTP/1.1 channel aborts a client that reads nothing for
`client_write_stall_seconds` (web/timers.py). On HTTP/2 the stream's flow
control pauses the engine instead, and an idle timeout never fires while a
stream is open, so `StallGuard` holds each HTTP/2 response to the same rule:
paused that long in a row, the stream is reset and the request ends as
client-stalled (its engine request cancelled, its lease released)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twisted.internet.error import ConnectionAborted
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.python.failure import Failure
from zope.interface import implementer

if TYPE_CHECKING:
    from llmproxy.web.site import ProxyRequest

HTTP2 = b"HTTP/2"


def on_http2(request: Any) -> bool:
    """Whether `request` came on an HTTP/2 stream (its channel is the stream,
    which has no transport of its own)."""
    return bool(request.clientproto == HTTP2)


def abort_client(request: ProxyRequest) -> None:
    """Drop the client now, never end its response cleanly: an HTTP/1.1
    connection is aborted; an HTTP/2 stream is reset (RST_STREAM), its
    connection's other streams untouched."""
    channel = request.channel
    if channel is None:
        return
    if not on_http2(request):
        channel.transport.abortConnection()
    elif not (request.finished or request.state.client_gone):
        channel.abortConnection()       # a stream already over has nothing to reset
        # Twisted tells a request of its stream's end only when the client
        # resets it, not when the server does: tell it here, as its stream
        # would (so notifyFinish fires and the engine's request is cancelled).
        # (Its channel is then None: a second call returns above.)
        request.connectionLost(Failure(ConnectionAborted("the proxy reset the stream")))


def cut_short(request: ProxyRequest) -> None:
    """End a response whose body is incomplete so the client sees it is: an
    HTTP/1.1 connection closes after what was written, without the last chunk;
    an HTTP/2 stream is reset (a clean end would read as a complete body)."""
    if on_http2(request):
        abort_client(request)
    elif request.channel is not None:
        request.channel.loseConnection()


@implementer(IPushProducer)
class StallGuard:
    """The engine's side of an HTTP/2 response as the stream's producer: paused
    by the stream's flow control for `seconds` in a row, `stalled()` is called
    once. Any resume (the client read something) starts the count again."""

    def __init__(self, producer: IPushProducer, clock: IReactorTime, seconds: float,
                 stalled: Callable[[], None]) -> None:
        self._producer = producer
        self._clock = clock
        self._seconds = seconds
        self._stalled = stalled
        self._timer: IDelayedCall | None = None

    def pauseProducing(self) -> None:
        if self._timer is None:
            self._timer = self._clock.callLater(self._seconds, self._fire)
        self._producer.pauseProducing()

    def resumeProducing(self) -> None:
        self._cancel()
        self._producer.resumeProducing()

    def stopProducing(self) -> None:
        self._cancel()
        self._producer.stopProducing()

    def _cancel(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self._stalled()


def response_producer(request: ProxyRequest, producer: IPushProducer) -> IPushProducer:
    """What a relay registers on `request` (dispatched: its site is a
    ProxySite) as its body's producer: the engine's transport itself on
    HTTP/1.1 (its channel has the stall timer), guarded by a StallGuard on HTTP/2."""
    if not on_http2(request):
        return producer
    site: Any = request.site
    seconds = float(site.timeouts.write_stall)

    def stalled() -> None:
        exchange = request.state.exchange
        if exchange is not None:
            exchange.stalled(seconds)
        abort_client(request)

    return StallGuard(producer, site.reactor, seconds, stalled)
