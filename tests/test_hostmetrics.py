"""The managed hosts' gauges in /metrics (observe/hostmetrics.py) and the engine exits
counter (observe/metrics.py), from a fake fleet snapshot: GPU figures with {host, gpu}
labels, nothing for a figure the agent could not read, nothing from a watch that is down,
and the supervision records."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmproxy.core.events import EngineExit
from llmproxy.observe.hostmetrics import HostMetrics
from llmproxy.observe.metrics import Metrics

MIB = 2**20
RTX = {"index": 0, "name": "NVIDIA GeForce RTX 4090", "memory_used_bytes": 1024 * MIB,
       "memory_total_bytes": 24564 * MIB, "utilization_ratio": 0.37,
       "temperature_celsius": 45.0, "power_watts": 123.45}
A100 = {"index": 1, "name": "NVIDIA A100-SXM4-80GB", "memory_used_bytes": 81000 * MIB,
        "memory_total_bytes": 81920 * MIB, "utilization_ratio": 1.0,
        "temperature_celsius": 71.0, "power_watts": None}


def watch(*gpus: dict[str, Any], connected: bool = True) -> dict[str, Any]:
    return {"connected": connected, "last_error": None if connected else "ssh: refused",
            "down_seconds": None if connected else 3.0, "healthy": {}, "gpus": list(gpus)}


def scrape(snapshot: dict[str, dict[str, Any]]) -> tuple[bytes, dict[tuple[str, ...], float]]:
    """The exposition, and each sample as (name, label values...) -> value."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(HostMetrics(lambda: snapshot))
    text = generate_latest(registry)
    samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            samples[(s.name, *(f"{k}={v}" for k, v in sorted(s.labels.items())))] = s.value
    return text, samples


def test_gpu_figures_are_labelled_by_host_and_index() -> None:
    """Each GPU of a connected watch: memory in bytes, utilization as a ratio, temperature,
    power, and its name in llmproxy_gpu_info; a null figure (the A100's power) has no
    sample at all, not a 0; HELP and TYPE say what each one is."""
    text, got = scrape({"gpu1": {"watch": watch(RTX, A100), "supervision": {}}})
    assert got[("llmproxy_gpu_memory_used_bytes", "gpu=0", "host=gpu1")] == 1024 * MIB
    assert got[("llmproxy_gpu_memory_total_bytes", "gpu=1", "host=gpu1")] == 81920 * MIB
    assert got[("llmproxy_gpu_utilization_ratio", "gpu=0", "host=gpu1")] == 0.37
    assert got[("llmproxy_gpu_temperature_celsius", "gpu=1", "host=gpu1")] == 71.0
    assert got[("llmproxy_gpu_power_watts", "gpu=0", "host=gpu1")] == 123.45
    assert ("llmproxy_gpu_power_watts", "gpu=1", "host=gpu1") not in got
    assert got[("llmproxy_gpu_info", "gpu=1", "host=gpu1", "name=NVIDIA A100-SXM4-80GB")] == 1
    assert got[("llmproxy_host_watch_connected", "host=gpu1")] == 1
    assert b"# HELP llmproxy_gpu_memory_used_bytes GPU memory in use, in bytes" in text
    assert b"# TYPE llmproxy_gpu_utilization_ratio gauge" in text


def test_no_gpu_series_without_gpus_or_while_the_watch_is_down() -> None:
    """A host without nvidia-smi (no GPUs) and a host whose watch is down (its GPUs are
    of a session that ended) have no GPU series; the watch gauge says 0 for the second;
    a host without a watch (not managed over ssh) has no watch gauge."""
    _, got = scrape({"gpu1": {"watch": watch()}, "gpu2": {"watch": watch(RTX, connected=False)},
                     "gpu3": {"supervision": {}}})
    assert not [k for k in got if k[0].startswith("llmproxy_gpu_")], got
    assert got[("llmproxy_host_watch_connected", "host=gpu1")] == 1
    assert got[("llmproxy_host_watch_connected", "host=gpu2")] == 0
    assert ("llmproxy_host_watch_connected", "host=gpu3") not in got


def test_what_the_agent_sent_wrong_is_left_out() -> None:
    """A figure that is not a finite number (text, a boolean, NaN, infinity), a GPU
    without a whole index, and a second GPU with an index already seen give no sample:
    a broken agent never makes the scrape invalid or reports a made-up 0."""
    bad = [{**RTX, "memory_used_bytes": "1024", "utilization_ratio": True,
            "temperature_celsius": float("nan"), "power_watts": float("inf")},
           {**RTX, "index": "1"}, {**RTX, "index": -1}, {**RTX, "index": True},
           {**RTX, "memory_total_bytes": 1}, "not a GPU"]
    _, got = scrape({"gpu1": {"watch": watch(*bad)}})
    gpus = {k: v for k, v in got.items() if k[0].startswith("llmproxy_gpu_")}
    assert gpus == {("llmproxy_gpu_memory_total_bytes", "gpu=0", "host=gpu1"): 24564 * MIB,
                    ("llmproxy_gpu_info", "gpu=0", "host=gpu1",
                     "name=NVIDIA GeForce RTX 4090"): 1}, gpus


def test_supervision_records_become_crashes_and_failed() -> None:
    """An engine with a crash history: its crashes within the window, and failed 1 when
    its state is failed, 0 otherwise (restarting or ok); engines without one have none."""
    supervision = {
        "c": {"state": "failed", "crashes": 5, "last_exit": "exit status 3",
              "last_line": "CUDA out of memory", "restart_in_seconds": None},
        "a": {"state": "restarting", "crashes": 1, "last_exit": "signal 9",
              "last_line": None, "restart_in_seconds": 0.7}}
    _, got = scrape({"gpu1": {"watch": watch(), "supervision": supervision}})
    assert got[("llmproxy_engine_crashes", "engine=c", "host=gpu1")] == 5
    assert got[("llmproxy_engine_failed", "engine=c", "host=gpu1")] == 1
    assert got[("llmproxy_engine_crashes", "engine=a", "host=gpu1")] == 1
    assert got[("llmproxy_engine_failed", "engine=a", "host=gpu1")] == 0
    assert len([k for k in got if k[0] == "llmproxy_engine_failed"]) == 2


def test_registering_takes_no_snapshot() -> None:
    """The registry learns the names from describe(): the fleet is not asked until a scrape."""
    asked = []
    registry = CollectorRegistry(auto_describe=True)
    registry.register(HostMetrics(lambda: asked.append(1) or {}))
    assert asked == []
    generate_latest(registry)
    assert asked == [1]


def test_each_engine_exit_counts() -> None:
    """llmproxy_engine_exits_total{host,engine} moves once per engine.exit event."""
    metrics = Metrics(lambda name: True, dict, lambda: 1)
    for _ in range(2):
        metrics(EngineExit(0.0, "gpu1", "c", "exit status 3", ("CUDA out of memory",), 1.0))
    text = metrics.exposition().decode()
    assert 'llmproxy_engine_exits_total{engine="c",host="gpu1"} 2.0' in text
