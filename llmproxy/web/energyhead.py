"""The energy a request used, said in its answer's head (docs/energy.md): on a non-streamed
answer, `X-LLMProxy-Energy-Joules`, the joules up to the head (observe/energy.py's
provisional share); a stream's head comes before its tokens, so it has none. The body is
never changed."""

from __future__ import annotations

from collections.abc import Callable

from twisted.web.server import Request

from llmproxy.observe.inflight import Exchange

ENERGY_HEADER = b"x-llmproxy-energy-joules"


def say_energy(request: Request, exchange: Exchange,
               so_far: Callable[[str], float | None]) -> None:
    """Set the header on `request`'s head when its energy is measured and it is not a stream."""
    joules = None if exchange.streaming else so_far(exchange.id)
    if joules is not None:
        request.setHeader(ENERGY_HEADER, f"{joules:.3f}".encode())
