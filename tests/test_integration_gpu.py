"""GPU telemetry and supervision reach /metrics, /status and `llmproxy status` for real:
twistd llmproxy watches its managed host over a long-lived `llmproxy-agent watch` session
through a real sshd on 127.0.0.1, and the agent finds a fake nvidia-smi
(llmproxy/testing/nvidiasmi.py) first on its PATH."""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmproxy.testing.nvidiasmi import GPU, FakeNvidiaSmi
from tests import sshd as sshd_harness
from tests import test_integration_supervision as supervision
from tests.procs import ROOT, Proxy, wait_until

pytestmark = pytest.mark.integration

MIB = 2**20
A100 = GPU(index=1, name="NVIDIA A100-SXM4-80GB", memory_used_mib="81000",
           memory_total_mib="81920", utilization_percent="100", temperature="71",
           power_watts="[N/A]")


def config(sshd: sshd_harness.SSHD, tmp_path: Path, smi: FakeNvidiaSmi) -> dict[str, Any]:
    """The supervision tests' host gpu1, its agent with the fake nvidia-smi first on PATH."""
    doc = supervision.config(sshd, tmp_path)
    path = f"{smi.directory}{os.pathsep}/usr/local/bin:/usr/bin:/bin"
    doc["hosts"][0]["agent"] = ["env", f"PATH={path}", f"PYTHONPATH={ROOT}", sys.executable,
                                "-m", "llmproxy.agent", "--state-dir", str(tmp_path / "agent")]
    return doc


def samples(proxy: Proxy) -> dict[tuple[str, ...], float]:
    """/metrics as (name, label=value...) -> value."""
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, *(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_fake_gpus_figures_reach_metrics_and_status(sshd: sshd_harness.SSHD,
                                                        tmp_path: Path) -> None:
    """Two GPUs answered by the fake nvidia-smi: within seconds of the proxy's start
    /metrics has their memory in bytes, utilization as a ratio, temperature and power,
    labelled host gpu1 and gpu 0 / 1, and no power for the GPU whose driver said [N/A];
    /status has them under the host's watch, and `llmproxy status` one line per GPU."""
    smi = FakeNvidiaSmi(tmp_path / "smi")
    smi.gpus([GPU(), A100])
    proxy = Proxy(config(sshd, tmp_path, smi), tmp_path)
    try:
        started = time.monotonic()
        key = ("llmproxy_gpu_memory_used_bytes", "gpu=1", "host=gpu1")
        got = wait_until(lambda: (s := samples(proxy)) and key in s and s, timeout=10)
        assert got, samples(proxy)
        assert time.monotonic() - started < 10
        assert got[key] == 81000 * MIB
        assert got[("llmproxy_gpu_memory_total_bytes", "gpu=0", "host=gpu1")] == 24564 * MIB
        assert got[("llmproxy_gpu_utilization_ratio", "gpu=0", "host=gpu1")] == 0.37
        assert got[("llmproxy_gpu_temperature_celsius", "gpu=1", "host=gpu1")] == 71.0
        assert got[("llmproxy_gpu_power_watts", "gpu=0", "host=gpu1")] == 123.45
        assert ("llmproxy_gpu_power_watts", "gpu=1", "host=gpu1") not in got
        assert got[("llmproxy_host_watch_connected", "host=gpu1")] == 1
        watch = proxy.get_json("/status")["hosts"][0]["engine"]["watch"]
        assert watch["connected"] is True
        assert [(g["index"], g["name"], g["power_watts"]) for g in watch["gpus"]] == [
            (0, "NVIDIA GeForce RTX 4090", 123.45), (1, "NVIDIA A100-SXM4-80GB", None)]
        said = supervision.cli(proxy, "status").stdout.splitlines()
        assert "    gpu 0 NVIDIA GeForce RTX 4090: 1.0 of 24.0 GiB, 37%, 45 C, 123 W" in said
        assert "    gpu 1 NVIDIA A100-SXM4-80GB: 79.1 of 80.0 GiB, 100%, 71 C" in said
    finally:
        proxy.stop()
        supervision.agent(sshd, tmp_path, "stop", {"grace": 2})


def test_a_killed_engine_shows_in_the_metrics(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """kill -9 of a running engine: llmproxy_engine_exits_total and llmproxy_engine_crashes
    say 1 for gpu1's engine a, llmproxy_engine_failed 0; a host whose nvidia-smi prints
    nothing has no GPU series."""
    smi = FakeNvidiaSmi(tmp_path / "smi")
    smi.prints("")
    proxy = Proxy(config(sshd, tmp_path, smi), tmp_path)
    try:
        supervision.watching(proxy)
        assert supervision.post(proxy.port, "ma")[0] == 200
        os.kill(supervision.running(sshd, tmp_path)["engine_pid"], signal.SIGKILL)
        proxy.wait_for(r"engine a on gpu1 died \(signal 9\)", timeout=5)
        got = samples(proxy)
        assert got[("llmproxy_engine_exits_total", "engine=a", "host=gpu1")] == 1, got
        assert got[("llmproxy_engine_crashes", "engine=a", "host=gpu1")] == 1, got
        assert got[("llmproxy_engine_failed", "engine=a", "host=gpu1")] == 0, got
        assert len(smi.calls) >= 1
        assert not [k for k in got if k[0].startswith("llmproxy_gpu_")], got
    finally:
        proxy.stop()
        supervision.agent(sshd, tmp_path, "stop", {"grace": 2})
