"""The capacity part of `GET /metrics`: queues, cordons, residency, replica
choices and engine commands, in the same registry as `metrics`.

Counters move with hub events (queue waits and rejections, failovers,
fallbacks, replica choices, switch waits, engine commands); what is a state (queue depth, slots,
cordons, residency left) is read from the hosts' queues at scrape time. Label
values stay bounded: host names and catalog model names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmproxy.core.capacity import (
    EngineCommand,
    Failover,
    Queued,
    QueueLeft,
    QueueRejected,
    ReplicaChosen,
)
from llmproxy.core.events import EngineSwitch, Event, RouteFallback
from llmproxy.hosts.host import Host

GIB = 2 ** 30
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _HostState(Collector):
    """Each host's queue depth, slots, cordon and residency left, read at scrape time."""

    def __init__(self, gates: Callable[[], Mapping[str, Host]],
                 clock: Callable[[], float]) -> None:
        self._gates = gates
        self._clock = clock

    def collect(self) -> Iterable[GaugeMetricFamily]:
        depth = GaugeMetricFamily("llmproxy_queue_depth",
                                  "Requests waiting in a host's queue", labels=["host"])
        slots = GaugeMetricFamily("llmproxy_host_max_concurrent",
                                  "Requests a host serves at once (hosts with a limit)",
                                  labels=["host"])
        cordoned = GaugeMetricFamily("llmproxy_host_cordoned",
                                     "1 while a host is cordoned", labels=["host"])
        resident = GaugeMetricFamily("llmproxy_engine_resident_seconds",
                                     "Residency left of a managed host's engine",
                                     labels=["host"])
        now = self._clock()
        for name, gate in sorted(self._gates().items()):
            depth.add_metric([name], gate.queued())
            limit = gate.limit()
            if limit is not None:
                slots.add_metric([name], limit)
            cordoned.add_metric([name], 1 if gate.cordoned else 0)
            if gate.host.managed:
                until = gate.resident_until
                resident.add_metric([name], max(0.0, until - now) if until else 0.0)
        yield from (depth, slots, cordoned, resident)
        yield from self._residency()

    def _residency(self) -> Iterable[GaugeMetricFamily]:
        """Which engines are on each managed host, and a budgeted host's memory in use."""
        engines = GaugeMetricFamily("llmproxy_engine_resident",
                                    "1 for each engine running on a managed host",
                                    labels=["host", "engine"])
        memory = GaugeMetricFamily("llmproxy_host_memory_used_gb",
                                   "The memory_gb of the engines on a budgeted host "
                                   "(being stopped included)", labels=["host"])
        figures = GaugeMetricFamily("llmproxy_engine_memory_bytes",
                                    "A managed engine's GPU memory: its memory_gb (declared) "
                                    "and what the agent measured (measured)",
                                    labels=["host", "engine", "source"])
        for name, gate in sorted(self._gates().items()):
            for engine in gate.running_engines() if gate.host.managed else ():
                engines.add_metric([name, engine], 1)
            if gate.host.budgeted:
                memory.add_metric([name], gate.memory_used())
            for engine, preset in sorted(gate.host.engines.items()):
                measured = gate.measured_gb(engine)
                for source, gb in (("declared", preset.memory_gb), ("measured", measured)):
                    if gb is not None:
                        figures.add_metric([name, engine, source], round(gb * GIB))
        yield from (engines, memory, figures)


class CapacityMetrics:
    """A hub subscriber that keeps the capacity metrics in `registry`."""

    def __init__(self, registry: CollectorRegistry, gates: Callable[[], Mapping[str, Host]],
                 clock: Callable[[], float]) -> None:
        r = registry
        self.waits = Counter("llmproxy_queue_waits", "Requests that had to wait in a queue",
                             ["host", "reason"], registry=r)
        self.waited = Histogram("llmproxy_queue_wait_seconds",
                                "How long served requests waited in a host's queue", ["host"],
                                buckets=WAIT_BUCKETS, registry=r)
        self.rejections = Counter("llmproxy_queue_rejections", "Requests a queue refused",
                                  ["host", "reason"], registry=r)
        self.choices = Counter("llmproxy_replica_choices", "Hosts chosen for a replicated model",
                               ["model", "host", "reason"], registry=r)
        self.failovers = Counter("llmproxy_failovers",
                                 "Requests moved on from a host nothing was sent to", ["host"],
                                 registry=r)
        self.fallbacks = Counter("llmproxy_fallbacks",
                                 "Requests handed to a fallback model, nothing sent",
                                 ["model", "fallback"], registry=r)
        self.switch_waits = Counter("llmproxy_engine_switch_waits",
                                    "Switches that had to wait (busy, protected, residency)",
                                    ["host", "reason"], registry=r)
        self.commands = Counter("llmproxy_engine_commands",
                                "Operator engine commands and preloads", ["host", "op", "outcome"],
                                registry=r)
        r.register(_HostState(gates, clock))

    def __call__(self, event: Event) -> None:
        if isinstance(event, Queued):
            self.waits.labels(event.host, event.reason).inc()
        elif isinstance(event, QueueLeft) and event.outcome == "served":
            self.waited.labels(event.host).observe(event.waited)
        elif isinstance(event, QueueRejected):
            self.rejections.labels(event.host, event.reason).inc()
        elif isinstance(event, ReplicaChosen):
            self.choices.labels(event.model, event.host, event.reason).inc()
        elif isinstance(event, Failover):
            self.failovers.labels(event.host).inc()
        elif isinstance(event, RouteFallback):
            self.fallbacks.labels(event.model, event.fallback).inc()
        elif isinstance(event, EngineSwitch) and event.stage == "waiting":
            self.switch_waits.labels(event.host, event.reason or "busy").inc()
        elif isinstance(event, EngineCommand) and event.stage in ("done", "failed"):
            self.commands.labels(event.host, event.op, event.stage).inc()
