"""The sleep and wake part of `GET /metrics` (hosts/sleepwake.py): a hub subscriber
that counts the sleeps and wakes, and a gauge of each such host's state read at scrape
time from the fleet's snapshot (`/status`'s ``engine.sleep``).

- `llmproxy_host_sleep_state{host,state}`: 1 for the state the host is in (awake,
  sleeping, asleep, waking), 0 for the others.
- `llmproxy_host_sleeps_total{host,why}`: sleep orders its agent carried out (idle, operator).
- `llmproxy_host_wakes_total{host,outcome}`: wakes done or failed (timed out).
- `llmproxy_host_wake_seconds{host}`: how long the last wake that woke the host took.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmproxy.core.events import Event
from llmproxy.core.sleepwake import HostSlept, HostWoke
from llmproxy.hosts.sleepwake import ASLEEP, AWAKE, SLEEPING, WAKING

STATES = (AWAKE, SLEEPING, ASLEEP, WAKING)
Snapshot = Callable[[], Mapping[str, Mapping[str, Any]]]


class SleepState(Collector):
    """`llmproxy_host_sleep_state`, from `snapshot()` at scrape time."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = self._family()
        for host, doc in sorted(self._snapshot().items()):
            sleep = doc.get("sleep")
            if isinstance(sleep, Mapping):
                for state in STATES:
                    family.add_metric([host, state], 1 if sleep.get("state") == state else 0)
        return [family]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily("llmproxy_host_sleep_state",
                                 "1 for the sleep state a host that sleeps is in",
                                 labels=["host", "state"])


class SleepMetrics:
    """A hub subscriber keeping the sleep and wake counters in `registry`, which also
    gets the state gauge."""

    def __init__(self, registry: CollectorRegistry, snapshot: Snapshot) -> None:
        registry.register(SleepState(snapshot))
        self._sleeps = Counter("llmproxy_host_sleeps", "Hosts put to sleep by their agent",
                               ["host", "why"], registry=registry)
        self._wakes = Counter("llmproxy_host_wakes", "Wakes of hosts that slept, by outcome",
                              ["host", "outcome"], registry=registry)
        self._took = Gauge("llmproxy_host_wake_seconds",
                           "Seconds the last successful wake of a host took", ["host"],
                           registry=registry)

    def __call__(self, event: Event) -> None:
        if isinstance(event, HostSlept) and event.refused is None:
            self._sleeps.labels(event.host, event.why).inc()
        elif isinstance(event, HostWoke) and event.stage != "begun":
            self._wakes.labels(event.host, event.stage).inc()
            if event.stage == "done" and event.elapsed is not None:
                self._took.labels(event.host).set(event.elapsed)
