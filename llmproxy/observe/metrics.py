"""`GET /metrics`: Prometheus metrics made from hub events, by prometheus_client.

Counters and histograms move as events are published; what is a state rather
than a count (requests in flight per host, the process generation) is read at
scrape time. Label values stay bounded: a model name nobody configured or any
roster lists is counted as `model="unknown"`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmproxy import __version__
from llmproxy.core.events import (
    EngineExit,
    EngineSwitch,
    Event,
    IdleStop,
    ReloadDone,
    RequestEnded,
    RosterRead,
    UpgradeStage,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
SWITCH_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class _State(Collector):
    """What is read at scrape time."""

    def __init__(self, in_flight: Callable[[], Mapping[str, int]],
                 generation: Callable[[], int]) -> None:
        self._in_flight = in_flight
        self._generation = generation

    def collect(self) -> Iterable[GaugeMetricFamily]:
        flights = GaugeMetricFamily("llmproxy_requests_in_flight",
                                    "Requests being answered, by host", labels=["host"])
        for host, n in sorted(self._in_flight().items()):
            flights.add_metric([host], n)
        yield flights
        yield GaugeMetricFamily("llmproxy_generation",
                                "Upgrades this listening socket has seen, plus one",
                                value=self._generation())


class Metrics:
    """A hub subscriber that keeps the proxy's Prometheus metrics."""

    def __init__(self, known_model: Callable[[str], bool],
                 in_flight: Callable[[], Mapping[str, int]],
                 generation: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._known = known_model
        r = self.registry
        # The process's own, as every Python exporter has them: its CPU time,
        # memory and open files (process_*), its Python (python_info) and the
        # garbage collector's work (python_gc_*).
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter("llmproxy_requests", "Requests answered",
                                ["model", "host", "status", "outcome"], registry=r)
        self.duration = Histogram("llmproxy_request_duration_seconds",
                                  "Time from arrival to the end of the answer", ["model"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("llmproxy_time_to_first_byte_seconds",
                              "Time from arrival to the first byte sent to the client",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.relayed = Counter("llmproxy_relayed_bytes", "Bytes sent to clients", ["host"],
                               registry=r)
        self.tokens = Counter("llmproxy_tokens", "Tokens the engines reported (usage)",
                              ["model", "kind"], registry=r)
        self.switches = Counter("llmproxy_engine_switches", "Engine switches",
                                ["host", "engine", "outcome"], registry=r)
        self.switch_time = Histogram("llmproxy_engine_switch_duration_seconds",
                                     "How long engine switches took", ["host", "engine"],
                                     buckets=SWITCH_BUCKETS, registry=r)
        self.exits = Counter("llmproxy_engine_exits",
                             "Managed engines that died without the proxy stopping them",
                             ["host", "engine"], registry=r)
        self.idle_stops = Counter("llmproxy_idle_stops", "Engines stopped for idleness",
                                  ["host"], registry=r)
        self.rosters = Counter("llmproxy_roster_reads", "Roster reads", ["host", "outcome"],
                               registry=r)
        self.reloads = Counter("llmproxy_reloads", "Config reloads", ["outcome"], registry=r)
        self.upgrades = Counter("llmproxy_upgrades", "Upgrades started by this process",
                                ["outcome"], registry=r)
        Gauge("llmproxy_build_info", "The running version", ["version"],
              registry=r).labels(__version__).set(1)
        r.register(_State(in_flight, generation))

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestEnded):
            self._request(event)
        elif isinstance(event, EngineSwitch) and event.stage in ("done", "failed"):
            self.switches.labels(event.host, event.engine, event.stage).inc()
            if event.elapsed is not None:
                self.switch_time.labels(event.host, event.engine).observe(event.elapsed)
        elif isinstance(event, EngineExit):
            self.exits.labels(event.host, event.engine).inc()
        elif isinstance(event, IdleStop) and event.stage == "done":
            self.idle_stops.labels(event.host).inc()
        elif isinstance(event, RosterRead):
            self.rosters.labels(event.host, event.outcome).inc()
        elif isinstance(event, ReloadDone):
            self.reloads.labels(event.outcome).inc()
        elif isinstance(event, UpgradeStage) and event.stage in ("handed_over", "failed"):
            self.upgrades.labels(event.stage).inc()

    def _request(self, e: RequestEnded) -> None:
        if e.model is None:     # not an API request: health, status, metrics, events
            return
        model = e.model if e.host is not None and self._known(e.model) else "unknown"
        host = e.host or "-"
        child = self._child
        child(self.requests, model, host, str(e.status or "-"), e.outcome).inc()
        child(self.duration, model).observe(e.duration)
        if e.ttfb is not None:
            child(self.ttfb, model).observe(e.ttfb)
        child(self.relayed, host).inc(e.bytes)
        if e.prompt_tokens is not None:
            child(self.tokens, model, "prompt").inc(e.prompt_tokens)
        if e.completion_tokens is not None:
            child(self.tokens, model, "completion").inc(e.completion_tokens)

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once per label set (the lookup
        costs more than the update; the set is what the metric holds anyway)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
