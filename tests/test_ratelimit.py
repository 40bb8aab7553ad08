"""Per-key rate limits (web/ratelimit.py) and their config (config/keys.py) on a
clock: rpm and tpm buckets, the 429's kind and Retry-After, OpenAI's headers,
a reload that keeps or resets the state, and the hand-over to a successor."""

from __future__ import annotations

import hashlib

import pytest
from twisted.internet.task import Clock

from llmproxy.config.keys import ApiKey, parse_keys
from llmproxy.config.values import ConfigError
from llmproxy.core.capacity import RateLimited
from llmproxy.core.events import Event, RequestEnded
from llmproxy.core.hub import Hub
from llmproxy.observe.inflight import TOKENS_CAP, InFlight
from llmproxy.web.ratelimit import MAX_WAIT, RateLimits, Verdict, duration
from llmproxy.web.usage import Estimate

DIGEST = hashlib.sha256(b"s").digest()


def key(rpm: int | None = None, tpm: int | None = None, name: str = "alice") -> ApiKey:
    return ApiKey(name, DIGEST, rpm=rpm, tpm=tpm)


def ended(name: str, prompt: int | None, completion: int | None, request_id: str = "r",
          routed: bool = True, status: int | None = 200, events: int = 0,
          outcome: str = "completed") -> RequestEnded:
    return RequestEnded(0.0, request_id=request_id, method="POST", path="/v1/chat/completions",
                        client="127.0.0.1", model="m", host="h", engine=None, status=status,
                        bytes=1, duration=0.1, outcome=outcome, prompt_tokens=prompt,
                        completion_tokens=completion, key=name, routed=routed, events=events)


def limits() -> tuple[RateLimits, Clock, list[Event]]:
    clock = Clock()
    clock.advance(1000)
    events: list[Event] = []
    return RateLimits(clock, events.append), clock, events


def headers(verdict: Verdict | None) -> dict[bytes, bytes]:
    assert verdict is not None
    return dict(verdict.headers)


def test_rpm_admits_the_limit_then_refuses_with_retry_after_and_refills() -> None:
    """rpm 3: three requests pass and the remaining count goes 2, 1, 0; the fourth
    is refused as `requests` with Retry-After 20 (a request's worth of refill); 20 s
    later one passes again."""
    lim, clock, events = limits()
    k = key(rpm=3)
    left = [headers(lim.admit(k))[b"x-ratelimit-remaining-requests"] for _ in range(3)]
    assert left == [b"2", b"1", b"0"]
    refused = lim.admit(k, "req-4")
    assert refused is not None and refused.refused == "requests" and refused.retry_after == 20
    assert headers(refused)[b"x-ratelimit-limit-requests"] == b"3"
    assert headers(refused)[b"x-ratelimit-reset-requests"] == b"1m0s"
    assert [(e.key, e.limit) for e in events if isinstance(e, RateLimited)] == \
        [("alice", "requests")]
    clock.advance(19.9)
    assert lim.admit(k) is not None and lim.admit(k).refused == "requests"  # type: ignore
    clock.advance(20.2)
    assert lim.admit(k).refused is None     # type: ignore[union-attr]


def test_tpm_counts_prompt_and_completion_of_completed_requests() -> None:
    """tpm 100: requests pass while tokens remain above zero; the usage of a request
    that ended (60 + 50) takes them below, and the next is refused as `tokens`
    until they are back above zero; tokens of another key do not count."""
    lim, clock, _ = limits()
    k = key(tpm=100)
    first = lim.admit(k)
    assert first is not None and headers(first)[b"x-ratelimit-remaining-tokens"] == b"100"
    assert b"x-ratelimit-limit-requests" not in headers(first)   # no rpm: no such headers
    lim(ended("bob", 500, 500))
    assert lim.admit(k).refused is None     # type: ignore[union-attr]
    lim(ended("alice", 60, 50))
    refused = lim.admit(k)
    assert refused is not None and refused.refused == "tokens"
    assert refused.retry_after == 7          # 10 tokens over at 100/60 a second: 6 s and a bit
    clock.advance(6.5)
    assert lim.admit(k).refused is None      # type: ignore[union-attr]


def test_a_key_without_limits_has_no_verdict_and_headers() -> None:
    lim, _, _ = limits()
    assert lim.admit(key()) is None


def test_a_reload_keeps_the_state_of_unchanged_limits_and_resets_changed_ones() -> None:
    """The same limits (a new ApiKey value from a reloaded file) keep what was used;
    other limits start afresh."""
    lim, _, _ = limits()
    for _ in range(2):
        lim.admit(key(rpm=2))
    assert lim.admit(key(rpm=2)).refused == "requests"          # type: ignore[union-attr]
    assert lim.admit(key(rpm=3)).refused is None                # type: ignore[union-attr]


def test_the_state_goes_to_a_successor_and_later_tokens_follow() -> None:
    """The old process's forward_to sends its state; the successor's take adds it
    (less what drained meanwhile) for keys with the same limits; tokens of a
    request the old process finishes later follow as their own line."""
    old, clock, _ = limits()
    for _ in range(2):
        old.admit(key(rpm=2, tpm=1000))
    lines: list[bytes] = []
    old.forward_to(lines.append)
    new = RateLimits(clock, lambda e: None)
    for line in lines:
        assert line.startswith(b"ratelimit ")
        new.take(line[len(b"ratelimit "):])
    assert new.admit(key(rpm=2, tpm=1000)).refused == "requests"   # type: ignore[union-attr]
    old(ended("alice", 600, 500))
    assert len(lines) == 2
    new.take(lines[1][len(b"ratelimit "):])
    clock.advance(60)
    snap = new.snapshot(key(rpm=2, tpm=1000))
    assert snap is not None and snap["remaining_requests"] == 2
    new.take(b"not json")                  # a stranger's line changes nothing
    assert new.admit(key(rpm=5)).refused is None                   # type: ignore[union-attr]


def test_durations_read_as_openai_writes_them() -> None:
    assert [duration(s) for s in (0.02, 1.5, 60, 361)] == ["20ms", "1.5s", "1m0s", "6m1s"]


def test_the_keys_file_takes_priority_rpm_and_tpm_and_names_bad_fields() -> None:
    """priority high/normal/low (default normal), rpm and tpm whole numbers >= 1;
    anything else is an error naming the field."""
    digest = "a" * 64
    ring = parse_keys({"keys": [{"name": "a", "sha256": digest, "priority": "high",
                                 "rpm": 10, "tpm": 5000}]}, "keys.json")
    assert (ring.keys[0].priority, ring.keys[0].rpm, ring.keys[0].tpm) == ("high", 10, 5000)
    assert parse_keys({"keys": [{"name": "a", "sha256": digest}]}, "k").keys[0].priority \
        == "normal"
    with pytest.raises(ConfigError) as e:
        parse_keys({"keys": [{"name": "a", "sha256": digest, "priority": "urgent",
                              "rpm": 0, "tpm": True}]}, "keys.json")
    text = str(e.value)
    assert "keys[0].priority" in text and "keys[0].rpm" in text and "keys[0].tpm" in text


def test_a_burst_is_admitted_on_reservations_and_settled_to_the_real_usage() -> None:
    """tpm 50, 40 requests at once each estimated at 10 + 20 tokens: the first
    two are admitted (the second while 20 tokens are left unreserved), the other
    38 refused as `tokens`; once both end with 3 + 4 tokens each, their
    reservations are let go and only 14 tokens count."""
    lim, _, _ = limits()
    k = key(tpm=50)
    verdicts = [lim.admit(k, f"r{i}", Estimate(10, 20)) for i in range(40)]
    assert [v.refused for v in verdicts if v is not None].count(None) == 2
    assert lim.snapshot(k)["remaining_tokens"] == -10           # type: ignore[index]
    for i in range(2):
        lim(ended("alice", 3, 4, f"r{i}"))
    assert lim.snapshot(k)["remaining_tokens"] == 36            # type: ignore[index]
    assert lim.admit(k, "r41", Estimate(10, 20)).refused is None   # type: ignore[union-attr]


def test_a_reservation_is_at_most_the_tpm() -> None:
    """An estimate above the limit reserves the whole limit: the request is
    admitted on an unused bucket, and the next waits for it."""
    lim, _, _ = limits()
    k = key(tpm=50)
    assert lim.admit(k, "a", Estimate(10_000, 10_000)).refused is None  # type: ignore
    assert lim.admit(k, "b", Estimate(1, 1)).refused == "tokens"        # type: ignore


ESTIMATE = Estimate(10, 20)


def charged(event_of: dict[str, object], estimate: Estimate = ESTIMATE) -> int:
    """What one request of tpm 1000, estimated at `estimate`, is charged when it
    ends as `ended(**event_of)` says."""
    lim, _, _ = limits()
    k = key(tpm=1000)
    lim.admit(k, "r", estimate)
    lim(ended("alice", **event_of))           # type: ignore[arg-type]
    snap = lim.snapshot(k)
    assert snap is not None
    return 1000 - int(snap["remaining_tokens"])


def test_what_a_request_without_a_usage_is_charged() -> None:
    """A usage counts as reported (a missing prompt as its estimate: a stream's
    input seen only at its start); without one, a stream is charged its prompt's
    estimate plus the events relayed, any other request that reached an engine
    (a client that left, /infill, /embedding) its whole estimate, and one that
    never reached an engine, or got an error, nothing."""
    assert charged({"prompt": 3, "completion": 4}) == 7
    assert charged({"prompt": None, "completion": 4}) == 14
    assert charged({"prompt": None, "completion": None, "events": 6}) == 16
    assert charged({"prompt": None, "completion": None, "status": None,
                    "outcome": "client-gone"}) == 30
    assert charged({"prompt": None, "completion": None, "routed": False}) == 0
    assert charged({"prompt": None, "completion": None, "status": 503}) == 0


def test_a_huge_usage_is_capped_and_the_wait_is_at_most_a_day() -> None:
    """A 361-digit completion_tokens becomes TOKENS_CAP in the request's end
    event; charged to a key, its Retry-After is at most MAX_WAIT (not a
    300-digit number) and another key's limits work as before."""
    clock = Clock()
    hub = Hub()
    lim = RateLimits(clock, hub.publish)
    hub.subscribe(lim)
    inflight = InFlight(clock, hub, "t")
    k = key(tpm=100)
    exchange = inflight.begin("POST", "/v1/chat/completions", "127.0.0.1")
    exchange.authenticated("alice")
    lim.admit(k, exchange.id, Estimate(1, 1))
    exchange.used(1, 10**360)
    seen: list[Event] = []
    hub.subscribe(seen.append)
    inflight.end(exchange, "completed")
    end = seen[0]
    assert isinstance(end, RequestEnded) and end.completion_tokens == TOKENS_CAP
    refused = lim.admit(k, "next")
    assert refused is not None and refused.refused == "tokens"
    assert refused.retry_after <= MAX_WAIT
    other = key(tpm=100, name="bob")
    assert lim.admit(other, "b1").refused is None               # type: ignore[union-attr]
    lim(ended("bob", 60, 50, "b1"))
    assert lim.admit(other, "b2").refused == "tokens"           # type: ignore[union-attr]


def test_a_predecessors_line_with_an_absurd_count_neither_raises_nor_locks_the_key() -> None:
    """A predecessor's line saying Infinity tokens (Python's JSON reads it) or a
    400-digit count neither raises nor locks the key for more than a day."""
    lim, _, _ = limits()
    lim.take(b'{"at": 1000, "keys": {"alice": {"rpm": null, "tpm": 100, '
             b'"requests": 0, "tokens": Infinity}}}')
    lim.take(b'{"at": 1000, "keys": {"alice": {"rpm": 10, "tpm": 100, '
             b'"requests": 1e400, "tokens": ' + b"9" * 400 + b'}}}')
    for k in (key(tpm=100), key(rpm=10, tpm=100)):
        verdict = lim.admit(k)
        assert verdict is not None and verdict.retry_after <= MAX_WAIT
