"""An HTTP/2 stream made known to the site when its headers arrive, before any
of its body is read (web/streams.py then applies the door, the body limit and
the body timer to it), and a stream answered before the client's side ended
reset with NO_ERROR (RFC 9113 §8.1: the client stops sending its body).

Waits for a public hook in Twisted's HTTP/2 channel for a stream's headers
(Twisted 26.10 builds the request in the private twisted.web._http2 and tells
it nothing until its body is complete). Off, HTTP/2 is not offered at all (the
TLS listener speaks http/1.1 alone): without the hook a stream keeps its body
with no door and no timer until it ends (lifecycle/service.py).
"""

from __future__ import annotations

from contextlib import suppress
from functools import cache
from typing import Any

import twisted
from llmproxy.compat import Compat, changed_sources
from llmproxy.compat.goaway import VERSION, available

try:
    from h2.errors import ErrorCodes
    from h2.exceptions import ProtocolError
except ImportError:         # no h2: no HTTP/2 (goaway.available() says so)
    pass

# What the mixin rests on, as Twisted 26.10 has it.
SOURCES = {f"twisted.web._http2.{name}": digest for name, digest in {
    "H2Connection._requestReceived": "b701727a6ce4ca8d",
    "H2Connection._requestDataReceived": "46f9e234c59e1b27",
    "H2Connection._requestEnded": "4371a81e03de2bd6",
    "H2Connection._requestDone": "216905888bacc003",
    "H2Stream.__init__": "bc7615e38e185a16", "H2Stream._convertHeaders": "053b33cec564e0f9",
    "H2Stream.receiveDataChunk": "2d49222e44d9cfc2",
    "H2Stream.requestComplete": "d1cd5e1e140b9e30"}.items()}


def guard() -> str | None:
    """None when Twisted's HTTP/2 channel is the one this follows (26.10)."""
    if not available():
        return "h2 is not installed: the TLS listener offers http/1.1 alone"
    if not twisted.__version__.startswith(VERSION + "."):
        return f"Twisted {twisted.__version__} is not {VERSION}, whose HTTP/2 channel this follows"
    return changed_sources(SOURCES)


class StreamHooks:
    """Mixed into the HTTP/2 connection (before Twisted's class): tells its
    site `stream_opened(request, method, uri, body_follows)` once a stream's
    headers are in, and asks `stream_ending(request)` whether the end of its
    body dispatches it; a stream the site has let go (answered early, its
    request done) reads no more of the client's frames on it."""

    site: Any
    streams: dict[int, Any]
    conn: Any
    _stillProducing: bool

    def _requestReceived(self, event: Any) -> None:
        super()._requestReceived(event)  # type: ignore[misc]
        stream = self.streams.get(event.stream_id)
        if stream is None:      # refused from its headers alone (compat/h2limits.py's 431)
            return
        self.site.stream_opened(stream._request, stream.command, stream.path,
                                event.stream_ended is None)

    def _requestDataReceived(self, event: Any) -> None:
        if event.stream_id in self.streams:
            super()._requestDataReceived(event)  # type: ignore[misc]
        else:
            # Frames already read for a stream answered in this same read: they
            # still count against the connection's window, which is opened.
            with suppress(ProtocolError):
                self.conn.acknowledge_received_data(event.flow_controlled_length,
                                                    event.stream_id)

    def _requestEnded(self, event: Any) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None and self.site.stream_ending(stream._request):
            super()._requestEnded(event)  # type: ignore[misc]

    def _requestDone(self, streamID: int) -> None:
        super()._requestDone(streamID)  # type: ignore[misc]
        state = self.conn.streams.get(streamID)
        if self._stillProducing and state is not None and not state.closed:
            # Answered while the client still sends: it stops (no error).
            with suppress(ProtocolError):
                self.conn.reset_stream(streamID, ErrorCodes.NO_ERROR)
            self._tryToWriteControlData()  # type: ignore[attr-defined]


@cache
def hooked(base: type) -> type:
    """`base` (an HTTP/2 connection class) with the hooks."""
    return type(base.__name__, (StreamHooks, base), {"__doc__": base.__doc__})


COMPAT = Compat("h2_streams", "HTTP/2 streams judged from their headers: the door, the body "
                "limit and the body timer before the body is read",
                "a public hook in Twisted's HTTP/2 channel for a stream's headers",
                guard, None)
