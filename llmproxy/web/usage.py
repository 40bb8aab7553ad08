"""What a request's tokens are taken to be, for a key's `tpm` (web/ratelimit.py):
the estimate its reservation is made from at admission, the `usage` the proxy
asks a streaming engine for when the client did not, and the usage-only chunk
of such a stream, which the client does not see.

- The estimate: the prompt at one token per PROMPT_BYTES_PER_TOKEN bytes of
  the request body, plus the answer's bound (`max_completion_tokens`,
  `max_tokens` or llama.cpp's `n_predict`, times `n`; DEFAULT_OUTPUT when it
  names none).
- A streamed OpenAI-style request (`/v1/chat/completions`, `/v1/completions`)
  of a key with a `tpm` is sent with `stream_options.include_usage: true`; the
  engine's last chunk then carries the usage (and no choices). Unless the
  client asked for it itself, that chunk is taken out of what it receives
  (`UsageStrip`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PROMPT_BYTES_PER_TOKEN = 4   # a token is about four characters of English text
DEFAULT_OUTPUT = 1024        # the answer's tokens, reserved when a request names no bound
OPENAI_STREAMS = frozenset({"/v1/chat/completions", "/v1/completions"})
HELD_EVENT = 64 * 1024       # an unfinished event held longer than this passes as it is
_EVENT_END = re.compile(rb"\r?\n\r?\n")


@dataclass(frozen=True)
class Estimate:
    """A request's tokens as guessed before it runs: its prompt and its answer's bound."""

    prompt: int
    output: int

    @property
    def total(self) -> int:
        return self.prompt + self.output


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def estimate(body: dict[str, Any], size: int) -> Estimate:
    """The estimate for a request whose (JSON) body is `body`, `size` bytes long."""
    output = next((n for name in ("max_completion_tokens", "max_tokens", "n_predict")
                   if (n := _count(body.get(name))) is not None), DEFAULT_OUTPUT)
    choices = _count(body.get("n"))
    return Estimate(size // PROMPT_BYTES_PER_TOKEN, output * max(1, min(choices or 1, 128)))


def with_usage(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """`body` asking for the stream's usage, when it is a streamed OpenAI-style
    request that does not ask for it itself; None otherwise (sent as it is)."""
    if path not in OPENAI_STREAMS or body.get("stream") is not True:
        return None
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return None     # asked for already, or the engine's to refuse
    return {**body, "stream_options": {**options, "include_usage": True}}


def _usage_only(event: bytes) -> bool:
    """Whether an SSE event is a chunk with no choices and a usage object."""
    if b'"usage"' not in event:
        return False
    data = b"".join(line[5:].lstrip(b" ") for line in event.splitlines()
                    if line.startswith(b"data:"))
    try:
        doc = json.loads(data)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("choices") == [] and \
        isinstance(doc.get("usage"), dict)


class UsageStrip:
    """An OpenAI-style event stream less its usage-only chunk: `feed` takes what
    the engine sent and returns what the client gets (whole events; an
    unfinished one is held until it ends, up to HELD_EVENT bytes), `flush` what
    is left at the end."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        data = self._pending + data if self._pending else data
        ends = [m.end() for m in _EVENT_END.finditer(data)]
        if not ends:
            self._pending = b"" if len(data) > HELD_EVENT else data
            return data if len(data) > HELD_EVENT else b""
        self._pending = data[ends[-1]:]
        kept, start = [], 0
        for end in ends:
            if not _usage_only(data[start:end]):
                kept.append(data[start:end])
            start = end
        return b"".join(kept)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest
