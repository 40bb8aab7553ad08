"""Token timing of one stream (observe/tokentimes.py) and its metrics
(observe/tokenmetrics.py), on a task.Clock: which events are tokens, the gap
histogram's buckets, the rates, and what /metrics says of them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.task import Clock

from llmproxy.core.hub import Hub
from llmproxy.core.tokens import GAP_BUCKETS, TokensTimed
from llmproxy.observe.inflight import InFlight
from llmproxy.observe.tokenmetrics import TokenMetrics
from llmproxy.observe.tokentimes import TokenTimes, prompt_per_second, token_events

ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":null}}]}\n\n'
TOKEN = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
SPACED = b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'
LAST = (b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,'
        b'"completion_tokens":5},"timings":{"prompt_n":9,"prompt_ms":18.0,'
        b'"prompt_per_second":500.0}}\n\ndata: [DONE]\n\n')


def test_token_events_are_events_with_content() -> None:
    """Content, reasoning, completions' text, tool-call arguments and Anthropic's
    deltas count, compact or with json.dumps' spaces; a role-only chunk, an
    empty string, the finish chunk, the usage and [DONE] do not."""
    assert token_events(ROLE) == 0
    assert token_events(LAST) == 0
    assert token_events(TOKEN) == 1
    assert token_events(SPACED) == 1
    assert token_events(TOKEN * 3) == 3
    assert token_events(b'data: {"delta":{"reasoning_content":"hm"}}\n\n') == 1
    assert token_events(b'data: {"choices":[{"text":"a"}]}\n\n') == 1
    assert token_events(b'data: {"function":{"arguments":"{\\"a"}}\n\n') == 1
    assert token_events(b'data: {"type":"content_block_delta","delta":'
                        b'{"type":"text_delta","text":"x"}}\n\n') == 1
    assert token_events(b'data: {"delta":{"type":"input_json_delta","partial_json":"{"}}\n\n') == 1
    # An empty string is no token: a role chunk's content, Anthropic's block start.
    assert token_events(b'data: {"delta":{"role":"assistant","content":""}}\n\n') == 0
    assert token_events(b'data: {"delta": {"role": "assistant", "content": ""}}\n\n') == 0
    assert token_events(b'data: {"content_block":{"type":"text","text":""}}\n\n') == 0
    assert token_events(b'data: {"delta":{"content":""}}\n\n' + TOKEN) == 1
    # A quote inside a string is escaped: content that quotes the marker is one token.
    assert token_events(b'data: {"delta":{"content":"say \\"content\\":\\"x"}}\n\n') == 1


def test_first_token_gaps_and_rate_on_a_clock() -> None:
    """The first read with a token sets the first token's time; each later one
    observes one gap into its bucket; reads without tokens are not timed."""
    clock = Clock()
    times = TokenTimes(clock.seconds)
    clock.advance(1)
    times.feed(ROLE)
    assert times.first is None
    clock.advance(0.5)
    times.feed(TOKEN)
    assert times.first == 1.5
    clock.advance(0.03)
    times.feed(TOKEN * 2)         # two tokens in one read: one gap
    clock.advance(0.2)
    times.feed(TOKEN)
    clock.advance(3)
    times.feed(LAST)
    assert times.count == 4
    assert times.last == 1.73
    assert times.gaps[GAP_BUCKETS.index(0.035)] == 1
    assert times.gaps[GAP_BUCKETS.index(0.25)] == 1
    assert sum(times.gaps) == 2
    assert abs(times.gap_sum - 0.23) < 1e-9
    assert abs((times.output_per_second(None) or 0) - 3 / 0.23) < 1e-9
    assert abs((times.output_per_second(5) or 0) - 4 / 0.23) < 1e-9
    assert TokenTimes(clock.seconds).output_per_second(None) is None


def test_prompt_rate_from_timings() -> None:
    """llama-server's prompt_per_second, else prompt_n over prompt_ms; nothing
    from a missing, broken or senseless `timings`."""
    assert prompt_per_second(LAST) == 500.0
    assert prompt_per_second(b'"timings": {"prompt_n": 10, "prompt_ms": 20}') == 500.0
    assert prompt_per_second(b'"usage":{}') is None
    assert prompt_per_second(b'"timings":{"prompt_per_second":') is None
    assert prompt_per_second(b'"timings":{"prompt_per_second":true}') is None
    assert prompt_per_second(b'"timings":{"prompt_n":5,"prompt_ms":0}') is None
    assert prompt_per_second(b'"timings":[1]') is None


def test_an_exchange_publishes_its_timing_and_metrics_show_it() -> None:
    """A stream's timing goes out as one TokensTimed (first token from arrival
    and from the send to the engine), and /metrics shows each figure per model
    and host; a model nobody configured is `unknown`."""
    clock = Clock()
    heard: list[object] = []
    registry = CollectorRegistry()
    metrics = TokenMetrics(registry, lambda name: name == "m")
    hub = Hub()
    hub.subscribe(heard.append)
    hub.subscribe(metrics)
    inflight = InFlight(clock, hub)
    exchange = inflight.begin("POST", "/v1/chat/completions", "127.0.0.1")
    exchange.asked_for("m", streaming=True)
    exchange.bound_for("gpu1")
    clock.advance(2)
    exchange.forwarded()
    times = exchange.token_times()
    clock.advance(0.25)
    times.feed(TOKEN)
    clock.advance(0.05)
    times.feed(TOKEN)
    exchange.used(9, 2)
    exchange.timed(times, 500.0)
    (event,) = [e for e in heard if isinstance(e, TokensTimed)]
    assert (event.first_token, event.engine_first_token) == (2.25, 0.25)
    assert event.tokens == 2 and event.output_tokens == 2
    assert abs((event.output_per_second or 0) - 20.0) < 1e-6
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(registry).decode())}
    labels = {"model": "m", "host": "gpu1"}

    def value(family: str, suffix: str, **extra: str) -> float:
        return next(s.value for s in families[family].samples
                    if s.name == family + suffix and s.labels == {**labels, **extra})

    assert value("llmproxy_time_to_first_token_seconds", "_sum") == 2.25
    assert value("llmproxy_engine_time_to_first_token_seconds", "_sum") == 0.25
    assert value("llmproxy_prompt_tokens_per_second", "_sum") == 500.0
    assert value("llmproxy_inter_token_gap_seconds", "_count") == 1
    assert value("llmproxy_inter_token_gap_seconds", "_bucket", le="0.035") == 0
    assert value("llmproxy_inter_token_gap_seconds", "_bucket", le="0.05") == 1
    assert value("llmproxy_output_tokens_per_second", "_count") == 1
    other = inflight.begin("POST", "/v1/chat/completions", "127.0.0.1")
    other.asked_for("nobody-configured", streaming=True)
    other.bound_for("gpu1")
    other.forwarded()
    other.timed(other.token_times(), 100.0)
    assert 'model="unknown"' in generate_latest(registry).decode()


def test_nothing_is_published_without_a_timing() -> None:
    """A request that never reached an engine has no token timing, nor has an
    answer that is no stream and had no `timings`; one with them has."""
    heard: list[object] = []
    hub = Hub()
    hub.subscribe(heard.append)
    inflight = InFlight(Clock(), hub)
    exchange = inflight.begin("POST", "/v1/chat/completions", "127.0.0.1")
    exchange.timed(exchange.token_times(), None)
    exchange.asked_for("m")
    exchange.bound_for("gpu1")
    exchange.forwarded()
    heard.clear()
    exchange.timed(exchange.token_times(), None)
    assert heard == []
    exchange.timed(exchange.token_times(), 800.0)
    (event,) = heard
    assert isinstance(event, TokensTimed) and event.prompt_per_second == 800.0
    assert event.first_token is None and event.output_per_second is None
