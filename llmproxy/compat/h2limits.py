"""HTTP/2 connections (Twisted's) that one client cannot use to exhaust the
proxy, or to make it log tracebacks.

Waits for a Twisted HTTP/2 channel (twisted.web._http2.H2Connection, private,
as of Twisted 26.10) that bounds what follows; no upstream ticket for these
was found (the nearest, twisted/twisted#12705, brought the `_terminate` of a
reset flood that this builds on). `BoundedH2Connection` changes:

- After a protocol error (or a reset flood) Twisted ends the connection with
  `loseConnection()`, which over TLS waits for the client's close_notify while
  the client may go on sending, and h2 buffers every byte. Here every byte
  after it is dropped, the connection is aborted if it is not gone
  CLOSE_SECONDS later, and the close is an `Http2Closed` event (one line).
- A stream whose next frame is data while its flow-control window is shut is
  blocked until a WINDOW_UPDATE or SETTINGS opens the window (Twisted picks it
  again on every turn of the reactor, sending nothing: a core per client).
  Shut for the client write-stall bound, it is reset, unless its request is
  still producing through a producer of its own (a relayed body, whose guard
  is web/cutoff.StallGuard): a finished answer the client never reads is
  bounded too.
- A stream the proxy resets (`abortRequest`: an engine that died mid-answer,
  a reader that stalls) is reset with INTERNAL_ERROR, never NO_ERROR, so no
  client reads a cut answer as whole.
- Request headers over the limits of an HTTP/1.1 head (the site's
  `refused_head`) are answered 431, the request never made.
- PRIORITY frames for more streams than Twisted's priority tree holds close
  the connection (ENHANCE_YOUR_CALM); DATA, END_STREAM or RST_STREAM for a
  stream already answered is ignored (its data acknowledged). Twisted raised.

When the guard fails, HTTP/2 is not offered at all (ALPN says http/1.1):
Twisted's channel alone is open to each of the above.
"""

from __future__ import annotations

from collections import deque
from contextlib import suppress
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionAborted
from twisted.python.failure import Failure

import twisted
from llmproxy.compat import Compat, changed_sources
from llmproxy.compat.goaway import GracefulH2Connection, TrackedH2Connection, available
from llmproxy.core.events import Http2Closed
from llmproxy.core.text import shown

END: Any = None
try:
    from h2.errors import ErrorCodes
    from h2.exceptions import StreamClosedError
    from priority import DeadlockError  # type: ignore[import-untyped]
    from priority.priority import PriorityError  # type: ignore[import-untyped]
    from twisted.web._http2 import _END_STREAM_SENTINEL as END
except ImportError:     # no h2: no HTTP/2 (goaway.available)
    pass

VERSION = "26.10"
CLOSE_SECONDS = 5.0     # for a connection ended on an error to be gone
# What BoundedH2Connection overrides, copies or rests on, as Twisted 26.10 has it.
SOURCES = {f"twisted.web._http2.{name}": digest for name, digest in {
    "H2Connection.dataReceived": "750829ca7cb270cd",
    "H2Connection._terminate": "bd1de5e20b977e09",
    "H2Connection._sendPrioritisedData": "962d5b59c8d38671",
    "H2Connection._requestReceived": "b701727a6ce4ca8d",
    "H2Connection._requestDataReceived": "46f9e234c59e1b27",
    "H2Connection._requestEnded": "4371a81e03de2bd6",
    "H2Connection._requestAborted": "a963b9d5e3f108d1",
    "H2Connection.abortRequest": "30190e545c439425",
    "H2Connection._requestDone": "216905888bacc003",
    "H2Connection._handleWindowUpdate": "167aa98e3c8ef72d",
    "H2Connection.writeDataToStream": "073b03004c5d6012",
    "H2Connection.endRequest": "12a4b4c2ddd303c6",
    "H2Connection.connectionLost": "97dc72d9a3630b21",
    "H2Stream.abortConnection": "783cb5fef0443675",
    "H2Stream.registerProducer": "b34061aced47c19c",
    "H2Stream.unregisterProducer": "02e9c60497fb0b07"}.items()}


def guard() -> str | None:
    """None when Twisted's HTTP/2 channel is the one this bounds (26.10)."""
    if not available():
        return "h2 is not installed: the TLS listener offers http/1.1 alone"
    if not twisted.__version__.startswith(VERSION + "."):
        return (f"Twisted {twisted.__version__} is not {VERSION}, whose HTTP/2 channel this "
                "bounds: HTTP/2 is not offered")
    changed = changed_sources(SOURCES)
    return None if changed is None else changed + ": HTTP/2 is not offered"


def described(reason: Failure) -> str:
    """A failure as one short line (h2's messages may quote the client)."""
    return f"{type(reason.value).__name__}: {shown(str(reason.value), 160)}"


class BoundedH2Connection(TrackedH2Connection):
    """Twisted's HTTP/2 connection, bounded (see the module)."""

    _sendingDeferred: Any       # Twisted's: the sending loop, waiting for a stream

    def __init__(self, reactor: Any, site: Any, publish: Any) -> None:
        super().__init__(reactor, site, publish)
        self.dropping = False       # ended: every byte from the client is dropped
        self._abort: Any = None
        self._shut: dict[int, Any] = {}     # streams blocked on a shut window: stall timers

    # -- the end of a connection ---------------------------------------------------
    def dataReceived(self, data: bytes) -> None:
        if self.dropping:
            return
        try:
            super().dataReceived(data)
        except PriorityError:       # more streams than the priority tree holds
            self.conn.close_connection(error_code=ErrorCodes.ENHANCE_YOUR_CALM)
            self._terminate(Failure())
            return
        if getattr(self.transport, "disconnecting", False):
            self._stop_reading(None)        # the client's GOAWAY: nothing more to read
        else:
            self._reopen()

    def _terminate(self, reason: Failure) -> None:
        self._stop_reading(described(reason))
        super()._terminate(reason)

    def _stop_reading(self, why: str | None) -> None:
        if self.dropping:
            return
        self.dropping = True
        if why is not None:
            self.publish(Http2Closed(self.clock.seconds(), self.peer(), why))
        self._abort = self.clock.callLater(CLOSE_SECONDS, self.transport.abortConnection)

    def connectionLost(self, reason: Any, _cancelTimeouts: bool = True) -> None:
        if _cancelTimeouts:     # the transport is gone (not Twisted's own call)
            self.dropping = True
            if self._abort is not None and self._abort.active():
                self._abort.cancel()
        super().connectionLost(reason, _cancelTimeouts)

    # -- sending: a shut window blocks its stream ----------------------------------
    def _sendPrioritisedData(self, *args: Any) -> None:
        # Twisted 26.10's loop, but a stream picked with data to send and no
        # window is blocked (`_shut_window`) and the next one picked, where
        # Twisted sent nothing and picked it again on the next turn.
        if not self._stillProducing:
            return
        while True:
            try:
                stream = next(self.priority)
            except DeadlockError:       # all blocked: woken by new data or a window
                assert self._sendingDeferred is None
                self._sendingDeferred = Deferred()
                self._sendingDeferred.addCallback(self._sendPrioritisedData)
                return
            queue: deque[Any] = self._outboundStreamQueues[stream]
            while queue and queue[0] is not END and not queue[0]:
                queue.popleft()         # an empty write: no frame
            if not queue:
                self.priority.block(stream)
                continue
            window = self.conn.local_flow_control_window(stream)
            if window > 0 or queue[0] is END:
                break
            self._shut_window(stream)
        if self._consumerBlocked is not None:
            self._consumerBlocked.addCallback(self._sendPrioritisedData)
            return
        self.resetTimeout()
        frame = queue.popleft()
        if frame is END:
            self.conn.end_stream(stream)
            self.transport.write(self.conn.data_to_send())
            self._requestDone(stream)
        else:
            size = min(self.conn.max_outbound_frame_size, window)
            if len(frame) > size:
                queue.appendleft(frame[size:])
                frame = frame[:size]
            self.conn.send_data(stream, frame)
            self.transport.write(self.conn.data_to_send())
            if not queue:
                self.priority.block(stream)
            if self.remainingOutboundWindow(stream) <= 0:
                self.streams[stream].flowControlBlocked()
        self._reactor.callLater(0, self._sendPrioritisedData)

    def _shut_window(self, stream: int) -> None:
        self.priority.block(stream)
        if stream not in self._shut:
            self._shut[stream] = self.clock.callLater(
                self.site.timeouts.write_stall, self._stalled, stream)

    def _reopen(self) -> None:
        """After a read: the streams whose window the client opened are sent again."""
        opened = False
        for stream in list(self._shut):
            if self.conn.local_flow_control_window(stream) > 0:
                self._forget(stream)
                self.priority.unblock(stream)
                opened = True
        if opened and self._sendingDeferred is not None:
            waiting, self._sendingDeferred = self._sendingDeferred, None
            waiting.callback(None)

    def _forget(self, stream: int) -> None:
        call = self._shut.pop(stream, None)
        if call is not None and call.active():
            call.cancel()

    def _stalled(self, stream: int) -> None:
        self._shut.pop(stream, None)
        seconds = self.site.timeouts.write_stall
        h2stream = self.streams.get(stream)
        if h2stream is None:
            return
        queue = self._outboundStreamQueues[stream]
        if h2stream.producer is not None and not (queue and queue[-1] is END):
            # Its request still produces: the producer's own guard rules.
            self._shut[stream] = self.clock.callLater(seconds, self._stalled, stream)
            return
        why = f"its client read nothing of it for {seconds:g}s"
        self.publish(Http2Closed(self.clock.seconds(), self.peer(), why, stream))
        h2stream.connectionLost(Failure(ConnectionAborted(why)))
        self.abortRequest(stream)

    def _requestDone(self, streamID: int) -> None:
        self._forget(streamID)
        super()._requestDone(streamID)

    def abortRequest(self, streamID: int) -> None:
        # Twisted 26.10's, with INTERNAL_ERROR: its NO_ERROR made a cut answer look whole.
        with suppress(StreamClosedError):
            self.conn.reset_stream(streamID, ErrorCodes.INTERNAL_ERROR)
        if self._tryToWriteControlData() and streamID in self.streams:
            self._requestDone(streamID)

    # -- what the client sends ------------------------------------------------------
    def _requestReceived(self, event: Any) -> None:
        refused = getattr(self.site, "refused_head", None)
        body = refused(event.headers) if refused is not None else None
        if body is None:
            super()._requestReceived(event)
            return
        stream = event.stream_id
        self.conn.send_headers(stream, [(b":status", b"431"),
                                        (b"content-type", b"application/json")])
        if self.conn.local_flow_control_window(stream) >= len(body):
            self.conn.send_data(stream, body, end_stream=True)
        else:
            self.conn.end_stream(stream)
        if event.stream_ended is None:      # answered: the client may stop sending
            self.conn.reset_stream(stream, ErrorCodes.NO_ERROR)
        self._tryToWriteControlData()

    def _requestDataReceived(self, event: Any) -> None:
        if event.stream_id in self.streams:
            super()._requestDataReceived(event)
        else:       # already answered: the data is dropped, its window given back
            self.openStreamWindow(event.stream_id, event.flow_controlled_length)

    def _requestEnded(self, event: Any) -> None:
        if event.stream_id in self.streams:
            super()._requestEnded(event)

    def _requestAborted(self, event: Any) -> None:
        if event.stream_id in self.streams:
            super()._requestAborted(event)


class BoundedGracefulH2Connection(BoundedH2Connection, GracefulH2Connection):
    """Bounded, and drained with the two-phase GOAWAY (compat/goaway.py)."""


def connection_class(graceful: bool) -> type | None:
    """The HTTP/2 connection class (drained gracefully or not); None without h2."""
    if not available():
        return None
    return BoundedGracefulH2Connection if graceful else BoundedH2Connection


COMPAT = Compat("h2_limits", "HTTP/2 offered, with Twisted's connection bounded against one "
                "client (no buffering after an error, no spin on a shut window, INTERNAL_ERROR "
                "for a cut stream, the HTTP/1.1 header limits)",
                "a Twisted HTTP/2 channel bounded against one client", guard, None)
