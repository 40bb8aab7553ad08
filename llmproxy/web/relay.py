"""Relaying an engine's answer to the client: the headers that pass each way, the
body written as it arrives under backpressure, and the visible end of a stream
that cannot finish (never a made-up clean end)."""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Callable
from itertools import accumulate
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from llmproxy.core.failures import describe
from llmproxy.observe.requests import CLIENT_GONE, COMPLETED, UPSTREAM_FAILED, Exchange
from llmproxy.web import anthropic
from llmproxy.web.h1message import unframe
from llmproxy.web.sendnow import send_now

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"proxy-connection", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})


def _named(values: list[bytes] | None) -> set[bytes]:
    """The headers a Connection header names (hop-by-hop too), lower case."""
    if not values:
        return set()
    return {token.strip().lower() for value in values for token in value.split(b",")
            if token.strip()}


# Headers copied here go straight into Twisted's dict (`Headers._rawHeaders`):
# every name in it is canonical and every value sanitized (no CR or LF) by
# whoever put it there (Twisted's request parser, headfast, h1client), so going
# through setRawHeaders again (encode and sanitize each) would only cost time.
_NOT_UP = HOP_BY_HOP | {b"host", b"content-length", b"x-forwarded-for"}
_NONE: frozenset[bytes] = frozenset()


def upstream_request_headers(incoming: Headers, client_ip: str,
                             request_id: str | None = None) -> Headers:
    """The headers to send upstream: end-to-end ones, plus X-Forwarded-For
    (and X-Request-Id, when given)."""
    raw = incoming._rawHeaders
    connection = raw.get(b"Connection")
    named = _named(connection) if connection else _NONE
    out = {}
    for name, values in raw.items():
        lower = name.lower()
        if lower not in _NOT_UP and lower not in named:
            out[name] = list(values)
    forwarded = raw.get(b"X-Forwarded-For")
    chain = [v.strip() for v in forwarded if v.strip()] if forwarded else []
    out[b"X-Forwarded-For"] = [b", ".join([*chain, client_ip.encode()])]
    if request_id is not None:
        out[b"X-Request-Id"] = [request_id.encode()]
    headers = Headers()
    headers._rawHeaders = out
    return headers


def client_response_headers(upstream: Headers, length: object, out: Headers,
                            streaming: bool) -> None:
    """Set the upstream's response headers on `out` (the client's response),
    minus hop-by-hop ones, plus its length; a stream says so to buffering proxies.

    The client keeps Content-Length out of `headers` (it is in `length`); an
    empty Content-Encoding may not reach the client.
    """
    raw, into = upstream._rawHeaders, out._rawHeaders
    named = _named(raw.get(b"Connection"))
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


USAGE_TAIL = 16 * 1024   # engines report `usage` at the end of a body or stream
TAIL_SLACK = 4 * 1024    # held beyond USAGE_TAIL before the tail is trimmed


def find_usage(tail: bytes) -> tuple[int | None, int | None] | None:
    """(prompt, completion) tokens of the last `"usage": {...}` in `tail`, if any
    (OpenAI's prompt/completion_tokens, Anthropic's input/output_tokens)."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    rest = tail[at + len(b'"usage"'):].lstrip()
    if not rest.startswith(b":") or not rest[1:].lstrip().startswith(b"{"):
        return None
    text = rest[1:].lstrip().decode("utf-8", "replace")
    try:
        usage, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None

    def count(*keys: str) -> int | None:
        for key in keys:
            value = usage.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
        return None

    found = count("prompt_tokens", "input_tokens"), count("completion_tokens", "output_tokens")
    return None if found == (None, None) else found


def _not_a_piece(data: bytes) -> bool:
    return False


def _no_transport() -> None:
    return None


def _no_start(framed: bytes, size: int) -> bool:
    return False


def _payload(piece: bytes, size: int) -> bytes:
    """A held piece's `size` bytes of data: chunks as the engine framed them
    (longer than their data), or plain data."""
    return piece if len(piece) == size else unframe(piece, size)


class Relay(Protocol):
    """Writes an upstream body to the client as it arrives; `ended` fires with
    (outcome, detail) once the body is over one way or another. It keeps the
    body's last USAGE_TAIL bytes to find the engine's `usage` at the end, and
    counts the events of a stream; nothing else of the body is held.

    A stream's usual piece comes as the engine framed it, one whole chunk
    (`chunkReceived`): while the client's response is chunked too and under
    way, it goes out as it came, neither decoded nor framed again. From the
    first such chunk on, the engine connection hands each next one straight to
    `_next_chunk` (its body transport's `take_chunks`), until the client leaves."""

    def __init__(self, request: Request, exchange: Exchange) -> None:
        self.request = request
        self.exchange = exchange
        self.client_gone = False
        self.ended: Deferred[tuple[str, str | None]] = Deferred()
        # The last pieces, at least USAGE_TAIL bytes of data, and beside each
        # its data's size (as _payload reads them; a list of ints where a tuple
        # per piece would cost 56 bytes more).
        self._tail: list[bytes] = []
        self._sizes: list[int] = []
        self._held = 0
        self._streaming = exchange.streaming
        # A SendingRequest sends a stream's next piece straight away (writes.py).
        self._send_piece: Callable[[bytes], bool] = getattr(
            request, "send_piece", _not_a_piece)
        self._stream_transport: Callable[[], Any] = getattr(
            request, "stream_transport", _no_transport)
        self._start_chunks: Callable[[bytes, int], bool] = getattr(
            request, "start_chunks", _no_start)
        self._client: Any = None           # the client's transport, once under way
        self._take_chunks: Callable[[Callable[[bytes, int], None] | None], None] | None = None

    def connectionMade(self) -> None:
        # Backpressure: while the client's socket is full, the upstream is paused.
        self.request.registerProducer(self.transport, True)
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

    def _hold(self, piece: bytes, size: int) -> None:
        """`piece` (`size` bytes of data) held for the tail (inline in _next_chunk)."""
        self._tail.append(piece)
        self._sizes.append(size)
        self._held += size
        if self._held > USAGE_TAIL + TAIL_SLACK:
            self._trim()

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

    def _trim(self) -> None:
        """Keep only the fewest last pieces that hold USAGE_TAIL bytes of data
        (now and then, not on every event; the sums are added up in C)."""
        totals = list(accumulate(reversed(self._sizes)))
        kept = bisect_left(totals, USAGE_TAIL) + 1
        if kept < len(totals):
            del self._tail[:-kept], self._sizes[:-kept]
            self._held = totals[kept - 1]

    def stop(self) -> None:
        """The client is gone: close the upstream connection now."""
        self.client_gone = True
        if self._client is not None and self._take_chunks is not None:
            self._take_chunks(None)     # what still comes goes to chunkReceived, and no further
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.client_gone:
            # A client (the openai SDK does) may close as soon as it has read
            # `data: [DONE]`, before the engine ends its body: it got it all.
            done = bool(self._tail) and \
                _payload(self._tail[-1], self._sizes[-1]).rstrip().endswith(b"data: [DONE]")
            self.ended.callback((COMPLETED, "the client closed after [DONE]") if done
                                else (CLIENT_GONE, None))
            return
        self.request.unregisterProducer()
        if isinstance(reason.value, (ResponseDone, PotentialDataLoss)):
            usage = find_usage(b"".join(map(_payload, self._tail, self._sizes))[-USAGE_TAIL:])
            if usage is not None:
                self.exchange.used(*usage)
            self.request.finish()
            self.ended.callback((COMPLETED, None))
            return
        # Cut short upstream: close without the terminating chunk, after what was
        # already relayed has been flushed, so the client sees a truncated body.
        self.request.channel.loseConnection()
        why = describe(reason.value) if reason.value is not None else "unknown"
        self.ended.callback((UPSTREAM_FAILED, f"upstream ended mid-response: {why}"))


class Discard(Protocol):
    """Takes a response body nobody wants: closes its connection at once."""

    def connectionMade(self) -> None:
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()


def sse_error(request: Request, exchange: Exchange, message: str, code: int) -> str:
    """End an already started event stream with an error event (its 200 status
    is gone), then close the connection without the final chunk."""
    event = json.dumps({"error": {"message": message, "type": "upstream_error", "code": code}})
    exchange.note(message)
    request.write(anthropic.error_event(code, message) if anthropic.speaks_anthropic(request)
                  else f"data: {event}\n\n".encode())
    request.channel.loseConnection()
    return UPSTREAM_FAILED
