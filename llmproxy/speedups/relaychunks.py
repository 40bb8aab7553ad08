"""The relay of the `engine_client` speedup (see speedups/engineclient.py):
each read's data framed as one chunk and sent now, and the headers that pass
each way copied straight into Twisted's `Headers` storage.

`ChunkRelay` is web.relay's `Relay`, sending a chunked response under way
itself: the engine connection hands it the data of each read in one piece (its
framing decoded by the parser, never copied), and the relay frames it as one
chunk of its own and sends it now (socketwrites), counted in the request's
`sentLength` as Twisted 26.10's Request.write counts it (the guard compares
that method's source). The request's extra (`stream_transport`:
speedups.responsewrites' SendingRequest) is duck-typed: with any other request
the relay writes as the plain one does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.web.http_headers import Headers

from llmproxy.observe.inflight import Exchange
from llmproxy.speedups import Selection
from llmproxy.speedups.socketwrites import send_now
from llmproxy.web.relay import (
    ACCEPT_ENCODING,
    HOP_BY_HOP,
    NOT_UPSTREAM,
    TAIL_SLACK,
    USAGE_TAIL,
    Relay,
    named_by_connection,
    proxy_owned,
)
from llmproxy.web.site import ProxyRequest

_NONE: frozenset[bytes] = frozenset()


# Headers copied here go straight into Twisted's dict (`Headers._rawHeaders`):
# every name in it is canonical and no value holds a CR or LF, as whoever put
# it there left it (Twisted's request parser and its Headers, the request head
# speedup; engineconnection refuses an engine head with one, see
# web.enginehead), so going through setRawHeaders again (encode and sanitize
# each) would only cost time. What comes out is web.relay's functions' own,
# the headers an engine's Connection header names dropped too (RFC 9110 §7.6.1).
def raw_request_headers(incoming: Headers, client_ip: str,
                        request_id: str | None = None) -> Headers:
    """web.relay.upstream_request_headers, on the raw dict."""
    raw = incoming._rawHeaders
    connection = raw.get(b"Connection")
    named = named_by_connection(connection) if connection else _NONE
    out = {}
    for name, values in raw.items():
        lower = name.lower()
        if lower not in NOT_UPSTREAM and lower not in named:
            out[name] = list(values)
    forwarded = raw.get(b"X-Forwarded-For")
    chain = [v.strip() for v in forwarded if v.strip()] if forwarded else []
    out[b"X-Forwarded-For"] = [b", ".join([*chain, client_ip.encode()])]
    out[b"Accept-Encoding"] = list(ACCEPT_ENCODING)
    if request_id is not None:
        out[b"X-Request-Id"] = [request_id.encode()]
    headers = Headers()
    headers._rawHeaders = out
    return headers


def raw_response_headers(upstream: Headers, length: object, out: Headers,
                         streaming: bool) -> None:
    """web.relay.client_response_headers, on the raw dicts."""
    raw, into = upstream._rawHeaders, out._rawHeaders
    named = named_by_connection(raw.get(b"Connection"))
    for name, values in raw.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in named or proxy_owned(lower) or (
                lower == b"content-encoding" and not any(v.strip() for v in values)):
            continue
        into[name] = [*into.pop(b"Vary", ()), *values] if lower == b"vary" else list(values)
    if isinstance(length, int) and not isinstance(length, bool):
        into[b"Content-Length"] = [b"%d" % length]
    if streaming or b"".join(raw.get(b"Content-Type", ())).lower().startswith(
            b"text/event-stream"):
        into[b"X-Accel-Buffering"] = [b"no"]


def _no_transport() -> None:
    return None


class ChunkRelay(Relay):
    """A Relay that sends each piece of a chunked response under way itself,
    framed as one chunk, in one send. From the first such piece on, the engine
    connection hands each next one straight to `_send` (its body transport's
    `take_data`), until the client leaves."""

    request_headers = staticmethod(raw_request_headers)
    response_headers = staticmethod(raw_response_headers)

    def __init__(self, request: ProxyRequest, exchange: Exchange) -> None:
        super().__init__(request, exchange)
        # A SendingRequest says where a chunked response under way may be sent.
        self._stream_transport: Callable[[], Any] = getattr(
            request, "stream_transport", _no_transport)
        self._client: Any = None           # the client's transport, once under way
        self._take_data: Callable[[Callable[[bytes], None] | None], None] | None = None

    def connectionMade(self) -> None:
        super().connectionMade()
        self._take_data = getattr(self.transport, "take_data", None)

    def dataReceived(self, data: bytes) -> None:
        if self.client_gone:
            return
        if self._strip is not None:
            super().dataReceived(data)     # a stream it edits: written as the plain one
            return
        if self._client is None:
            client = self._stream_transport()
            if client is None:     # the head (sent with this), or not chunked: written
                super().dataReceived(data)
                return
            self._client = client
            if self._take_data is not None:
                self._take_data(self._send)
        self._send(data)

    def _send(self, data: bytes) -> None:
        """A piece of a chunked response under way (dataReceived found it so;
        the engine connection hands each next read's data here until `stop`):
        framed as one chunk and sent now, as SendingRequest.send_chunk sends
        (counted in the request's sentLength), counted in the record
        (Exchange.relayed, inline), its tokens timed (as Relay.dataReceived
        times them), fed to the capture's recording when there is one (as
        Relay._hold feeds it) and held for the tail (inline: once per event of
        a stream)."""
        size = len(data)
        if not size:
            return                 # (an empty chunk would end the response)
        if self.request.channel._gathering:
            super().dataReceived(data)          # in its turn, behind what is held
            return
        self.request.sentLength += size
        send_now(self._client, b"%x\r\n%b\r\n" % (size, data))
        exchange = self.exchange
        exchange.bytes_sent += size
        if self._streaming:
            events = data.count(b"data:")
            if events:
                exchange.events += events
                self._tokens.feed(data)
        head = self._head
        if head is not None and len(head) < USAGE_TAIL:
            self._head = head + data
        capture = self._capture
        if capture is not None:
            capture.feed(data)
        self._tail.append(data)
        self._held += size
        if self._held > USAGE_TAIL + TAIL_SLACK:
            self._trim()

    def stop(self) -> None:
        """The client is gone: what still comes goes to dataReceived, and no
        further; the upstream connection closes now."""
        self.client_gone = True
        if self._client is not None and self._take_data is not None:
            self._take_data(None)
        super().stop()


def relay_class(selection: Selection) -> type[Relay]:
    """The Relay a selection of speedups runs: ChunkRelay with `engine_client`
    (its engine connections hand over each read's data in one piece), else the
    plain one."""
    return ChunkRelay if selection.on("engine_client") else Relay
