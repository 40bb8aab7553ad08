"""Token timing of one relayed answer, measured where the relay already reads
it (web.relay's Relay and speedups.relaychunks' ChunkRelay call the same
`TokenTimes.feed` on the same data, so both paths measure alike).

A token is an SSE event with content: a non-empty JSON string value of a key
ending in `content`, `text`, `arguments` or `partial_json` (OpenAI chat and its
`reasoning_content`, completions' `text`, tool calls' `arguments`, Anthropic's
`text_delta` and `input_json_delta`). Events that arrive in one read
of the engine's socket arrive at one time: the gap between two reads carrying
tokens is observed once. For the engine's totals the engine's own `usage`
(completion tokens) wins over the count, and llama-server's `timings` give the
prompt rate. Per read the cost is one regex scan in C, a clock read and a
counter: nothing is kept per event.
"""

from __future__ import annotations

import json
import math
import re
from bisect import bisect_left
from collections.abc import Callable
from typing import TypeGuard

from llmproxy.core.tokens import GAP_BUCKETS

# The marker of a token event, written compactly (llama-server, OpenAI) or with
# json.dumps' default space (many Python engines): a key ending in one of the
# names, then a string value that is not empty (a role chunk's `"content": ""`,
# Anthropic's block start's `"text": ""` is no token). A quote inside a JSON
# string is escaped, so no marker matches there. One scan of the read, in C.
_TOKEN = re.compile(rb'(?:content|text|arguments|partial_json)": ?"(?!")')


def token_events(data: bytes) -> int:
    """How many token events `data` (SSE from an engine) holds."""
    return len(_TOKEN.findall(data))


class TokenTimes:
    """The token timing of one stream as its reads arrive: `feed` each read's
    data (what the relay sends on); the figures are read at its end."""

    __slots__ = ("_seconds", "count", "first", "gap_sum", "gaps", "last")

    def __init__(self, seconds: Callable[[], float]) -> None:
        self._seconds = seconds
        self.first: float | None = None     # clock time of the first token
        self.last = 0.0                     # and of the last
        self.count = 0                      # token events
        self.gaps = [0] * (len(GAP_BUCKETS) + 1)
        self.gap_sum = 0.0

    def feed(self, data: bytes) -> None:
        """A read of the stream went to the client: its tokens, timed now."""
        n = token_events(data)
        if not n:
            return
        now = self._seconds()
        if self.first is None:
            self.first = now
        else:
            gap = now - self.last
            self.gaps[bisect_left(GAP_BUCKETS, gap)] += 1
            self.gap_sum += gap
        self.last = now
        self.count += n

    def output_per_second(self, output_tokens: int | None) -> float | None:
        """Output tokens after the first over the time from the first token to
        the last (the engine's count when it reported one); None for fewer than
        two or no time between them."""
        n = output_tokens if output_tokens is not None else self.count
        span = self.last - self.first if self.first is not None else 0.0
        if n < 2 or span <= 0:
            return None
        return (n - 1) / span


def prompt_per_second(tail: bytes) -> float | None:
    """The prompt rate (tokens per second) of the last `"timings": {...}` in
    `tail` (llama-server's: `prompt_per_second`, else `prompt_n` over
    `prompt_ms`), if any."""
    at = tail.rfind(b'"timings"')
    if at < 0:
        return None
    rest = tail[at + len(b'"timings"'):].lstrip()
    if not rest.startswith(b":"):
        return None
    try:
        timings, _ = json.JSONDecoder().raw_decode(rest[1:].lstrip().decode("utf-8", "replace"))
    except ValueError:
        return None
    if not isinstance(timings, dict):
        return None
    rate = timings.get("prompt_per_second")
    if _number(rate) and rate > 0:
        return float(rate)
    n, ms = timings.get("prompt_n"), timings.get("prompt_ms")
    if _number(n) and _number(ms) and n > 0 and ms > 0:
        return float(n) * 1000.0 / float(ms)
    return None


def _number(value: object) -> TypeGuard[float]:
    """A JSON number that is finite (not a bool, NaN or an infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)
