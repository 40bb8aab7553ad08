"""The energy meter's figures in /metrics (observe/energy.py): joules of requests by model
and key, of each host's engines loading and idle, each host's measured total and its power
now. Model names come from the catalog's routes (a request for an unknown model never
reaches an engine) and key names from the keys file, so the label sets stay bounded."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmproxy.observe.energy import Energy


class EnergyMetrics(Collector):
    """A collector reading the meter when /metrics is scraped."""

    def __init__(self, energy: Energy) -> None:
        self._energy = energy

    def collect(self) -> Iterator[Metric]:
        used = CounterMetricFamily("llmproxy_energy_joules", "GPU energy apportioned to "
                                   "requests, by model and API key (- : none)",
                                   labels=["model", "key"])
        for (model, key), joules in sorted(self._energy.by_use.items()):
            used.add_metric([model, key], joules)
        yield used
        load = CounterMetricFamily("llmproxy_engine_load_energy_joules", "GPU energy drawn "
                                   "while an engine started, with no request in flight",
                                   labels=["host", "engine"])
        idle = CounterMetricFamily("llmproxy_engine_idle_energy_joules", "GPU energy drawn "
                                   "with no request in flight and no start, by the engines "
                                   "running (- : none)", labels=["host", "engine"])
        measured = CounterMetricFamily("llmproxy_host_energy_joules", "GPU energy measured "
                                       "on a managed host (power.draw, held between samples)",
                                       labels=["host"])
        power = GaugeMetricFamily("llmproxy_host_power_watts", "The last power.draw sampled "
                                  "on a managed host, summed over its GPUs", labels=["host"])
        for name, meter in sorted(self._energy.hosts.items()):
            if meter.sampled_at is None:
                continue              # never measured: no figure rather than a zero
            meter.close()
            for engine, joules in sorted(meter.loading.items()):
                load.add_metric([name, engine], joules)
            for engine, joules in sorted(meter.idle.items()):
                idle.add_metric([name, engine], joules)
            measured.add_metric([name], meter.measured)
            if meter.watts is not None:
                power.add_metric([name], meter.watts)
        yield from (load, idle, measured, power)
