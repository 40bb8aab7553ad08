"""Per-key rate limits: a key's `rpm` (requests per minute) and `tpm` (tokens
per minute, prompt plus completion as the engine's `usage` of each request
reports them).

Each limit is a bucket that refills continuously: `rpm` requests (`tpm`
tokens) a minute, never above the limit. A request is admitted while its key
has a whole request left and more than zero tokens, counting what requests
in flight have reserved; it takes one request at once and reserves its
estimate (web/usage.py: prompt plus the answer's bound, at most `tpm`), so a
burst of concurrent requests cannot all pass on the same unused tokens. When
it ends, its reservation is let go and its real tokens are taken (so a long
answer may take the tokens below zero, and the key waits until they are back
above it, at most MAX_WAIT seconds): the usage the engine reported; for a
stream without one, the prompt's estimate plus the events relayed; for any
other request that reached an engine without a usage (`/infill`,
`/embedding`, a client that left early), its estimate; nothing for one that
never reached an engine or was answered with an error.

A refusal is a 429 whose error `type` says which limit (`requests` or
`tokens`), with Retry-After: the seconds until the bucket admits again (for
tokens held by requests in flight, as if they were used now). Every admitted
or refused request of a key with a limit carries OpenAI's headers for it
(`x-ratelimit-limit-requests`, `-remaining-requests`, `-reset-requests`: the
time until the bucket is full again; the same three for tokens), the tokens
as they stood before the request's reservation.

The state is per key name and lives as long as the key's limits: a reload that
changes them (or drops the key) starts afresh, one that does not keeps it. An
upgrade hands it to the successor (`state` and `take`, as `ratelimit` lines on
the predecessor's pipe, lifecycle/handover.py), and the tokens of requests the
old process still finishes follow as they end (`forward_to`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.interfaces import IReactorTime

from llmproxy.config.keys import ApiKey
from llmproxy.core.capacity import RateLimited
from llmproxy.core.events import Event, RequestEnded
from llmproxy.core.hub import Publish
from llmproxy.web.usage import Estimate

MINUTE = 60.0
REQUESTS, TOKENS = "requests", "tokens"
MAX_WAIT = 86400.0     # a key's debt is held to what a day refills: Retry-After is at most this


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass
class _Bucket:
    """One key's use under its limits: what it used (draining at limit/60 a second)."""

    rpm: int | None
    tpm: int | None
    at: float
    requests: float = 0.0
    tokens: float = 0.0
    reserved: float = 0.0      # held by requests in flight; does not drain
    refused: dict[str, int] = field(default_factory=dict)

    def charge(self, tokens: float) -> None:
        """Take `tokens` (finite, not negative), the debt held to MAX_WAIT."""
        if self.tpm is not None and math.isfinite(tokens) and tokens > 0:
            self.tokens = min(self.tokens + tokens, self.tpm * (1 + MAX_WAIT / MINUTE))

    def settle(self, now: float) -> None:
        elapsed = max(0.0, now - self.at)
        if self.rpm is not None:
            self.requests = max(0.0, self.requests - self.rpm / MINUTE * elapsed)
        if self.tpm is not None:
            self.tokens = max(0.0, self.tokens - self.tpm / MINUTE * elapsed)
        self.at = max(self.at, now)

    def over(self) -> str | None:
        """Which limit refuses a request now (None: admitted)."""
        if self.rpm is not None and self.rpm - self.requests < 1:
            return REQUESTS
        if self.tpm is not None and self.tpm - self.tokens - self.reserved <= 0:
            return TOKENS
        return None

    def wait(self, which: str) -> float:
        """Seconds until `which` admits again."""
        if which == REQUESTS and self.rpm is not None:
            return (self.requests - (self.rpm - 1)) / (self.rpm / MINUTE)
        if which == TOKENS and self.tpm is not None:
            # above zero, not at it: a millisecond more
            used = self.tokens + self.reserved
            return min(MAX_WAIT, (used - self.tpm) / (self.tpm / MINUTE) + 0.001)
        return 0.0

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = []
        for which, limit, used in ((REQUESTS, self.rpm, self.requests),
                                   (TOKENS, self.tpm, self.tokens + self.reserved)):
            if limit is None:
                continue
            left = max(0, math.floor(limit - used + 1e-9))
            reset = used / (limit / MINUTE)
            out += [(f"x-ratelimit-limit-{which}".encode(), str(limit).encode()),
                    (f"x-ratelimit-remaining-{which}".encode(), str(left).encode()),
                    (f"x-ratelimit-reset-{which}".encode(), duration(reset).encode())]
        return out


@dataclass(frozen=True)
class _Held:
    """A request in flight's reservation, on the bucket it was taken from."""

    bucket: _Bucket
    estimate: Estimate
    amount: float


@dataclass(frozen=True)
class Verdict:
    """The answer to one request of a key: the headers it carries, and, when
    refused, which limit (`requests` or `tokens`) and the seconds to wait."""

    headers: list[tuple[bytes, bytes]]
    refused: str | None = None
    retry_after: int = 0


class RateLimits:
    """Every key's buckets; a hub subscriber that counts the tokens of each
    request as it ends."""

    def __init__(self, clock: IReactorTime, publish: Publish) -> None:
        self._clock = clock
        self._publish = publish
        self._buckets: dict[str, _Bucket] = {}
        self._held: dict[str, _Held] = {}     # by request id
        self._forward: Callable[[bytes], None] | None = None

    def _bucket(self, name: str, rpm: int | None, tpm: int | None) -> _Bucket:
        """`name`'s bucket under these limits (a fresh one when they changed)."""
        now = self._clock.seconds()
        bucket = self._buckets.get(name)
        if bucket is None or (bucket.rpm, bucket.tpm) != (rpm, tpm):
            bucket = self._buckets[name] = _Bucket(rpm, tpm, now)
        bucket.settle(now)
        return bucket

    def admit(self, key: ApiKey, request_id: str | None = None,
              estimate: Estimate | None = None) -> Verdict | None:
        """Admit (taking one request, and reserving its `estimate` of tokens
        until the request `request_id` ends) or refuse a request of `key`;
        None: the key has no limit."""
        if key.rpm is None and key.tpm is None:
            self._buckets.pop(key.name, None)
            return None
        bucket = self._bucket(key.name, key.rpm, key.tpm)
        which = bucket.over()
        if which is not None:
            bucket.refused[which] = bucket.refused.get(which, 0) + 1
            wait = bucket.wait(which)
            self._publish(RateLimited(self._clock.seconds(), key.name, request_id, which, wait))
            return Verdict(bucket.headers(), which, max(1, math.ceil(wait)))
        bucket.requests += 1
        verdict = Verdict(bucket.headers())
        if bucket.tpm is not None and request_id is not None:
            estimate = estimate or Estimate(0, 0)
            amount = float(min(max(1, estimate.total), bucket.tpm))
            bucket.reserved += amount
            self._held[request_id] = _Held(bucket, estimate, amount)
        self._sent(key.name, 1, 0)
        return verdict

    def __call__(self, event: Event) -> None:
        if not isinstance(event, RequestEnded):
            return
        held = self._held.pop(event.request_id, None)
        if held is not None:
            held.bucket.reserved = max(0.0, held.bucket.reserved - held.amount)
        if event.key is None:
            return
        tokens = _charged(event, held.estimate if held is not None else None)
        bucket = self._buckets.get(event.key)
        if tokens and bucket is not None and bucket.tpm is not None:
            bucket.settle(self._clock.seconds())
            bucket.charge(tokens)
            self._sent(event.key, 0, tokens)

    # -- an upgrade's hand-over ------------------------------------------------
    def _sent(self, name: str, requests: int, tokens: int) -> None:
        if self._forward is not None:
            bucket = self._buckets[name]
            self._forward(self._line({name: bucket}, requests, tokens))

    def _line(self, buckets: dict[str, _Bucket], requests: int | None = None,
              tokens: int | None = None) -> bytes:
        doc = {"at": self._clock.seconds(), "keys": {
            name: {"rpm": b.rpm, "tpm": b.tpm,
                   "requests": b.requests if requests is None else requests,
                   "tokens": b.tokens if tokens is None else tokens}
            for name, b in buckets.items()}}
        return b"ratelimit " + json.dumps(doc).encode() + b"\n"

    def forward_to(self, send: Callable[[bytes], None]) -> None:
        """An upgrade handed over: `send` the whole state now, and what this
        process takes from now on as it comes (the tokens of requests it still
        finishes), as `ratelimit` lines for the successor's `take`."""
        now = self._clock.seconds()
        for bucket in self._buckets.values():
            bucket.settle(now)
        self._forward = send
        send(self._line(self._buckets))

    def take(self, line: bytes) -> None:
        """A predecessor's `ratelimit` line (after the word): its use is added to
        the buckets of keys whose limits are the same here, less what has
        drained since it was sent."""
        try:
            doc = json.loads(line)
            now = self._clock.seconds()
            elapsed = max(0.0, now - float(doc["at"]))
            for name, used in doc["keys"].items():
                self._add(name, used, elapsed)
        except (ValueError, KeyError, TypeError, AttributeError):
            return      # a predecessor of another make: nothing to take

    def _add(self, name: str, used: dict[str, Any], elapsed: float) -> None:
        rpm, tpm = used.get("rpm"), used.get("tpm")
        bucket = self._bucket(str(name), rpm, tpm)
        if rpm is not None:
            requests = _finite(used["requests"])
            bucket.requests += min(rpm, max(0.0, requests - rpm / MINUTE * elapsed))
        if tpm is not None:
            bucket.charge(_finite(used["tokens"]) - tpm / MINUTE * elapsed)

    # -- what /status shows ------------------------------------------------------
    def snapshot(self, key: ApiKey) -> dict[str, Any] | None:
        """`key`'s limits and what is left of them now (None: it has none)."""
        if key.rpm is None and key.tpm is None:
            return None
        bucket = self._bucket(key.name, key.rpm, key.tpm)
        return {"rpm": key.rpm, "tpm": key.tpm,
                "remaining_requests": None if key.rpm is None
                else max(0, math.floor(key.rpm - bucket.requests + 1e-9)),
                "remaining_tokens": None if key.tpm is None
                else math.floor(key.tpm - bucket.tokens - bucket.reserved),
                "ratelimited": {REQUESTS: bucket.refused.get(REQUESTS, 0),
                                TOKENS: bucket.refused.get(TOKENS, 0)}}


def _finite(value: Any) -> float:
    """A count from a predecessor's line as a float: one that is not finite, or
    too large for a float, counts as nothing."""
    try:
        number = float(value)
    except OverflowError:
        return 0.0
    return number if math.isfinite(number) else 0.0


def _charged(event: RequestEnded, estimate: Estimate | None) -> int:
    """The tokens a request that ended takes (see the module's docstring;
    without an `estimate`, a request admitted elsewhere: its usage only)."""
    if event.prompt_tokens is not None or event.completion_tokens is not None:
        prompt = event.prompt_tokens
        if prompt is None:
            prompt = estimate.prompt if estimate is not None else 0
        return prompt + (event.completion_tokens or 0)
    if estimate is None or not event.routed or (event.status or 0) >= 400:
        return 0
    if event.events:
        return estimate.prompt + event.events
    return estimate.total
