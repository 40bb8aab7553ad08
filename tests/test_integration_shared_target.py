"""Three managed hosts on one ssh target (one real sshd on 127.0.0.1, one agent state
directory), each with engines of the same names: supervision is per host. A kill -9 of each
host's engine is restarted by that host within 10 s, and a crash loop ends `failed` on
every host, each exit told to the watch of the host whose engine it was."""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests import sshd as sshd_harness
from tests.managed import agent_argv, managed_config, managed_host, sim_command
from tests.procs import Proxy, free_port, wait_until

pytestmark = pytest.mark.integration

HOSTS = ("h1", "h2", "h3")


def host(sshd: sshd_harness.SSHD, tmp_path: Path, name: str) -> dict[str, Any]:
    """A host on the shared target whose engines are named `a` and `c` like every other's:
    `a` a simulated engine, `c` one that exits 3 half a second after its first health check."""
    port = free_port()
    sim = sim_command(port, f"a-{name}")
    crasher = [sys.executable, "-m", "llmproxy.testing.crashengine", "--port", str(port),
               "--model", f"c-{name}", "--crash-after", "0.5", "--exit-status", "3",
               "--say", f"CUDA out of memory on {name}"]
    return managed_host(sshd, tmp_path, port, {"a": {"command": sim, "start_timeout_seconds": 20},
                                               "c": {"command": crasher,
                                                     "start_timeout_seconds": 20}}, name=name)


def config(sshd: sshd_harness.SSHD, tmp_path: Path) -> dict[str, Any]:
    return managed_config(sshd, tmp_path, [host(sshd, tmp_path, name) for name in HOSTS],
                          {f"{e}-{name}": {"host": name, "engine": e}
                           for name in HOSTS for e in ("a", "c")})


def status(sshd: sshd_harness.SSHD, tmp_path: Path, name: str) -> dict[str, int]:
    """What the agent runs for host `name`, asked by hand: engine -> its engine pid."""
    done = sshd.run(*agent_argv(tmp_path / "agent"), "status", "--host", name)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["ok"] is True, answer
    return {e["engine"]: e["engine_pid"] for e in answer["engines"]}


def stop_all(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    for name in HOSTS:
        sshd.run(*agent_argv(tmp_path / "agent"), "stop", "--host", name, input="")


def post(port: int, model: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": model}))
    resp = conn.getresponse()
    resp.read()
    return resp.status


def watched(proxy: Proxy) -> None:
    for name in HOSTS:
        proxy.wait_for(rf"watching the engines of {name}\b", timeout=20)


def test_a_kill_9_on_each_host_is_restarted_by_that_host(sshd: sshd_harness.SSHD,
                                                         tmp_path: Path) -> None:
    """Engine `a` of each of three hosts on one target, killed with SIGKILL one after the
    other: each host logs its own engine's death once and runs a new `a` within 10 s."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        watched(proxy)
        for name in HOSTS:
            assert post(proxy.port, f"a-{name}") == 200
        first = {name: status(sshd, tmp_path, name)["a"] for name in HOSTS}
        assert len(set(first.values())) == 3, first
        for name in HOSTS:
            os.kill(first[name], signal.SIGKILL)
        killed = time.monotonic()

        def restarted() -> bool:
            now = {name: status(sshd, tmp_path, name).get("a") for name in HOSTS}
            return all(now[n] not in (None, first[n]) for n in HOSTS)

        assert wait_until(restarted, timeout=10, every=0.3), proxy.output()[-3000:]
        assert time.monotonic() - killed < 10
        out = proxy.output()
        for name in HOSTS:
            assert out.count(f"engine a on {name} died (signal 9)") == 1, out[-3000:]
            assert post(proxy.port, f"a-{name}") == 200
    finally:
        proxy.stop()
        stop_all(sshd, tmp_path)


def test_a_crash_loop_ends_failed_on_every_host(sshd: sshd_harness.SSHD,
                                                tmp_path: Path) -> None:
    """Engine `c` of each host exits 3 soon after each start: every host restarts its own
    after 1, 2, 4, 8 s and marks it failed at the fifth crash (its /status says so, with
    its own last log line)."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        watched(proxy)
        for name in HOSTS:
            post(proxy.port, f"c-{name}")       # starts c; it may answer before it dies
        for name in HOSTS:
            proxy.wait_for(rf"engine c on {name} died \(exit status 3\): CUDA out of memory "
                           rf"on {name}; failed after 5 crashes", timeout=45)
        docs = {h["name"]: h["engine"]["supervision"]["c"]
                for h in proxy.get_json("/status")["hosts"]}
        for name in HOSTS:
            assert docs[name]["state"] == "failed" and docs[name]["crashes"] == 5, docs
            assert docs[name]["last_line"] == f"CUDA out of memory on {name}", docs
    finally:
        proxy.stop()
        stop_all(sshd, tmp_path)
