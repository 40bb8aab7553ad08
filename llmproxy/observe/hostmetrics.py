"""The managed hosts' part of `GET /metrics`: what each host's watch and
supervisor say, read at scrape time from the fleet's snapshot (the per-host
document `/status` shows as `engine`: its `watch` and `supervision`).

- `llmproxy_host_watch_connected{host}`: 1 while the host's watch session is up.
- Per GPU, labelled `{host, gpu}` (gpu: the index nvidia-smi gives it): memory
  used and total in bytes, utilization as a ratio from 0 to 1, temperature in
  degrees Celsius, power in watts, and `llmproxy_gpu_info{host,gpu,name}`. Only
  a host whose watch is connected has them (a session that ended says nothing
  current); a host without nvidia-smi has none; a figure the agent could not
  read (null) is left out, never reported as 0.
- Per engine with a crash history, `{host, engine}`: its crashes within the
  crash window and whether it has `failed` (1) or not (0).

Whatever the agent sent is checked here: a figure that is not a finite number,
a GPU without a whole index or with an index already seen, is left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

Snapshot = Callable[[], Mapping[str, Mapping[str, Any]]]
GPU_FIGURES = (  # (field of the agent's gpu event, metric, help)
    ("memory_used_bytes", "llmproxy_gpu_memory_used_bytes", "GPU memory in use, in bytes"),
    ("memory_total_bytes", "llmproxy_gpu_memory_total_bytes", "GPU memory size, in bytes"),
    ("utilization_ratio", "llmproxy_gpu_utilization_ratio",
     "GPU utilization, from 0 to 1 (nvidia-smi's utilization.gpu)"),
    ("temperature_celsius", "llmproxy_gpu_temperature_celsius",
     "GPU temperature, in degrees Celsius"),
    ("power_watts", "llmproxy_gpu_power_watts", "GPU power draw, in watts"),
)
NAME_LIMIT = 120    # a GPU's name as a label value


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def gpus_of(watch: Mapping[str, Any] | None) -> list[tuple[str, Mapping[str, Any]]]:
    """(gpu label, the agent's figures) for each GPU a connected watch reports."""
    if not isinstance(watch, Mapping) or watch.get("connected") is not True:
        return []
    seen: dict[str, Mapping[str, Any]] = {}
    for gpu in watch.get("gpus") or ():
        index = gpu.get("index") if isinstance(gpu, Mapping) else None
        if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
            seen.setdefault(str(index), gpu)
    return list(seen.items())


class HostMetrics(Collector):
    """The watch, GPU and supervision gauges, from `snapshot()` (see the module docstring)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[GaugeMetricFamily]:
        """The families without samples: registering never takes a snapshot."""
        return self._families()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families = self._families()
        connected, info, *figures, crashes, failed = families
        for host, doc in sorted(self._snapshot().items()):
            watch = doc.get("watch")
            if isinstance(watch, Mapping):
                connected.add_metric([host], 1 if watch.get("connected") is True else 0)
            for gpu, said in gpus_of(watch):
                info.add_metric([host, gpu, str(said.get("name") or "")[:NAME_LIMIT]], 1)
                for family, (key, _, _) in zip(figures, GPU_FIGURES, strict=True):
                    value = _number(said.get(key))
                    if value is not None:
                        family.add_metric([host, gpu], value)
            for engine, record in sorted((doc.get("supervision") or {}).items()):
                if not isinstance(record, Mapping):
                    continue
                crashes.add_metric([host, engine], _number(record.get("crashes")) or 0)
                failed.add_metric([host, engine], 1 if record.get("state") == "failed" else 0)
        return families

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("llmproxy_host_watch_connected",
                              "1 while a managed host's watch session (llmproxy-agent watch "
                              "over ssh) is up, 0 while it is down", labels=["host"]),
            GaugeMetricFamily("llmproxy_gpu_info", "A GPU of a managed host, by name",
                              labels=["host", "gpu", "name"]),
            *(GaugeMetricFamily(metric, text, labels=["host", "gpu"])
              for _, metric, text in GPU_FIGURES),
            GaugeMetricFamily("llmproxy_engine_crashes",
                              "Crashes of a managed engine within the crash window "
                              "(10 minutes; 5 make it failed)", labels=["host", "engine"]),
            GaugeMetricFamily("llmproxy_engine_failed",
                              "1 while a managed engine is failed after a crash loop "
                              "(until an operator starts it)", labels=["host", "engine"]),
        ]
