"""The event of a request's token timing: when its first token reached the
client, the gaps between tokens, and the rates the engine reached. Published
once per request that reached an engine (see `core.hub`), like the events of
`core.events`; measured by `web.tokentimes`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmproxy.core.events import Event

# The upper bounds (seconds) of the inter-token gap histogram's buckets; the
# last bucket (+Inf) follows them.
GAP_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class TokensTimed(Event):
    """The token timing of one request answered by an engine. `first_token`:
    seconds from the request's arrival to the first token relayed to the client
    (streams only); `engine_first_token`: from the moment it was sent to the
    engine. `tokens`: token events counted in the stream; `output_tokens`: the
    engine's `usage` (completion tokens) when it reported one; `decode_seconds`:
    first token to last. `gaps`: counts per GAP_BUCKETS bucket (one more, +Inf)
    of the gaps between reads carrying tokens, `gap_sum` their sum.
    `output_per_second`: output tokens after the first over `decode_seconds`;
    `prompt_per_second`: as the engine's `timings` reported it."""

    type: ClassVar[str] = "request.tokens"
    request_id: str
    model: str | None
    host: str | None
    streaming: bool
    first_token: float | None
    engine_first_token: float | None
    tokens: int
    output_tokens: int | None
    decode_seconds: float
    gaps: tuple[int, ...]
    gap_sum: float
    output_per_second: float | None
    prompt_per_second: float | None
