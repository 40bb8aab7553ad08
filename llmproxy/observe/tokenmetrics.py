"""The token-latency part of `GET /metrics`, per model and host, in the same
registry as `metrics`: time to first token (from arrival, and from the send to
the engine), the gap between tokens, output tokens per second per stream, and
the prompt rate where the engine reports it (llama-server's `timings`). Made
from `core.tokens.TokensTimed` (measured by `observe.tokentimes`); docs/metrics
has what each figure means. Label values stay bounded as in `metrics`: a model
nobody configured is `unknown`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from llmproxy.core.events import Event
from llmproxy.core.tokens import GAP_BUCKETS, TokensTimed

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 30, 60, 120, 300)
OUTPUT_RATE_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 40, 50, 75, 100, 150, 200, 300, 500, 1000)
PROMPT_RATE_BUCKETS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000)


class _Gaps(Collector):
    """The inter-token gap histogram: each stream's bucket counts, added up per
    (model, host) when it ends (a stream observes its gaps into its own counts,
    never into a shared metric per token)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], list[float]] = {}

    def add(self, labels: tuple[str, str], gaps: tuple[int, ...], total: float) -> None:
        into = self.counts.get(labels)
        if into is None:
            into = self.counts[labels] = [0.0] * (len(GAP_BUCKETS) + 2)
        for i, n in enumerate(gaps):
            into[i] += n
        into[-1] += total

    def collect(self) -> Iterable[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "llmproxy_inter_token_gap_seconds",
            "Time between reads of a stream that carried tokens", labels=["model", "host"])
        for labels, counts in sorted(self.counts.items()):
            running, buckets = 0.0, []
            for bound, n in zip((*map(str, GAP_BUCKETS), "+Inf"), counts[:-1], strict=True):
                running += n
                buckets.append((bound, running))
            family.add_metric(list(labels), buckets, counts[-1])
        yield family


class TokenMetrics:
    """A hub subscriber that keeps the token-latency metrics in `registry`."""

    def __init__(self, registry: CollectorRegistry, known_model: Callable[[str], bool]) -> None:
        r = registry
        self._known = known_model
        labels = ["model", "host"]
        self.ttft = Histogram("llmproxy_time_to_first_token_seconds",
                              "Time from a request's arrival to its first token sent to the "
                              "client (streams)", labels, buckets=TTFT_BUCKETS, registry=r)
        self.engine_ttft = Histogram("llmproxy_engine_time_to_first_token_seconds",
                                     "Time from sending a request to its engine to the first "
                                     "token back (streams)", labels, buckets=TTFT_BUCKETS,
                                     registry=r)
        self.output_rate = Histogram("llmproxy_output_tokens_per_second",
                                     "Output tokens per second of a stream, first token to last",
                                     labels, buckets=OUTPUT_RATE_BUCKETS, registry=r)
        self.prompt_rate = Histogram("llmproxy_prompt_tokens_per_second",
                                     "Prompt tokens per second, as the engine's timings report",
                                     labels, buckets=PROMPT_RATE_BUCKETS, registry=r)
        self.gaps = _Gaps()
        r.register(self.gaps)

    def __call__(self, event: Event) -> None:
        if not isinstance(event, TokensTimed) or event.model is None:
            return
        model = event.model if self._known(event.model) else "unknown"
        host = event.host or "-"
        if event.first_token is not None:
            self.ttft.labels(model, host).observe(event.first_token)
        if event.engine_first_token is not None:
            self.engine_ttft.labels(model, host).observe(event.engine_first_token)
        if event.output_per_second is not None:
            self.output_rate.labels(model, host).observe(event.output_per_second)
        if event.prompt_per_second is not None:
            self.prompt_rate.labels(model, host).observe(event.prompt_per_second)
        if event.tokens > 1:
            self.gaps.add((model, host), event.gaps, event.gap_sum)
