"""An HTTP/2 stream's request while its body arrives, held to the rules an
HTTP/1.1 request's body is: judged when the stream's headers arrive
(llmproxy.compat.streamhooks tells the site), before any of its body is read.

- The door runs on the headers: a request it refuses (401, 403) is answered
  at once and its body never read.
- A Content-Length over `max_body_bytes` is answered 413 at once; a body whose
  running total crosses it is answered 413 where it crosses.
- `client_body_timeout_seconds` without a DATA frame: 408.
- An answer given before the client's side of the stream ended is followed by
  RST_STREAM(NO_ERROR) (the compat entry): the client stops sending, and the
  stream is gone.

A stream exists only once its headers are in, so HTTP/2 has no header timer:
the connection's idle timeout and the TLS handshake's bound cover a client
that sends none. A stream's body is kept in memory up to IN_MEMORY bytes and
only then spooled to a temporary file (Twisted opens one for every body of
unknown length), so a stream whose body is short, or has not come, holds no
file descriptor.
"""

from __future__ import annotations

from io import BytesIO
from tempfile import SpooledTemporaryFile
from typing import IO, Any, Protocol

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel

from llmproxy.web.access import Refusal
from llmproxy.web.requeststate import RequestState

IN_MEMORY = 1 << 20
HTTP2 = b"HTTP/2"


def body_file(length: int | None) -> IO[bytes]:
    """Where a request body is kept: in memory up to IN_MEMORY bytes, then in
    a temporary file (opened only once the body passes IN_MEMORY)."""
    if length is not None and length <= IN_MEMORY:
        return BytesIO()
    return SpooledTemporaryFile(IN_MEMORY)


class Door(Protocol):
    """The door's verdict from a request's headers alone (web/access.Access)."""

    def judge(self, request: Any, path: str) -> object:
        """A Refusal, or anything else to let it in."""


class StreamBody:
    """One HTTP/2 stream's request from its headers to the end of its body:
    its body timer, and its answer before the body's end (`answer_now`: the
    request is dispatched as if its body had ended, and reads no more of it)."""

    def __init__(self, request: StreamRequest, method: bytes, uri: bytes,
                 clock: IReactorTime, body_seconds: float) -> None:
        self._request, self._method, self._uri = request, method, uri
        self._clock, self.body_seconds = clock, body_seconds
        self._timer: IDelayedCall | None = None
        self.answered = False       # dispatched before its body ended
        self.received = False       # handed to the resource (once)

    def wait_for_body(self) -> None:
        self._timer = self._clock.callLater(self.body_seconds, self._timed_out)

    def data(self) -> None:
        """A DATA frame of the body: the timer starts again."""
        if self._timer is not None and self._timer.active():
            self._timer.reset(self.body_seconds)

    def stop(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def answer_now(self) -> None:
        """Answer without the rest of the body (once its read is off the stack)."""
        if self.answered or self.received:
            return
        self.answered = True
        self.stop()
        self._clock.callLater(0, self._dispatch)

    def ended(self) -> bool:
        """The client ended its side: whether Twisted's end of the request
        (its dispatch) goes ahead; not for a stream answered early."""
        if self.answered:
            return False
        self.received = True
        self.stop()
        return True

    def _dispatch(self) -> None:
        request = self._request
        if not (self.received or request.state.client_gone):
            self.received = True
            request.requestReceived(self._method, self._uri, HTTP2)  # type: ignore[attr-defined]

    def _timed_out(self) -> None:
        self._timer = None
        self._request.state.body_timeout = self.body_seconds
        self.answer_now()


class StreamBodyFile:
    """Mixed into the request (after the body limit's mixin, before Twisted's
    Request): on an HTTP/2 stream, its body kept in `body_file`; an HTTP/1.1
    request keeps Twisted's rule."""

    channel: Any
    content: Any

    def gotLength(self, length: int | None) -> None:
        if isinstance(self.channel, HTTPChannel):
            super().gotLength(length)  # type: ignore[misc]
        else:
            self.content = body_file(length)


class StreamRequest:
    """Mixed into the request (before the body limit's mixin): on an HTTP/2
    stream, its StreamBody hears of the body's chunks (and, from the site,
    of its end): its `state.stream_body`."""

    state: RequestState

    def handleContentChunk(self, data: bytes) -> None:
        stream = self.state.stream_body
        if stream is None:
            super().handleContentChunk(data)  # type: ignore[misc]
            return
        if stream.answered:
            return
        stream.data()
        super().handleContentChunk(data)  # type: ignore[misc]
        if self.state.body_too_large:
            stream.answer_now()

    def connectionLost(self, reason: Failure) -> None:
        stream = self.state.stream_body
        if stream is not None:
            stream.stop()
        super().connectionLost(reason)  # type: ignore[misc]


class Streams:
    """The site's rules for its HTTP/2 streams (see the module)."""

    def __init__(self, door: Door | None, clock: IReactorTime, body_seconds: float) -> None:
        self.door, self.clock, self.body_seconds = door, clock, body_seconds

    def opened(self, request: StreamRequest, method: bytes, uri: bytes,
               body_follows: bool) -> None:
        """A stream's headers are in (`request` built from them); `body_follows`:
        its client has not ended its side."""
        if not body_follows:
            return
        stream = request.state.stream_body = StreamBody(request, method, uri, self.clock,
                                                        self.body_seconds)
        path = uri.split(b"?", 1)[0].decode("latin-1")
        if request.state.body_too_large or (
                self.door is not None and isinstance(self.door.judge(request, path), Refusal)):
            stream.answer_now()
        else:
            stream.wait_for_body()

    @staticmethod
    def ending(request: StreamRequest) -> bool:
        """A stream's client ended its side: whether Twisted dispatches its request."""
        stream = request.state.stream_body
        return stream is None or stream.ended()
