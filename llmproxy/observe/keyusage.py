"""Per-key usage: requests, tokens and energy (observe/energy.py) counted by
API key name, from the hub's request ends, for `/status` (`keys`) and `/metrics`
(`llmproxy_key_requests_total{key,status}`, `llmproxy_key_tokens_total{key,kind}`,
and `llmproxy_ratelimited_total{key,type}` from the rate limits' refusals).
Key names come from the keys file, so the label set stays bounded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from llmproxy.core.capacity import RateLimited
from llmproxy.core.events import Event, RequestEnded


@dataclass
class _Usage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    energy_joules: float = 0.0      # of its requests whose GPUs' energy was measured
    last_at: float | None = None


class KeyUsage:
    """A hub subscriber: what each key has asked for since the process started."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._usage: dict[str, _Usage] = {}
        registry = registry or CollectorRegistry()
        self._requests = Counter("llmproxy_key_requests", "Requests answered, by API key",
                                 ["key", "status"], registry=registry)
        self._tokens = Counter("llmproxy_key_tokens", "Tokens the engines reported, by API key",
                               ["key", "kind"], registry=registry)
        self._limited = Counter("llmproxy_ratelimited", "Requests refused by a key's rate "
                                "limit (type: requests or tokens)", ["key", "type"],
                                registry=registry)

    def __call__(self, event: Event) -> None:
        if isinstance(event, RateLimited):
            self._limited.labels(event.key, event.limit).inc()
            return
        if not isinstance(event, RequestEnded) or event.key is None:
            return
        usage = self._usage.setdefault(event.key, _Usage())
        usage.requests += 1
        usage.last_at = event.time
        self._requests.labels(event.key, str(event.status or "-")).inc()
        if event.prompt_tokens is not None:
            usage.prompt_tokens += event.prompt_tokens
            self._tokens.labels(event.key, "prompt").inc(event.prompt_tokens)
        if event.energy_joules is not None:
            usage.energy_joules += event.energy_joules
        if event.completion_tokens is not None:
            usage.completion_tokens += event.completion_tokens
            self._tokens.labels(event.key, "completion").inc(event.completion_tokens)

    def snapshot(self, names: list[str], now: float) -> list[dict[str, Any]]:
        """One entry per configured key (in file order), then any that has gone
        from the file but was used by this process."""
        order = names + [n for n in self._usage if n not in names]
        out = []
        for name in order:
            u = self._usage.get(name, _Usage())
            out.append({"name": name, "configured": name in names, "requests": u.requests,
                        "prompt_tokens": u.prompt_tokens,
                        "completion_tokens": u.completion_tokens,
                        "energy_joules": round(u.energy_joules, 3),
                        "last_seconds_ago": None if u.last_at is None
                        else round(now - u.last_at, 3)})
        return out
