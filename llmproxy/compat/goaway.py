"""HTTP/2 connections (Twisted's own, by ALPN on the TLS listener), drained with
a two-phase GOAWAY.

Waits for a public HTTP/2 channel in Twisted with a graceful shutdown (its
H2Connection lives in the private twisted.web._http2, as of Twisted 26.10, and
sends a GOAWAY only when it times a connection out). At a stop or an upgrade's
hand-over, `GracefulH2Connection.start_draining` sends a GOAWAY with the last
stream id 2^31-1 (the client opens no new stream) and a PING; on its ack (one
round trip: a stream the client opened before it saw the GOAWAY has arrived),
or after ROUND_TRIP_CAP seconds, a GOAWAY with the real last stream id. Streams
up to that id are served to their end (a stream opened between the two is
served too); a stream past it is refused; the connection closes when its last
stream ends. Both GOAWAYs are frames of our own: h2's `close_connection` would
close its state machine, and no frame of the streams in flight could follow.

Off (the guard names what changed), HTTP/2 is still served by Twisted's class,
known to the site (`TrackedH2Connection`), and a stop sends one GOAWAY, as
Twisted does when it times a connection out, once no request is in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from typing import Any

import twisted
from llmproxy.compat import Compat, changed_sources
from llmproxy.core.events import Http2Goaway

H2Connection: Any = None    # Twisted's HTTP/2 channel, and h2's connection state
H2State: Any = None
try:
    import h2.connection
    from h2.errors import ErrorCodes
    from h2.events import PingAckReceived, RequestReceived
    from h2.exceptions import StreamClosedError
    from hyperframe.frame import GoAwayFrame
    from twisted.web import _http2
except ImportError:         # no h2: the listener offers http/1.1 alone
    pass
else:
    H2Connection, H2State = _http2.H2Connection, h2.connection.H2Connection

VERSION = "26.10"
MAX_STREAM_ID = 2**31 - 1
ROUND_TRIP_CAP = 1.0
PING = b"llmproxy"
# What the subclasses rest on or call, as Twisted 26.10 has it.
SOURCES = {f"twisted.web._http2.H2Connection.{name}": digest for name, digest in {
    "__init__": "0cd6ee4ac041f47f", "connectionMade": "e0dd035e182bcf96",
    "dataReceived": "750829ca7cb270cd", "connectionLost": "97dc72d9a3630b21",
    "_requestDone": "216905888bacc003", "_tryToWriteControlData": "3a3de23d3f4f75de",
    "_sendPrioritisedData": "962d5b59c8d38671", "abortRequest": "30190e545c439425",
    "_requestAborted": "a963b9d5e3f108d1"}.items()}


def available() -> bool:
    """Whether HTTP/2 can be offered at all (h2 and Twisted's channel importable)."""
    return H2Connection is not None


def guard() -> str | None:
    """None when Twisted's HTTP/2 channel is the one this follows (26.10)."""
    if H2Connection is None:
        return "h2 is not installed: the TLS listener offers http/1.1 alone"
    if not twisted.__version__.startswith(VERSION + "."):
        return f"Twisted {twisted.__version__} is not {VERSION}, whose HTTP/2 channel this follows"
    return changed_sources(SOURCES)


class DrainingState(H2State if H2Connection else object):  # type: ignore[misc]
    """h2's connection state, which also sends GOAWAYs that leave it open, tells
    `acked` of a PING's ack, and refuses the streams past `refuse_above`."""

    refuse_above: int | None = None
    frames: tuple[bytes, ...] = ()      # our GOAWAYs, sent after what h2 has queued
    acked: Callable[[bytes], None] = staticmethod(lambda data: None)

    def goaway(self, last_stream_id: int) -> None:
        self.frames += (GoAwayFrame(0, last_stream_id=last_stream_id,
                                    error_code=ErrorCodes.NO_ERROR).serialize(),)

    def data_to_send(self, amount: int | None = None) -> bytes:
        data: bytes = super().data_to_send(amount)
        if amount is None and self.frames:
            data, self.frames = data + b"".join(self.frames), ()
        return data

    def receive_data(self, data: bytes) -> list[Any]:
        events: list[Any] = super().receive_data(data)
        for event in events:
            if isinstance(event, PingAckReceived):
                self.acked(event.ping_data)
        last = self.refuse_above
        if last is None:
            return events
        kept = []
        for event in events:
            stream = getattr(event, "stream_id", None)
            if not stream or stream <= last:
                kept.append(event)
            elif isinstance(event, RequestReceived):
                with suppress(StreamClosedError):
                    self.reset_stream(stream, ErrorCodes.REFUSED_STREAM)
        return kept


class TrackedH2Connection(H2Connection if H2Connection else object):  # type: ignore[misc]
    """Twisted's HTTP/2 connection for `site`, known to it (so a stop finds
    it), on the injected reactor, idle for at most the site's idle timeout."""

    drain_phase: str | None = None
    finished = False        # done with its streams after its last GOAWAY: closing

    def __init__(self, reactor: Any, site: Any, publish: Callable[[Any], None]) -> None:
        super().__init__(reactor)
        self.site, self.requestFactory, self.factory = site, site.requestFactory, site
        self.timeOut, self.callLater = site.timeouts.idle, reactor.callLater
        self.publish, self.clock = publish, reactor

    def peer(self) -> str:
        address = self.transport.getPeer()
        return f"{getattr(address, 'host', address)}:{getattr(address, 'port', '')}"

    def connectionMade(self) -> None:
        super().connectionMade()
        self.site.multiplexed_opened(self)

    def connectionLost(self, reason: Any, _cancelTimeouts: bool = True) -> None:
        self.drain_phase, self.finished = "closed", True
        super().connectionLost(reason, _cancelTimeouts)
        self.site.multiplexed_closed(self)

    def timeoutConnection(self) -> None:
        if not self.streams:        # a stream waiting for its engine is not idle
            super().timeoutConnection()
        else:
            self.resetTimeout()

    def start_draining(self) -> None:
        """A stop begins: nothing to say yet (see close_when_idle)."""
        self.drain_phase = self.drain_phase or "waiting"

    def close_when_idle(self) -> None:
        """No request is in flight: one GOAWAY, Twisted's own, and the close."""
        if self.drain_phase == "waiting":
            self.drain_phase = "single"
            self.publish(Http2Goaway(self.clock.seconds(), "single", self.peer(),
                                     reason=guard() or "the guard failed"))
            super().timeoutConnection()
            self.finished = True
            self.site.channel_changed()


class GracefulH2Connection(TrackedH2Connection):
    """The two-phase GOAWAY (see the module)."""

    conn: Any

    def __init__(self, reactor: Any, site: Any, publish: Callable[[Any], None]) -> None:
        super().__init__(reactor, site, publish)
        self.conn = DrainingState(config=self.conn.config)
        self.conn.acked = self._acked
        self._final: Any = None

    def start_draining(self) -> None:
        if self.drain_phase is not None:
            return
        self.drain_phase = "first"
        self.conn.goaway(MAX_STREAM_ID)
        self._tryToWriteControlData()
        self.conn.ping(PING)            # after the GOAWAY: its ack says the client read it
        self._tryToWriteControlData()
        self._final = self.clock.callLater(ROUND_TRIP_CAP, self.final_goaway,
                                           f"{ROUND_TRIP_CAP:g}s without the PING's ack")
        self.publish(Http2Goaway(self.clock.seconds(), "first", self.peer(), MAX_STREAM_ID,
                                 len(self.streams)))

    def _acked(self, data: bytes) -> None:
        if data == PING and self.drain_phase == "first":
            # Next turn: the streams of this read are the connection's by then.
            self.clock.callLater(0, self.final_goaway, "the PING's ack")

    def final_goaway(self, why: str) -> None:
        if self.drain_phase != "first":
            return
        if self._final is not None and self._final.active():
            self._final.cancel()
        self.drain_phase = "final"
        last = self.conn.refuse_above = self.conn.highest_inbound_stream_id
        self.conn.goaway(last)
        self._tryToWriteControlData()
        self.publish(Http2Goaway(self.clock.seconds(), "final", self.peer(), last,
                                 len(self.streams), why))
        self._close_if_done()

    def close_when_idle(self) -> None:
        """It closes itself once its last stream ends."""

    def _requestDone(self, streamID: int) -> None:
        super()._requestDone(streamID)
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self.drain_phase == "final" and not self.streams:
            self.drain_phase, self.finished = "closing", True
            self.publish(Http2Goaway(self.clock.seconds(), "closed", self.peer()))
            self.transport.loseConnection()
            self.site.channel_changed()


def connection_class(on: bool) -> Callable[[Any, Any, Callable[[Any], None]], Any] | None:
    """The HTTP/2 connection class: graceful when the entry is on; None without h2."""
    if H2Connection is None:
        return None
    return GracefulH2Connection if on else TrackedH2Connection


COMPAT = Compat("h2_goaway", "HTTP/2 drained with a two-phase GOAWAY at a stop or an upgrade",
                "a public HTTP/2 channel with a graceful shutdown in Twisted", guard, None)
