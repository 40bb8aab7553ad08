"""Requests in flight: one record per request (`Exchange`), changed only through
its own methods, and the registry (`InFlight`) that publishes each request's end.

What a client chose (its method, path and model) and the notes on how a
request ended (which may quote an engine) are kept as `core.text.shown` makes
them: bounded and on one line. Every event, access line and `/status` entry
made from an exchange is therefore small and one line, whatever the client sent.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from llmproxy.core.events import RequestEnded, RequestRouted, RouteFallback
from llmproxy.core.hub import Hub, Publish
from llmproxy.core.text import shown
from llmproxy.core.tokens import TokensTimed
from llmproxy.observe.tokentimes import TokenTimes

# How a request ended.
COMPLETED = "completed"          # the whole response was sent (errors included)
CLIENT_GONE = "client-gone"      # the client disconnected first; the upstream was cancelled
UPSTREAM_FAILED = "upstream-failed"  # the upstream failed before or during the response
CUT = "cut"                      # a drain deadline cut it
CLIENT_STALLED = "client-stalled"  # it read nothing for too long: aborted, upstream cancelled

METHOD_SHOWN = 32       # a method is a token: any longer one is shown cut
# The most tokens one request's usage may report, each count: an engine's
# larger number is taken as this one, so a hostile or broken `usage` cannot
# overflow a float in the views (rate limits, metrics, key counters).
TOKENS_CAP = 10**9
DETAIL_SHOWN = 1024     # a note may quote an engine's answer (up to 500 characters)


def _no_abort() -> None:
    """No connection to drop (before `on_abort`, and once the request ended)."""


class Exchange:
    """One request, from arrival to its end. Everyone may read its fields; only
    its methods change them."""

    def __init__(self, id: str, method: str, path: str, client: str, clock: IReactorTime,
                 publish: Publish) -> None:
        self.id = id
        self.method = shown(method, METHOD_SHOWN)
        self.path = shown(path)
        self.client = client
        self.started = clock.seconds()
        self.model: str | None = None
        self.host: str | None = None
        self.engine: str | None = None      # the engine it holds a lease on (managed host)
        self.key: str | None = None         # the name of the API key it came with
        self.priority: str | None = None    # that key's class in a host's queue
        self.streaming = False
        self.routed = False
        self.status: int | None = None       # as sent to the client
        self.bytes_sent = 0
        self.first_byte_at: float | None = None
        self.sent_at: float | None = None    # when it went to its engine (clock time)
        self.events = 0                      # SSE events relayed (tokens, roughly)
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.usage_added = False             # the proxy asked the engine for a stream's usage
        self.outcome: str | None = None
        self.detail: str | None = None
        self.cut = False                     # a drain deadline aborted it
        self.stalled_for: float | None = None  # aborted: the client read nothing this long
        self.ended: Deferred[None] = Deferred()
        self._clock = clock
        self._publish = publish
        self._abort: Callable[[], None] = _no_abort

    def on_abort(self, abort: Callable[[], None]) -> None:
        """How to drop the client's connection at once (for a drain deadline)."""
        self._abort = abort

    def authenticated(self, key: str, priority: str | None = None) -> None:
        """It came with the API key named `key` (the name, never the secret),
        whose requests wait in a host's queue in class `priority`."""
        self.key = key
        self.priority = priority

    def asked_for(self, model: str, streaming: bool = False) -> None:
        """The model the client asked for (kept shown), and whether it asked for
        a stream."""
        self.model = shown(model)
        self.streaming = streaming

    def bound_for(self, host: str) -> None:
        """The host its model resolved to (it may still wait for an engine there)."""
        self.host = host

    def fell_back(self, model: str, reason: str) -> None:
        """No host of its model could take it and nothing of it was sent (`reason`):
        it is now a request for `model`, the next of its fallbacks."""
        assert self.model is not None
        fallback = shown(model)
        self._publish(RouteFallback(self._clock.seconds(), self.id, self.model, fallback,
                                    shown(reason, DETAIL_SHOWN)))
        self.model = fallback

    def forwarded(self, engine: str | None = None) -> None:
        """It goes to its host now; on a managed host it holds a lease on `engine`."""
        assert self.model is not None and self.host is not None
        self.engine = engine
        self.routed = True
        self.sent_at = self._clock.seconds()
        self._publish(RequestRouted(
            self._clock.seconds(), request_id=self.id, method=self.method, path=self.path,
            model=self.model, host=self.host, engine=engine, streaming=self.streaming,
            key=self.key))

    def wrote(self, status: int, size: int) -> None:
        """`size` bytes were written to the client under `status`: the request's
        write path calls it (and `relayed` counts a stream's next pieces)."""
        if self.first_byte_at is None:
            self.first_byte_at = self._clock.seconds()
            self.status = status
        self.bytes_sent += size

    def relayed_events(self, n: int) -> None:
        """`n` more server-sent events went to the client."""
        self.events += n

    def relayed(self, size: int, events: int) -> None:
        """The next piece of a relayed body went to the client, after its first
        byte: `size` bytes holding `events` server-sent events (what `wrote` and
        `relayed_events` would count, in one call per event of a stream)."""
        self.bytes_sent += size
        self.events += events

    def used(self, prompt: int | None, completion: int | None) -> None:
        """The tokens the engine reported for this request (its `usage`), each
        held to TOKENS_CAP."""
        self.prompt_tokens = None if prompt is None else min(prompt, TOKENS_CAP)
        self.completion_tokens = None if completion is None else min(completion, TOKENS_CAP)

    def token_times(self) -> TokenTimes:
        """A fresh measure of its answer's token timing, on its clock."""
        return TokenTimes(self._clock.seconds)

    def timed(self, times: TokenTimes, prompt_per_second: float | None) -> None:
        """Its answer is over (its `usage` told first): publish its token timing,
        when it was sent to an engine and there is one (a stream, or an answer
        with the engine's prompt rate)."""
        if self.sent_at is None or (not self.streaming and prompt_per_second is None):
            return
        first = times.first
        self._publish(TokensTimed(
            self._clock.seconds(), request_id=self.id, model=self.model, host=self.host,
            streaming=self.streaming, first_token=None if first is None else first - self.started,
            engine_first_token=None if first is None else first - self.sent_at,
            tokens=times.count, output_tokens=self.completion_tokens,
            decode_seconds=0.0 if first is None else times.last - first,
            gaps=tuple(times.gaps), gap_sum=times.gap_sum,
            output_per_second=times.output_per_second(self.completion_tokens)
            if self.streaming else None,
            prompt_per_second=prompt_per_second))

    def add_usage(self) -> None:
        """The proxy asked the engine for the usage of this stream, which the
        client did not ask for: its relay takes the usage-only chunk out."""
        self.usage_added = True

    def note(self, detail: str) -> None:
        """Why it ended as it did (shown in its access line)."""
        self.detail = shown(detail, DETAIL_SHOWN)

    def stalled(self, seconds: float) -> None:
        """The client read nothing for `seconds` while data waited for it: its
        connection is being aborted, and the request ends as client-stalled."""
        self.stalled_for = seconds
        self.detail = (f"read nothing for {seconds:g}s while the response waited "
                       "(client_write_stall_seconds)")

    def cut_now(self) -> None:
        """The drain deadline: drop the client's connection, never end it cleanly."""
        self.cut = True
        self._abort()

    def snapshot(self, now: float) -> dict[str, Any]:
        """What /status shows of it."""
        return {
            "id": self.id, "method": self.method, "path": self.path, "model": self.model,
            "host": self.host, "status": self.status, "bytes": self.bytes_sent,
            "age_seconds": round(now - self.started, 3), "streaming": self.streaming,
            "engine": self.engine, "events": self.events, "key": self.key,
        }

    def ended_as(self, outcome: str, detail: str | None) -> RequestEnded:
        """Set how it ended (for InFlight.end): the event that says so. It lets go
        of its abort (which holds the request, itself holding the exchange: no
        cycle outlives the request)."""
        self._abort = _no_abort
        self.outcome = (CUT if self.cut else
                        CLIENT_STALLED if self.stalled_for is not None else outcome)
        if detail is not None and self.stalled_for is None:
            self.detail = shown(detail, DETAIL_SHOWN)
        now = self._clock.seconds()
        return RequestEnded(
            now, request_id=self.id, method=self.method, path=self.path, client=self.client,
            model=self.model, host=self.host, engine=self.engine, status=self.status,
            bytes=self.bytes_sent, duration=now - self.started, outcome=self.outcome,
            detail=self.detail, cut=self.cut, routed=self.routed,
            ttfb=None if self.first_byte_at is None else self.first_byte_at - self.started,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            key=self.key, events=self.events)


class InFlight:
    """The registry of running requests; publishes each one's end (its access line)."""

    def __init__(self, clock: IReactorTime, hub: Hub | None = None,
                 id_prefix: str | None = None) -> None:
        self._clock = clock
        self._hub = hub or Hub.logging()
        self._prefix = id_prefix if id_prefix is not None else os.urandom(3).hex()
        self._seq = 0
        self.active: dict[str, Exchange] = {}
        self._idle_waiters: list[Deferred[None]] = []

    def begin(self, method: str, path: str, client: str) -> Exchange:
        """Register a request that has just arrived."""
        self._seq += 1
        exchange = Exchange(f"{self._prefix}-{self._seq}", method, path, client, self._clock,
                            self._hub.publish)
        self.active[exchange.id] = exchange
        return exchange

    def end(self, exchange: Exchange, outcome: str, detail: str | None = None) -> None:
        """Unregister a request and publish its end; later calls are ignored. Once
        none is left, whoever waits in idle() hears it in this same turn."""
        if exchange.outcome is not None:
            return
        event = exchange.ended_as(outcome, detail)
        self.active.pop(exchange.id, None)
        self._hub.publish(event)
        exchange.ended.callback(None)
        if not self.active:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    def idle(self) -> Deferred[None]:
        """Fires once no request is in flight (at once if none is)."""
        d: Deferred[None] = Deferred()
        if self.active:
            self._idle_waiters.append(d)
        else:
            d.callback(None)
        return d

    def by_host(self) -> dict[str, int]:
        """How many requests are in flight on each host (those routed to one)."""
        counts: dict[str, int] = {}
        for exchange in self.active.values():
            if exchange.host is not None:
                counts[exchange.host] = counts.get(exchange.host, 0) + 1
        return counts

    def snapshot(self) -> list[dict[str, Any]]:
        """Every running request, oldest first, for /status."""
        now = self._clock.seconds()
        return [e.snapshot(now) for e in self.active.values()]
