"""Measured GPU memory for real: twistd llmproxy manages a budgeted host through a real sshd on
127.0.0.1, the real agent finds a fake nvidia-smi (llmproxy/testing/nvidiasmi.py) first on its
PATH and reports the per-process memory of the engine's session; the figure reaches /status
and /metrics, one far above the declared memory_gb is a warning, and it survives a SIGHUP and
an upgrade (SIGUSR1) from runtime_dir/memory.json while nvidia-smi no longer says it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from llmproxy.testing.nvidiasmi import FakeNvidiaSmi
from tests import sshd as sshd_harness
from tests.procs import ROOT, Proxy, stop_successor, wait_new_pid, wait_until
from tests.test_integration_gpu import samples
from tests.test_integration_residency import GB, agent_status, answered, config, stop_engines

pytestmark = pytest.mark.integration

GIB = 2**30


def resident(proxy: Proxy, engine: str) -> dict[str, Any] | None:
    rows = proxy.get_json("/status")["hosts"][0]["engine"].get("resident", [])
    return next((r for r in rows if r["engine"] == engine), None)


def test_a_measured_figure_reaches_status_metrics_and_outlives_reload_and_upgrade(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """Engine a (memory_gb 4) measured at 6 GiB by nvidia-smi's per-process query: /status
    shows 4 declared and 6 measured (and counts 6), /metrics has both figures in bytes, the log
    warns naming both; with nvidia-smi silent from then on, the figure is still there after a
    SIGHUP and in the successor of a SIGUSR1 upgrade."""
    smi = FakeNvidiaSmi(tmp_path / "smi")
    doc = config(sshd, tmp_path, "ab", 8)
    path = f"{smi.directory}{os.pathsep}/usr/local/bin:/usr/bin:/bin"
    doc["hosts"][0]["agent"] = ["env", f"PATH={path}", f"PYTHONPATH={ROOT}", sys.executable,
                                "-m", "llmproxy.agent", "--state-dir", str(tmp_path / "agent")]
    proxy = Proxy(doc, tmp_path)
    successor = None
    try:
        assert answered(proxy.port, "ma")
        smi.apps({agent_status(sshd, tmp_path)["a"]["engine_pid"]: 6 * 1024, 1: 99})
        row = wait_until(lambda: (r := resident(proxy, "a")) and
                         r["measured_memory_gb"] is not None and r, timeout=15)
        assert row and (row["declared_memory_gb"], row["measured_memory_gb"],
                        row["memory_gb"]) == (GB, 6.0, 6.0), row
        got = samples(proxy)
        assert got[("llmproxy_engine_memory_bytes", "engine=a", "host=gpu1",
                    "source=measured")] == 6 * GIB
        assert got[("llmproxy_engine_memory_bytes", "engine=a", "host=gpu1",
                    "source=declared")] == GB * GIB
        assert ("llmproxy_engine_memory_bytes", "engine=b", "host=gpu1",
                "source=measured") not in got
        proxy.wait_for(r"engine a on gpu1 holds 6\.00 GiB of GPU memory, its memory_gb says 4")
        smi.apps_text("")
        proxy.signal(signal.SIGHUP)
        proxy.wait_for(r"reload: applied nothing")
        assert (resident(proxy, "a") or {}).get("measured_memory_gb") == 6.0
        proxy.signal(signal.SIGUSR1)
        successor = wait_new_pid(proxy, proxy.pid)
        assert proxy.popen.wait(20) == 0
        assert proxy.serving_pid() == successor
        row = wait_until(lambda: resident(proxy, "a"), timeout=15)
        assert row and row["measured_memory_gb"] == 6.0, row
        assert samples(proxy)[("llmproxy_engine_memory_bytes", "engine=a", "host=gpu1",
                               "source=measured")] == 6 * GIB
    finally:
        proxy.stop()
        stop_successor(successor)
        stop_engines(sshd, tmp_path)
