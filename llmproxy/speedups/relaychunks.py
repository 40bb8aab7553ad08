"""The relay of the `engine_client` speedup (see speedups/engineclient.py):
a stream's chunks passed through as the engine framed them, and the headers
that pass each way copied straight into Twisted's `Headers` storage.

`ChunkRelay` is web.relay's `Relay` with one more way in: whole chunks as the
engine framed them (`chunkReceived`, from engineconnection). While the client's
response is chunked too and under way, a chunk goes out as it came, neither
decoded nor framed again, sent now (socketwrites), counted in the request's
`sentLength` as Twisted 26.10's Request.write counts it (the guard compares
that method's source). The request's extras (`send_piece`, `stream_transport`,
`start_chunks`: speedups.responsewrites' SendingRequest) are duck-typed: with
any other request the relay writes as the plain one does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.web.http_headers import Headers
from twisted.web.server import Request

from llmproxy.observe.inflight import Exchange
from llmproxy.speedups import Selection
from llmproxy.speedups.enginemessage import unframe
from llmproxy.speedups.socketwrites import send_now
from llmproxy.web.relay import (
    HOP_BY_HOP,
    NOT_UPSTREAM,
    TAIL_SLACK,
    USAGE_TAIL,
    Relay,
    named_by_connection,
)

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
        if lower in HOP_BY_HOP or lower in named or (
                lower == b"content-encoding" and not any(v.strip() for v in values)):
            continue
        into[name] = list(values)
    if isinstance(length, int) and not isinstance(length, bool):
        into[b"Content-Length"] = [b"%d" % length]
    if streaming or b"".join(raw.get(b"Content-Type", ())).lower().startswith(
            b"text/event-stream"):
        into[b"X-Accel-Buffering"] = [b"no"]


def _not_a_piece(data: bytes) -> bool:
    return False


def _no_transport() -> None:
    return None


def _no_start(framed: bytes, size: int) -> bool:
    return False


class ChunkRelay(Relay):
    """A Relay that also takes a stream's usual piece as the engine framed it,
    one whole chunk (`chunkReceived`): while the client's response is chunked
    too and under way, it goes out as it came. From the first such chunk on,
    the engine connection hands each next one straight to `_next_chunk` (its
    body transport's `take_chunks`), until the client leaves. Held pieces may
    be framed chunks: `_payload` reads their data."""

    request_headers = staticmethod(raw_request_headers)
    response_headers = staticmethod(raw_response_headers)

    def __init__(self, request: Request, exchange: Exchange) -> None:
        super().__init__(request, exchange)
        # A SendingRequest sends a stream's next piece straight away.
        self._send_piece: Callable[[bytes], bool] = getattr(
            request, "send_piece", _not_a_piece)
        self._stream_transport: Callable[[], Any] = getattr(
            request, "stream_transport", _no_transport)
        self._start_chunks: Callable[[bytes, int], bool] = getattr(
            request, "start_chunks", _no_start)
        self._client: Any = None           # the client's transport, once under way
        self._take_chunks: Callable[[Callable[[bytes, int], None] | None], None] | None = None

    def connectionMade(self) -> None:
        super().connectionMade()
        self._take_chunks = getattr(self.transport, "take_chunks", None)

    def dataReceived(self, data: bytes) -> None:
        if self.client_gone:
            return
        events = data.count(b"data:") if self._streaming else 0
        size = len(data)
        if self._send_piece(data):             # the usual: a stream's next event
            self.exchange.relayed(size, events)
        else:
            self.request.write(data)           # counted by the request
            if events:
                self.exchange.relayed_events(events)
        self._hold(data, size)

    @staticmethod
    def _payload(piece: bytes, size: int) -> bytes:
        """A held piece's `size` bytes of data: chunks as the engine framed them
        (longer than their data), or plain data."""
        return piece if len(piece) == size else unframe(piece, size)

    def chunkReceived(self, framed: bytes, size: int) -> None:
        """Whole chunks of the body as the engine framed them (one, usually;
        `size` bytes of data in all)."""
        if self.client_gone:
            return
        client = self._stream_transport()
        if client is None:
            if self._start_chunks(framed, size):   # the head and these, in one send
                if self._streaming:
                    self.exchange.relayed_events(framed.count(b"data:"))
                self._hold(framed, size)
            else:              # a head of another kind, or the channel holds writes
                self.dataReceived(unframe(framed, size))
            return
        if self._client is None:
            self._client = client
            if self._take_chunks is not None:
                self._take_chunks(self._next_chunk)
        self._next_chunk(framed, size)

    def _next_chunk(self, framed: bytes, size: int) -> None:
        """Whole chunks of a response under way (chunkReceived found it so; the
        engine connection hands each next read of them here until `stop`):
        sent as they came, as `send_chunk` sends them (counted in the request's
        sentLength), counted in the record (Exchange.relayed, inline) and held
        for the tail (inline: once per event of a stream)."""
        if self.request.channel._gathering:     # type: ignore[attr-defined]
            self.dataReceived(unframe(framed, size))    # in its turn, behind what is held
            return
        self.request.sentLength += size
        send_now(self._client, framed)
        exchange = self.exchange
        exchange.bytes_sent += size
        if self._streaming:
            exchange.events += framed.count(b"data:")
        self._tail.append(framed)
        self._sizes.append(size)
        self._held += size
        if self._held > USAGE_TAIL + TAIL_SLACK:
            self._trim()

    def stop(self) -> None:
        """The client is gone: what still comes goes to chunkReceived, and no
        further; the upstream connection closes now."""
        self.client_gone = True
        if self._client is not None and self._take_chunks is not None:
            self._take_chunks(None)
        super().stop()


def relay_class(selection: Selection) -> type[Relay]:
    """The Relay a selection of speedups runs: ChunkRelay with `engine_client`
    (its engine connections hand over framed chunks), else the plain one."""
    return ChunkRelay if selection.on("engine_client") else Relay
