"""A request's tokens for `tpm` (web/usage.py): the estimate a reservation is
made from, the usage asked of a streaming engine, and the usage-only chunk
taken out of the client's stream, whatever the reads' boundaries."""

from __future__ import annotations

import json
from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from llmproxy.web.usage import (
    DEFAULT_OUTPUT,
    HELD_EVENT,
    Estimate,
    UsageStrip,
    estimate,
    with_usage,
)

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n'
USAGE = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,'
         b'"completion_tokens":5}}\n\n')
STREAM = CHUNK * 3 + USAGE + b"data: [DONE]\n\n"


def test_the_estimate_is_the_body_over_four_plus_the_answers_bound() -> None:
    """max_completion_tokens, max_tokens or n_predict bounds the answer (times n);
    none: DEFAULT_OUTPUT; a bound that is not a count is ignored."""
    assert estimate({"max_tokens": 20}, 400) == Estimate(100, 20)
    assert estimate({"max_completion_tokens": 7, "max_tokens": 20}, 8).total == 9
    assert estimate({"n_predict": 5, "n": 3}, 0) == Estimate(0, 15)
    assert estimate({"max_tokens": True}, 0) == Estimate(0, DEFAULT_OUTPUT)
    assert estimate({"max_tokens": -1}, 0) == Estimate(0, DEFAULT_OUTPUT)


def test_include_usage_is_added_to_streamed_openai_requests_only() -> None:
    """A streamed chat or text completion is sent asking for its usage (other
    stream options kept); one that asks itself, a non-streamed one, another path
    or a stream_options that is not an object is sent as it is."""
    body = {"model": "m", "stream": True, "stream_options": {"x": 1}}
    assert with_usage("/v1/chat/completions", body) == \
        {**body, "stream_options": {"x": 1, "include_usage": True}}
    assert with_usage("/v1/completions", {"stream": True}) == \
        {"stream": True, "stream_options": {"include_usage": True}}
    assert with_usage("/v1/chat/completions", {"stream": True, "stream_options":
                                               {"include_usage": True}}) is None
    assert with_usage("/v1/chat/completions", {"stream": False}) is None
    assert with_usage("/v1/messages", {"stream": True}) is None
    assert with_usage("/v1/chat/completions", {"stream": True, "stream_options": 3}) is None


@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_the_usage_only_chunk_is_taken_out_wherever_the_reads_split(cuts: list[int]) -> None:
    """Fed in any pieces, the stream comes out whole but for its usage-only chunk
    (chunks whose usage is null, and [DONE], pass)."""
    strip = UsageStrip()
    bounds = [0, *sorted(cuts), len(STREAM)]
    out = b"".join(strip.feed(STREAM[a:b]) for a, b in pairwise(bounds))
    out += strip.flush()
    assert out == CHUNK * 3 + b"data: [DONE]\n\n"


def test_crlf_events_and_an_overlong_event_pass() -> None:
    """Events ended by CRLF are read too; an unfinished event longer than
    HELD_EVENT is passed on as it is rather than held."""
    strip = UsageStrip()
    crlf = USAGE.replace(b"\n", b"\r\n")
    assert strip.feed(CHUNK + crlf) == CHUNK
    big = b"data: " + json.dumps({"x": "y" * HELD_EVENT}).encode()
    assert strip.feed(big) == big
    assert strip.feed(b"\n\n") == b"\n\n"
