"""Status that follows the engines, for real (twistd llmproxy, a managed host over a real
sshd on 127.0.0.1): the roster of a host whose engine was not running at start-up reads
failed; within a second of its engine's `ready` line, /status says "ok" and
/v1/models lists what the engine serves, without waiting for the periodic refresh."""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests import sshd as sshd_harness
from tests.managed import managed_config, managed_host, sim_command
from tests.procs import ROOT, Proxy, free_port, wait_until

pytestmark = pytest.mark.integration


def config(sshd: sshd_harness.SSHD, tmp_path: Path) -> dict[str, Any]:
    port = free_port()
    host = managed_host(sshd, tmp_path, port, {
        "a": {"command": sim_command(port, "ma,extra"), "start_timeout_seconds": 20}})
    return managed_config(sshd, tmp_path, [host], {"ma": {"host": "gpu1", "engine": "a"}})


def roster_of(proxy: Proxy) -> dict[str, Any]:
    doc: dict[str, Any] = proxy.get_json("/status")["hosts"][0]["roster"]
    return doc


def model_ids(proxy: Proxy) -> list[str]:
    return [m["id"] for m in proxy.get_json("/v1/models")["data"]]


def test_status_and_models_follow_an_engine_within_a_second(sshd: sshd_harness.SSHD,
                                                           tmp_path: Path) -> None:
    """Nothing runs at start-up: the roster read failed and `extra` (served by the engine,
    not named in the catalog) is not listed. A request starts the engine; within a second
    of its ready line the roster is "ok" with the engine's models and /v1/models lists
    `extra` (the periodic refresh is 600 s away)."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        proxy.wait_for(r"watching the engines of gpu1", timeout=20)
        assert roster_of(proxy)["state"] in ("never read", "failed")
        assert roster_of(proxy)["last_error"]
        assert "extra" not in model_ids(proxy)
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": "ma"}))
        assert conn.getresponse().status == 200
        proxy.wait_for(r"engine a on gpu1 ready in", timeout=5)
        ready = time.monotonic()
        assert wait_until(lambda: roster_of(proxy)["state"] == "ok", timeout=1), \
            roster_of(proxy)
        assert time.monotonic() - ready < 1.0
        assert sorted(roster_of(proxy)["models"]) == ["extra", "ma"]
        assert "extra" in model_ids(proxy)
    finally:
        proxy.stop()
        done = sshd.run("env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "llmproxy.agent",
                        "--state-dir", str(tmp_path / "agent"), "stop", "--host", "gpu1",
                        input="")
        assert done.returncode == 0, done.stderr
