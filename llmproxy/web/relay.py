"""Relaying an engine's answer to the client: the headers that pass each way, the
body written as it arrives under backpressure, and the visible end of a stream
that cannot finish (never a made-up clean end)."""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.server import Request

if TYPE_CHECKING:
    from llmproxy.web.site import ProxyRequest

from llmproxy.core.failures import describe
from llmproxy.core.redact import redact_text
from llmproxy.observe.inflight import CLIENT_GONE, COMPLETED, UPSTREAM_FAILED, Exchange
from llmproxy.observe.tokentimes import prompt_per_second
from llmproxy.web import anthropic
from llmproxy.web.cutoff import cut_short, response_producer
from llmproxy.web.enginesilence import Pausing
from llmproxy.web.requeststate import WithState
from llmproxy.web.usage import UsageStrip

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"proxy-connection", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})


def named_by_connection(values: Sequence[bytes] | None) -> set[bytes]:
    """The headers a Connection header names (hop-by-hop too), lower case."""
    if not values:
        return set()
    return {token.strip().lower() for value in values for token in value.split(b",")
            if token.strip()}


NOT_UPSTREAM = HOP_BY_HOP | {b"host", b"content-length", b"x-forwarded-for", b"accept-encoding"}
# What an engine is asked for: its body as it is (the proxy reads its `usage`,
# and inflates nothing: web/treqlayers.py).
ACCEPT_ENCODING = [b"identity"]

# The response headers the proxy owns, never taken from an engine (both relays):
# the request's id, its rate limits and their Retry-After, the model a fallback
# moved it to (X-LLMProxy-*), and CORS (web/cors.py decides it).
PROXY_OWNED = frozenset({b"x-request-id", b"retry-after"})
PROXY_OWNED_PREFIXES = (b"access-control-", b"x-ratelimit-", b"x-llmproxy-")


def proxy_owned(lower: bytes) -> bool:
    """Whether a response header (its lower-case name) is the proxy's alone."""
    return lower in PROXY_OWNED or lower.startswith(PROXY_OWNED_PREFIXES)


def upstream_request_headers(incoming: Headers, client_ip: str,
                             request_id: str | None = None) -> Headers:
    """The headers to send upstream: end-to-end ones (but the client's
    Accept-Encoding), plus X-Forwarded-For, Accept-Encoding: identity (and
    X-Request-Id, when given)."""
    named = named_by_connection(incoming.getRawHeaders(b"Connection"))
    out = Headers()
    for name, values in incoming.getAllRawHeaders():
        lower = name.lower()
        if lower not in NOT_UPSTREAM and lower not in named:
            out.setRawHeaders(name, list(values))
    forwarded = incoming.getRawHeaders(b"X-Forwarded-For")
    chain = [v.strip() for v in forwarded if v.strip()] if forwarded else []
    out.setRawHeaders(b"X-Forwarded-For", [b", ".join([*chain, client_ip.encode()])])
    out.setRawHeaders(b"Accept-Encoding", list(ACCEPT_ENCODING))
    if request_id is not None:
        out.setRawHeaders(b"X-Request-Id", [request_id.encode()])
    return out


def client_response_headers(upstream: Headers, length: object, out: Headers,
                            streaming: bool) -> None:
    """Set the upstream's response headers on `out` (the client's response),
    minus hop-by-hop ones and those its Connection header names (RFC 9110
    §7.6.1) and those the proxy owns (PROXY_OWNED: whatever the proxy set or
    did not set for them stands), plus its length; a stream says so to
    buffering proxies. A Vary of the engine's is added to the proxy's own,
    never in its place.

    The engine client keeps Content-Length out of `headers` (it is in
    `length`) and the Connection header in (both clients do: see
    web.enginehead and speedups.engineconnection); the head it came in passed
    web.enginehead's rules (no CR, LF or NUL in a value). An engine's empty
    Content-Encoding does not reach the client.
    """
    named = named_by_connection(upstream.getRawHeaders(b"Connection"))
    for name, values in upstream.getAllRawHeaders():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in named or proxy_owned(lower) or (
                lower == b"content-encoding" and not any(v.strip() for v in values)):
            continue
        # A Vary of the proxy's own (Vary: Origin, web/cors.py) is kept too.
        out.setRawHeaders(name, [*(out.getRawHeaders(b"vary") or ()), *values]
                          if lower == b"vary" else list(values))
    if isinstance(length, int) and not isinstance(length, bool):
        out.setRawHeaders(b"Content-Length", [b"%d" % length])
    if streaming or b"".join(upstream.getRawHeaders(b"Content-Type", ())).lower().startswith(
            b"text/event-stream"):
        out.setRawHeaders(b"X-Accel-Buffering", [b"no"])


USAGE_TAIL = 16 * 1024   # engines report `usage` at the end of a body or stream
TAIL_SLACK = 4 * 1024    # held beyond USAGE_TAIL before the tail is trimmed


def find_usage(tail: bytes, first: bool = False) -> tuple[int | None, int | None] | None:
    """(prompt, completion) tokens of the last (or `first`) `"usage": {...}` in
    `tail`, if any (OpenAI's prompt/completion_tokens, Anthropic's
    input/output_tokens)."""
    at = tail.find(b'"usage"') if first else tail.rfind(b'"usage"')
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


class Relay(Protocol):
    """Writes an upstream body to the client as it arrives; `ended` fires with
    (outcome, detail) once the body is over one way or another. It keeps the
    body's last USAGE_TAIL bytes to find the engine's `usage` at the end (also
    when the client left), and counts the events of a stream; of an Anthropic
    stream, also its first USAGE_TAIL bytes (`message_start` carries the input
    tokens, the last `message_delta` the output ones); nothing else of the
    body is held. A stream whose usage the proxy asked for (Exchange.usage_added)
    reaches the client without its usage-only chunk (web/usage.py). While the
    client's socket is full, the engine connection is paused (backpressure).

    `request_headers` and `response_headers` are the headers that pass each
    way (speedups.relaychunks.ChunkRelay has the same, cheaper)."""

    request_headers = staticmethod(upstream_request_headers)
    response_headers = staticmethod(client_response_headers)

    def __init__(self, request: ProxyRequest, exchange: Exchange) -> None:
        self.request = request
        self.exchange = exchange
        self.client_gone = False
        self.ended: Deferred[tuple[str, str | None]] = Deferred()
        # The last pieces of data, at least USAGE_TAIL bytes of it, and how many
        # bytes they hold.
        self._tail: list[bytes] = []
        self._held = 0
        self._streaming = exchange.streaming
        self._strip = UsageStrip() if exchange.usage_added else None
        # The stream's token timing (observe.tokentimes), fed each read with events.
        self._tokens = exchange.token_times()
        self._head: bytes | None = b"" if self._streaming and \
            anthropic.speaks_anthropic(request) else None
        # With capture on: the engine's bytes, as they come (before any edit).
        self._capture = request.state.capture
        # Why the proxy ended an answer the engine went silent in (see `silent`).
        self._silence: str | None = None
        self.pausing: Pausing | None = None

    def connectionMade(self) -> None:
        # Backpressure: while the client's socket is full, the upstream is paused.
        # (On HTTP/2, guarded by the write stall rule: web/cutoff.py.)
        self.pausing = Pausing(cast(IPushProducer, self.transport))
        self.request.registerProducer(response_producer(self.request, self.pausing), True)

    def paused(self) -> bool:
        """Whether the client's side holds the engine back now."""
        return self.pausing is not None and self.pausing.paused

    def dataReceived(self, data: bytes) -> None:
        if self.client_gone:
            return
        self._hold(data)
        if self._strip is not None:
            data = self._strip.feed(data)
            if not data:
                return
        self.request.write(data)           # counted by the request
        if self._streaming:
            events = data.count(b"data:")
            if events:
                self.exchange.relayed_events(events)
                self._tokens.feed(data)

    def _hold(self, piece: bytes) -> None:
        """`piece` held for the tail (and the head), and recorded (capture on)."""
        if self._capture is not None:
            self._capture.feed(piece)
        if self._head is not None and len(self._head) < USAGE_TAIL:
            self._head += piece
        self._tail.append(piece)
        self._held += len(piece)
        if self._held > USAGE_TAIL + TAIL_SLACK:
            self._trim()

    def _trim(self) -> None:
        """Keep only the fewest last pieces that hold USAGE_TAIL bytes of data
        (now and then, not on every event; the sums are added up in C)."""
        totals = list(accumulate(map(len, reversed(self._tail))))
        kept = bisect_left(totals, USAGE_TAIL) + 1
        if kept < len(totals):
            del self._tail[:-kept]
            self._held = totals[kept - 1]

    def stop(self) -> None:
        """The client is gone: close the upstream connection now."""
        self.client_gone = True
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()

    def silent(self, seconds: float) -> None:
        """The engine sent nothing for `seconds` (web/enginesilence.py): a stream
        ends with an error event saying so, any other body is cut short (never a
        clean end), the engine connection is closed, and the answer ends as
        upstream_failed."""
        if self.client_gone or self.ended.called:
            return
        self._silence = f"the engine sent nothing for {seconds:g}s (engine_read_timeout_seconds)"
        self.request.unregisterProducer()
        if self._streaming:
            sse_error(self.request, self.exchange, self._silence, 504)
        else:
            cut_short(self.request)
        self.stop()

    def _usage(self) -> None:
        """The engine's usage and then the answer's token timing, as far as
        they came, told to the exchange."""
        tail = b"".join(self._tail)[-USAGE_TAIL:]
        usage = find_usage(tail)
        if self._head and (usage is None or usage[0] is None):
            started = find_usage(self._head, first=True)
            if started is not None and started[0] is not None:
                usage = (started[0], None if usage is None else usage[1])
        if usage is not None:
            self.exchange.used(*usage)
        self.exchange.timed(self._tokens, prompt_per_second(tail))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._usage()
        if self._silence is not None:
            self.ended.callback((UPSTREAM_FAILED, self._silence))
            return
        if self.client_gone:
            # A client (the openai SDK does) may close as soon as it has read
            # `data: [DONE]`, before the engine ends its body: it got it all.
            done = bool(self._tail) and \
                self._tail[-1].rstrip().endswith(b"data: [DONE]")
            self.ended.callback((COMPLETED, "the client closed after [DONE]") if done
                                else (CLIENT_GONE, None))
            return
        self.request.unregisterProducer()
        if isinstance(reason.value, (ResponseDone, PotentialDataLoss)):
            rest = self._strip.flush() if self._strip is not None else b""
            if rest:
                self.request.write(rest)
            self.request.finish()
            self.ended.callback((COMPLETED, None))
            return
        # Cut short upstream: close without the terminating chunk, after what was
        # already relayed has been flushed, so the client sees a truncated body
        # (on HTTP/2, a reset stream).
        cut_short(self.request)
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
    exchange.note(message)
    message = redact_text(message)      # the client never reads an engine's log
    event = json.dumps({"error": {"message": message, "type": "upstream_error", "code": code}})
    data = anthropic.error_event(code, message) if anthropic.speaks_anthropic(request) \
        else f"data: {event}\n\n".encode()
    if isinstance(request, WithState) and request.state.capture is not None:
        request.state.capture.feed(data)
    request.write(data)
    # HTTP/1.1: the connection closes without the last chunk. HTTP/2: the
    # stream ends after the error event (a reset now would lose the event,
    # which is still queued), and the event says what went wrong.
    request.channel.loseConnection()
    return UPSTREAM_FAILED
