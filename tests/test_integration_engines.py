"""Managed engines for real: twistd llmproxy drives llmproxy-agent over a real
sshd on 127.0.0.1, and the agent runs simulated engines as the engine
commands: switching without cutting a stream, idle stop, a failed start,
per-host locks, and an upgrade that keeps the engine and the lock."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent.state import records
from tests import sshd as sshd_harness
from tests.managed import managed_config, managed_host, sim_command
from tests.procs import (
    ROOT,
    BodyReader,
    Proxy,
    free_port,
    gone,
    kill_if_alive,
    wait_gone,
    wait_until,
)

pytestmark = pytest.mark.integration


def engine_command(port: int, model: str, *, fail: bool = False) -> list[str]:
    if fail:
        return [sys.executable, "-c", "import sys; print('no GPU here'); sys.exit(1)"]
    return sim_command(port, model)


def config(sshd: sshd_harness.SSHD, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """A managed host of engines a and b. No residency (min_engine_seconds 0): these
    tests are about the switches themselves; a test of residency sets its own."""
    port, broken = free_port(), extra.pop("broken", False)
    host = managed_host(sshd, tmp_path, port, {
        "a": {"command": engine_command(port, "ma"), "start_timeout_seconds": 20},
        "b": {"command": engine_command(port, "mb", fail=broken), "start_timeout_seconds": 20},
    }, min_engine_seconds=0)
    return managed_config(sshd, tmp_path, [host], {"ma": {"host": "gpu1", "engine": "a"},
                                                   "mb": {"host": "gpu1", "engine": "b"}},
                          **extra)


def agent_status(sshd: sshd_harness.SSHD, tmp_path: Path) -> dict[str, Any]:
    """The engine the agent reports running, asked over ssh by hand (`llmproxy-agent status`):
    at most one, as the proxy runs one at a time on this host; {"engine": None} when none."""
    done = sshd.run("env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "llmproxy.agent",
                    "--state-dir", str(tmp_path / "agent"), "status", "--host", "gpu1")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["ok"] is True and answer["protocol"] == 4, answer
    assert len(answer["engines"]) <= 1, answer
    return dict(answer["engines"][0]) if answer["engines"] else {"engine": None, "pid": None}


def stop_engine(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    sshd.run("env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "llmproxy.agent",
             "--state-dir", str(tmp_path / "agent"), "stop", "--host", "gpu1",
             input="")  # by hand: never refused by a lease


def post(port: int, model: str, stream: bool = False, **headers: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": model, "stream": stream}),
                 headers)
    return conn.getresponse()


# test_switch_waits_for_the_running_stream runs on a simulated second machine:
# tests/test_integration_gpuhost.py.


def test_idle_stop_ends_the_engine_process(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """After idle_stop_seconds without a request the engine is stopped and its
    process is gone."""
    proxy = Proxy(config(sshd, tmp_path, idle_stop_seconds=1.5), tmp_path)
    try:
        assert post(proxy.port, "ma").status == 200
        # The agent's own record, read at once (an ssh status call could take
        # longer than the 1.5 s before the idle stop).
        [record] = records(tmp_path / "agent" / "hosts" / "gpu1")
        pid = record["pid"]
        assert pid and not gone(pid)
        proxy.wait_for(r"idle stop of a on gpu1", timeout=15)
        assert wait_gone(pid, 10)
        assert agent_status(sshd, tmp_path)["engine"] is None
    finally:
        proxy.stop()
        stop_engine(sshd, tmp_path)


def test_failed_engine_start_is_a_424(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """An engine that fails to start: HTTP 424 model_unavailable naming model,
    host, engine and the agent's reason."""
    proxy = Proxy(config(sshd, tmp_path, broken=True), tmp_path)
    try:
        resp = post(proxy.port, "mb")
        error = json.loads(resp.read())["error"]
        assert resp.status == 424 and error["type"] == "model_unavailable"
        assert error["message"].startswith("model mb: switching host gpu1 to engine b failed:")
        assert "exited (exit status 1)" in error["message"]
    finally:
        proxy.stop()
        stop_engine(sshd, tmp_path)


def test_second_proxy_on_the_same_target_is_refused(sshd: sshd_harness.SSHD,
                                                    tmp_path: Path) -> None:
    """A second llmproxy managing the same ssh target refuses to start, naming
    the target, the lock file and the first one's pid; hosts without ssh take
    no lock, so two forward-only proxies start side by side."""
    cfg = config(sshd, tmp_path)
    proxy = Proxy(cfg, tmp_path)
    try:
        (tmp_path / "second").mkdir()
        second = Proxy(cfg, tmp_path / "second", wait_ready=False)
        assert second.popen.wait(30) != 0
        assert (f"another llmproxy manages {sshd.target} (lock {tmp_path}/locks/host-"
                in second.output())
        assert f"pid {proxy.pid})" in second.output()
        plain = {"hosts": [{"name": "laptop", "url": f"http://127.0.0.1:{free_port()}"}],
                 "runtime_dir": str(tmp_path / "locks")}
        (tmp_path / "p1").mkdir()
        (tmp_path / "p2").mkdir()
        one, two = Proxy(plain, tmp_path / "p1"), Proxy(plain, tmp_path / "p2")
        assert one.stop() == 0 and two.stop() == 0
    finally:
        proxy.stop()


def test_upgrade_keeps_the_engine_and_the_lock(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """SIGUSR1 while a stream runs on a managed engine: the stream completes on
    the old process, the new process takes over the lock and serves the same
    engine without restarting it, and a second llmproxy is still refused."""
    cfg = config(sshd, tmp_path)
    proxy = Proxy(cfg, tmp_path)
    pids = [proxy.pid]
    try:
        assert post(proxy.port, "ma").status == 200
        engine_pid = agent_status(sshd, tmp_path)["pid"]
        stream = BodyReader(post(proxy.port, "ma", stream=True, **{"X-Sim-Delay": "0.15",
                                                              "X-Sim-Tokens": "20"}))
        time.sleep(0.3)
        os.kill(proxy.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 20
        while proxy.serving_pid() == pids[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        pids.append(proxy.serving_pid())
        assert pids[1] != pids[0]
        assert post(proxy.port, "ma").status == 200            # served by the new process
        stream.join(30)
        assert stream.error is None and stream.body.count(b"tok") == 20
        assert proxy.popen.wait(20) == 0
        assert agent_status(sshd, tmp_path)["pid"] == engine_pid   # never restarted
        status = proxy.get_json("/status")
        assert status["hosts"][0]["engine"]["running"] == "a"
        assert "adopted engine a on gpu1" in proxy.output()
        (tmp_path / "second").mkdir()
        second = Proxy(cfg, tmp_path / "second", wait_ready=False)
        assert second.popen.wait(30) != 0
        assert f"pid {pids[1]})" in second.output()
    finally:
        os.kill(pids[-1], signal.SIGTERM)
        for pid in pids:
            wait_gone(pid, 15)
            kill_if_alive(pid)
        stop_engine(sshd, tmp_path)


class Waiters:
    """Five non-streamed requests for `mb` sent at once, each on its own thread."""

    def __init__(self, port: int, n: int = 5, **headers: str) -> None:
        import threading

        self.results: list[tuple[int, dict[str, str], bytes]] = []
        self.errors: list[BaseException] = []

        def one() -> None:
            try:
                resp = post(port, "mb", **headers)
                self.results.append((resp.status, dict(resp.getheaders()), resp.read()))
            except BaseException as e:      # reported by the test
                self.errors.append(e)

        self.threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join(60)


def queued(proxy: Proxy) -> int:
    return int(proxy.get_json("/status")["hosts"][0]["engine"]["queued"])


@pytest.mark.parametrize("keyed", [False, True], ids=["keys-off", "keys-on"])
def test_requests_waiting_for_a_switch_move_to_the_new_process_on_upgrade(
        sshd: sshd_harness.SSHD, tmp_path: Path, keyed: bool) -> None:
    """Five requests wait for a switch to b behind a stream on a when SIGUSR1 arrives:
    none is refused; the old process re-sends them to the new one, which switches to b
    once the old stream on a has ended, and all five complete on b. With keys on, the
    re-sent requests carry the client's key to the new process's door (which the old
    one's door had taken off them), and it lets them in."""
    extra: dict[str, Any] = {}
    auth: dict[str, str] = {}
    if keyed:
        (tmp_path / "keys.json").write_text(json.dumps({"keys": [{
            "name": "alice", "sha256": hashlib.sha256(b"sk-alice").hexdigest()}]}))
        extra = {"keys_file": str(tmp_path / "keys.json"), "public_status": True}
        auth = {"Authorization": "Bearer sk-alice"}
    proxy = Proxy(config(sshd, tmp_path, **extra), tmp_path)
    successor = None
    try:
        assert post(proxy.port, "ma", **auth).status == 200          # engine a runs
        stream = BodyReader(post(proxy.port, "ma", stream=True, **{"X-Sim-Delay": "0.2",
                                                              "X-Sim-Tokens": "20"}, **auth))
        waiters = Waiters(proxy.port, **auth)
        assert wait_until(lambda: queued(proxy) == 5)
        proxy.signal(signal.SIGUSR1)
        waiters.join()
        stream.join(30)
        successor = proxy.serving_pid()
        assert successor != proxy.pid
        assert waiters.errors == []
        assert [status for status, _, _ in waiters.results] == [200] * 5
        assert all(json.loads(body)["model"] == "mb" for _, _, body in waiters.results)
        assert stream.error is None and stream.body.rstrip().endswith(b"[DONE]")
        # Each access line is written just after its response's last byte.
        assert wait_until(lambda: proxy.output().count("re-sent to the new process") == 5)
        assert agent_status(sshd, tmp_path)["engine"] == "b"
    finally:
        proxy.stop()
        if successor is not None:
            os.kill(successor, signal.SIGTERM)
            assert wait_gone(successor, 20)
        stop_engine(sshd, tmp_path)


def test_requests_waiting_for_a_switch_get_503_on_a_plain_stop(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """The same five waiting requests under SIGTERM: each gets 503 proxy_stopping with
    Retry-After (never 424: no engine failed); the running stream completes."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        assert post(proxy.port, "ma").status == 200
        stream = BodyReader(post(proxy.port, "ma", stream=True, **{"X-Sim-Delay": "0.2",
                                                              "X-Sim-Tokens": "10"}))
        waiters = Waiters(proxy.port)
        assert wait_until(lambda: queued(proxy) == 5)
        proxy.signal(signal.SIGTERM)
        waiters.join()
        stream.join(30)
        assert waiters.errors == []
        assert [status for status, _, _ in waiters.results] == [503] * 5
        for _, headers, body in waiters.results:
            assert headers.get("Retry-After") == "1"
            assert json.loads(body)["error"]["code"] == "proxy_stopping"
        assert stream.error is None and stream.body.rstrip().endswith(b"[DONE]")
        assert proxy.popen.wait(20) == 0
    finally:
        proxy.stop()
        stop_engine(sshd, tmp_path)


def ssh_clients(sshd: sshd_harness.SSHD) -> list[int]:
    """Pids of ssh client processes talking to this test's sshd."""
    key = next(a for a in sshd.ssh_command if a.endswith("client_ed25519"))
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and key.encode() in argv and any(a.endswith(b"ssh") for a in argv):
            found.append(int(entry.name))
    return found


def test_a_second_sigterm_leaves_no_ssh_call_behind(sshd: sshd_harness.SSHD,
                                                    tmp_path: Path) -> None:
    """An ssh call hangs (engine b never becomes healthy) while the stop drains the
    request that waits for it;
    a second SIGTERM exits 143 at once and ends that ssh call's process group too:
    no ssh client of the proxy is left."""
    doc = config(sshd, tmp_path)
    doc["hosts"][0]["engines"]["b"] = {
        "command": [sys.executable, "-c", "import time; time.sleep(600)"],
        "start_timeout_seconds": 120}
    proxy = Proxy(doc, tmp_path)
    try:
        import threading

        def waiting_request() -> None:
            with contextlib.suppress(OSError):     # the exit at once cuts it
                post(proxy.port, "mb").read()

        threading.Thread(target=waiting_request, daemon=True).start()
        assert wait_until(lambda: proxy.get_json("/status")["hosts"][0]["engine"]["operation"]
                          == "switch")
        assert wait_until(lambda: len(ssh_clients(sshd)) > 0)
        proxy.signal(signal.SIGTERM)
        proxy.wait_for(r"stopping: 1 request\(s\) in flight", timeout=10)
        assert ssh_clients(sshd), "the first signal must leave the switch's ssh call alone"
        proxy.signal(signal.SIGTERM)
        assert proxy.popen.wait(10) == 128 + signal.SIGTERM
        assert "killing 1 ssh call(s)" in proxy.output()
        assert wait_until(lambda: ssh_clients(sshd) == [], timeout=5), ssh_clients(sshd)
    finally:
        proxy.stop()
        stop_engine(sshd, tmp_path)
