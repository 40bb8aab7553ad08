"""What the simulated engine answers with: error bodies, deterministic words and
embeddings, and the `X-Sim-*` controls of one request (see `simengine`)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twisted.web.server import Request

JSONDict = dict[str, Any]


def sim_error(message: str, code: str | int, type_: str = "invalid_request_error") -> JSONDict:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": type_, "code": code}}


def word(i: int) -> str:
    """The content piece number `i` of an answer: "tok0 ", "tok1 ", ..."""
    return f"tok{i} "


def words(n: int) -> list[str]:
    """The deterministic content pieces of an answer: "tok0 ", "tok1 ", ..."""
    return [word(i) for i in range(n)]


def count_words(value: Any) -> int:
    """A rough token count of a prompt, messages list or embedding input."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(count_words(v) for v in value)
    if isinstance(value, dict):
        return count_words(value.get("content", value.get("text")))
    return 0


def embed(text: str) -> list[float]:
    """Eight floats in [-1, 1] derived from the text: equal texts give equal vectors."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return [
        round(int.from_bytes(digest[2 * i : 2 * i + 2], "big") / 32767.5 - 1, 6) for i in range(8)
    ]


# header, Controls field, parser, lowest and highest accepted value
_CONTROL_HEADERS: tuple[tuple[str, str, Callable[[str], float], float, float], ...] = (
    ("X-Sim-Delay", "delay", float, 0, 86400),
    ("X-Sim-Tokens", "tokens", int, 0, 1_000_000),
    ("X-Sim-Header-Delay", "header_delay", float, 0, 86400),
    ("X-Sim-Die-After", "die_after", int, 0, 1_000_000),
    ("X-Sim-Status", "status", int, 100, 599),
)


@dataclass(frozen=True)
class Controls:
    """The ``X-Sim-*`` overrides of one request; ``problems`` lists unusable headers."""

    delay: float
    tokens: int | None = None
    header_delay: float = 0.0
    die_after: int | None = None
    status: int | None = None
    problems: tuple[str, ...] = ()

    @classmethod
    def parse(cls, request: Request, default_delay: float) -> Controls:
        found: dict[str, Any] = {"delay": default_delay}
        problems = []
        for header, name, kind, low, high in _CONTROL_HEADERS:
            raw = request.getHeader(header)
            if raw is None:
                continue
            try:
                value = kind(raw.strip())
            except ValueError:
                value = math.nan
            if low <= value <= high:
                found[name] = value
            else:
                problems.append(f"bad {header} header: {raw!r}")
        return cls(**found, problems=tuple(problems))
