"""How the proxy cuts a client off, on HTTP/1.1 and on HTTP/2 alike: an
HTTP/1.1 request's channel is its connection; an HTTP/2 request's channel is
its stream (Twisted's, which has no transport of its own), so dropping it or
ending its body short resets that stream and leaves the connection's other
streams alone."""

from __future__ import annotations

from typing import Any

HTTP2 = b"HTTP/2"


def on_http2(request: Any) -> bool:
    """Whether `request` came on an HTTP/2 stream (its channel is the stream,
    which has no transport of its own)."""
    return bool(request.clientproto == HTTP2)


def abort_client(request: Any) -> None:
    """Drop the client now, never end its response cleanly: an HTTP/1.1
    connection is aborted; an HTTP/2 stream is reset (RST_STREAM), its
    connection's other streams untouched."""
    channel = request.channel
    if channel is None:
        return
    if not on_http2(request):
        channel.transport.abortConnection()
    elif not (request.finished or getattr(request, "client_gone", False)):
        channel.abortConnection()       # a stream already over has nothing to reset


def cut_short(request: Any) -> None:
    """End a response whose body is incomplete so the client sees it is: an
    HTTP/1.1 connection closes after what was written, without the last chunk;
    an HTTP/2 stream is reset (a clean end would read as a complete body)."""
    if on_http2(request):
        abort_client(request)
    elif request.channel is not None:
        request.channel.loseConnection()
