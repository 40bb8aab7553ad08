"""The host lease and the hot standby for real (issue 38, parts 3 and 4): twistd llmproxy
processes with different runtime_dirs in front of one GPU host reached over the loopback
sshd, its real agent and a simulated engine. The second proxy is refused by name (machine,
pid) and its request starts nothing; a `--standby` proxy answers /readyz 503 `standby` until
`kill -9` of the holder, then takes the lease within 10 s, adopts the running engine (same
pid) and serves it, /readyz 200; an upgrade (SIGUSR1) of the holder keeps the lease, so a
second standby waiting all along never gets it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests import sshd as sshd_harness
from tests.procs import Proxy, free_port, wait_gone, wait_new_pid, wait_until
from tests.test_integration_supervision import config, post, running, watching

pytestmark = pytest.mark.integration


def readyz(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
    except OSError:
        return 0, {}


def lease_record(tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "agent" / "hosts" / "gpu1" / "lease.json"   # the host's own state
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def proxy_of(base: dict[str, Any], tmp_path: Path, name: str, standby: bool = False,
             port: int | None = None) -> Proxy:
    """A proxy of the shared config `base` with a runtime_dir of its own."""
    (tmp_path / name).mkdir()
    extra: dict[str, Any] = {"runtime_dir": str(tmp_path / f"locks-{name}")}
    if port is not None:
        extra["listen"] = f"127.0.0.1:{port}"
    return Proxy({**base, **extra}, tmp_path / name,
                 wait_ready=not standby, options=("--standby",) if standby else ())


def test_second_proxy_refused_then_standby_takes_over_and_upgrade_keeps(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """Holder A serves; B (another runtime_dir) is refused by machine and pid with a 424 and
    no restart; standby C answers 503 standby naming A until A is killed -9, then within
    10 s holds the lease (its pid on record), adopts the engine (same pid), serves, /readyz
    200; standby D waits while C is upgraded (SIGUSR1): the lease passes to C's successor
    and D never takes it."""
    machine = socket.gethostname()
    base = config(sshd, tmp_path)      # one engine port for every proxy
    active = proxy_of(base, tmp_path, "a")
    proxies = [active]
    new: int | None = None      # the upgraded standby's successor (not a process Proxy started)
    try:
        watching(active)
        assert post(active.port, "ma")[0] == 200
        engine = running(sshd, tmp_path)
        assert engine["engine"] == "a"
        assert lease_record(tmp_path)["pid"] == active.pid

        # A second proxy (another runtime_dir) is refused by name; its request starts nothing.
        second = proxy_of(base, tmp_path, "b")
        proxies.append(second)
        second.wait_for(rf"host gpu1 is held by {machine} pid {active.pid} since ", timeout=15)
        status, body = post(second.port, "ma")
        assert status == 424, body
        assert f"held by {machine} pid {active.pid}" in body["error"]["message"]
        host = second.get_json("/status")["hosts"][0]
        assert host["engine"]["held_by"].startswith(f"held by {machine} pid {active.pid}")
        assert running(sshd, tmp_path)["pid"] == engine["pid"]
        second.stop()

        # A standby waits (503 standby, naming the holder), then takes over a kill -9.
        port = free_port()
        standby = proxy_of(base, tmp_path, "c", standby=True, port=port)
        proxies.append(standby)
        assert wait_until(lambda: readyz(port)[0] == 503, 15), standby.output()
        _, doc = readyz(port)
        assert doc["code"] == "standby"
        wait_until(lambda: "held by" in readyz(port)[1].get("waiting_for", {}).get("gpu1", ""),
                   15)
        assert readyz(port)[1]["waiting_for"]["gpu1"].startswith(
            f"held by {machine} pid {active.pid}")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": "ma"}))
        refused = conn.getresponse()
        assert refused.status == 503 and refused.getheader("retry-after")
        assert json.loads(refused.read())["error"]["code"] == "standby"

        active.signal(signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: readyz(port)[0] == 200, 10), standby.output()
        assert time.monotonic() - killed < 10
        standby.wait_for(r"adopted engine a on gpu1 \(pid \d+\), no restart")
        assert running(sshd, tmp_path)["pid"] == engine["pid"]      # not restarted
        assert lease_record(tmp_path)["pid"] == standby.pid
        standby.port, standby.url = port, f"http://127.0.0.1:{port}"
        status, body = post(port, "ma")
        assert status == 200 and body["model"] == "ma"

        # An upgrade of the holder keeps the lease: a standby waiting all along never gets it.
        other_port = free_port()
        waiting = proxy_of(base, tmp_path, "d", standby=True, port=other_port)
        proxies.append(waiting)
        assert wait_until(lambda: "held by" in readyz(other_port)[1].get(
            "waiting_for", {}).get("gpu1", ""), 15), waiting.output()
        old = standby.pid
        standby.signal(signal.SIGUSR1)
        new = wait_new_pid(standby, old)
        assert wait_gone(old, 30)
        time.sleep(1.0)     # a watch of the old process gone: its share of the lease too
        assert readyz(other_port)[0] == 503
        assert readyz(other_port)[1]["waiting_for"]["gpu1"].startswith(f"held by {machine}")
        record = lease_record(tmp_path)
        assert record["pid"] == new and record["runtime_dir"].endswith("locks-c")
        assert "took the lease" not in waiting.output()
        status, body = post(port, "ma")
        assert status == 200
        assert running(sshd, tmp_path)["pid"] == engine["pid"]
    finally:
        for proxy in reversed(proxies):
            proxy.stop()
        if new is not None:     # it holds the lease: the engine's stop below needs it gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(new, signal.SIGTERM)
            assert wait_gone(new, 30)
        from tests.test_integration_supervision import agent
        agent(sshd, tmp_path, "stop", {"grace": 2})
