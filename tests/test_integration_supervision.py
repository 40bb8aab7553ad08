"""Supervised engines for real: twistd llmproxy watches its managed host over a
long-lived `llmproxy-agent watch` session through a real sshd on 127.0.0.1.
An engine killed behind the proxy's back is restarted with no request sent; an
engine in a crash loop backs off, then fails with a 424 naming its exit and its
log's last line until an operator starts it again; an engine whose health
check hangs while its response in flight is stuck is replaced, and that
response ends cut; an engine the proxy stops itself is never restarted.
The engines are llmproxy/testing's (simengine, crashengine)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests import sshd as sshd_harness
from tests.managed import managed_config, managed_host, sim_command
from tests.procs import ROOT, Proxy, env, free_port, gone, wait_gone, wait_until

pytestmark = pytest.mark.integration

def config(sshd: sshd_harness.SSHD, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    port = free_port()
    sim = sim_command(port, "ma")
    # Answers its first health check, then says CUDA ran out of memory and exits 3.
    crasher = [sys.executable, "-m", "llmproxy.testing.crashengine", "--port", str(port),
               "--model", "mc", "--crash-after", "0.5", "--exit-status", "3",
               "--say", "CUDA out of memory"]
    # Its health check hangs while the file says so.
    hanger = sim_command(port, "mh", "--health-file", str(tmp_path / "health"))
    host = managed_host(sshd, tmp_path, port, {
        "a": {"command": sim, "start_timeout_seconds": 20},
        "c": {"command": crasher, "start_timeout_seconds": 20},
        "h": {"command": hanger, "start_timeout_seconds": 20, "unhealthy_seconds": 2}})
    return managed_config(sshd, tmp_path, [host], {"ma": {"host": "gpu1", "engine": "a"},
                                                   "mc": {"host": "gpu1", "engine": "c"},
                                                   "mh": {"host": "gpu1", "engine": "h"}},
                          **extra)


def agent(sshd: sshd_harness.SSHD, tmp_path: Path, op: str,
          order: dict[str, Any] | None = None) -> dict[str, Any]:
    # Sent as the test's proxy (same machine and runtime_dir), so the lease never refuses it.
    holder = {"machine": socket.gethostname(), "pid": os.getpid(),
              "runtime_dir": os.path.realpath(tmp_path / "locks")}
    done = sshd.run("env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "llmproxy.agent",
                    "--state-dir", str(tmp_path / "agent"), op,
                    input=json.dumps({"protocol": 4, "op": op, "host": "gpu1", "holder": holder,
                                      **(order or {})}))
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def running(sshd: sshd_harness.SSHD, tmp_path: Path) -> dict[str, Any]:
    """The engine the agent reports running (asked over ssh by hand), or {"engine": None}."""
    answer = agent(sshd, tmp_path, "status")
    assert answer["ok"] is True and len(answer["engines"]) <= 1, answer
    return dict(answer["engines"][0]) if answer["engines"] else {"engine": None}


def post(port: int, model: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": model}))
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def cli(proxy: Proxy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", *args, "--url", proxy.url],
                          env=env(), cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)


def agent_calls(tmp_path: Path) -> list[int]:
    """Pids of the processes of an agent call for this test's state directory: the
    ssh client on the proxy's side, the agent on the host's (not the engines)."""
    state = str(tmp_path / "agent")
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError):
            continue
        words = " ".join(argv)
        if entry.name.isdigit() and "llmproxy.agent" in words and state in words \
                and "reaper" not in words:
            found.append(int(entry.name))
    return found


def watching(proxy: Proxy) -> None:
    proxy.wait_for(r"watching the engines of gpu1", timeout=15)


def test_a_killed_engine_is_restarted_without_a_request(sshd: sshd_harness.SSHD,
                                                        tmp_path: Path) -> None:
    """kill -9 of the engine's own pid: the proxy logs engine.exit with the signal
    within 5 s and starts the engine again by itself (a new pid, no request
    sent); a request is then served by it."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        watching(proxy)
        assert post(proxy.port, "ma")[0] == 200
        first = running(sshd, tmp_path)
        assert first["engine"] == "a"
        os.kill(first["engine_pid"], signal.SIGKILL)
        killed = time.monotonic()
        proxy.wait_for(r"engine a on gpu1 died \(signal 9\).*; restarting in 1s", timeout=5)
        assert time.monotonic() - killed < 5

        def restarted() -> dict[str, Any] | None:
            now = running(sshd, tmp_path)
            return now if now["engine"] == "a" and now.get("engine_pid") not in (
                None, first["engine_pid"]) else None

        again = wait_until(restarted, timeout=20, every=0.3)
        assert again, running(sshd, tmp_path)
        assert not gone(again["engine_pid"])
        assert proxy.output().count("died (signal 9)") == 1
        status, body = post(proxy.port, "ma")
        assert status == 200 and body["model"] == "ma"
        assert running(sshd, tmp_path)["engine_pid"] == again["engine_pid"]
    finally:
        proxy.stop()
        agent(sshd, tmp_path, "stop", {"grace": 2})


def test_a_crash_loop_fails_and_an_operator_start_tries_again(sshd: sshd_harness.SSHD,
                                                              tmp_path: Path) -> None:
    """An engine that exits 3 soon after each healthy start: restarted after 1,
    2, 4, 8 s, failed at the fifth crash; a request then gets 424
    model_unavailable naming the exit status with its log's last line withheld
    (an API client never reads the engine's log; /status from loopback does; no
    start tried); `llmproxy engine gpu1 start c` clears the failed state and starts it."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        watching(proxy)
        started = time.monotonic()
        post(proxy.port, "mc")                     # starts c; it may answer before it dies
        proxy.wait_for(r"engine c on gpu1 died \(exit status 3\): CUDA out of memory; "
                       r"failed after 5 crashes", timeout=40)
        assert time.monotonic() - started < 40
        out = proxy.output()
        for wait in ("1s", "2s", "4s", "8s"):
            assert f"CUDA out of memory; restarting in {wait}" in out
        doc = proxy.get_json("/status")["hosts"][0]["engine"]["supervision"]["c"]
        assert doc["state"] == "failed" and doc["crashes"] == 5, doc
        starts = out.count("engine c on gpu1 ready")
        status, body = post(proxy.port, "mc")
        assert status == 424 and body["error"]["type"] == "model_unavailable", body
        message = body["error"]["message"]
        assert "exit status 3" in message and "withheld" in message, message
        assert "CUDA out of memory" not in message, message     # an API client never reads logs
        assert doc["last_line"] == "CUDA out of memory", doc     # the operator (loopback) does
        assert "llmproxy engine gpu1 start c" in message
        time.sleep(1)
        assert proxy.output().count("engine c on gpu1 ready") == starts   # nothing started
        assert running(sshd, tmp_path)["engine"] is None
        once = "engine c on gpu1 died (exit status 3): CUDA out of memory; restarting in 1s"
        assert proxy.output().count(once) == 1
        done = cli(proxy, "engine", "gpu1", "start", "c")
        assert done.returncode == 0, done.stdout + done.stderr
        assert wait_until(lambda: proxy.output().count(once) == 2, timeout=10), proxy.output()
        doc = proxy.get_json("/status")["hosts"][0]["engine"]["supervision"]["c"]
        assert doc["state"] != "failed" and doc["crashes"] == 1, doc
    finally:
        proxy.stop()
        agent(sshd, tmp_path, "stop", {"grace": 2})


def test_an_engine_the_proxy_stops_is_not_restarted(sshd: sshd_harness.SSHD,
                                                    tmp_path: Path) -> None:
    """An idle stop and an operator's stop end the engine for good: no engine.exit
    line, no restart (the agent reports nothing running a while later). When the
    proxy stops, its watch session (ssh client and agent) is gone within 5 s."""
    proxy = Proxy(config(sshd, tmp_path, idle_stop_seconds=1.5), tmp_path)
    try:
        watching(proxy)
        assert post(proxy.port, "ma")[0] == 200
        pid = running(sshd, tmp_path)["engine_pid"]
        proxy.wait_for(r"idle stop of a on gpu1", timeout=15)
        assert wait_gone(pid, 10)
        assert post(proxy.port, "ma")[0] == 200
        pid = running(sshd, tmp_path)["engine_pid"]
        done = cli(proxy, "engine", "gpu1", "stop")
        assert done.returncode == 0, done.stdout + done.stderr
        assert wait_gone(pid, 10)
        time.sleep(3)                               # longer than a first backoff
        assert running(sshd, tmp_path)["engine"] is None
        out = proxy.output()
        assert "died" not in out and "restarting in" not in out, out
        assert proxy.get_json("/status")["hosts"][0]["engine"]["supervision"] == {}
        assert agent_calls(tmp_path), "the watch session runs while the proxy does"
        assert proxy.stop() == 0
        assert wait_until(lambda: not agent_calls(tmp_path), timeout=5), agent_calls(tmp_path)
    finally:
        proxy.stop()
        agent(sshd, tmp_path, "stop", {"grace": 2})


def stuck_stream(port: int, model: str, outcome: dict[str, Any]) -> None:
    """A streamed completion whose engine sends its role chunk and then nothing
    for 1000 s; `outcome` gets what the client read and how its stream ended."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions",
                 json.dumps({"model": model, "stream": True}),
                 {"X-Sim-Delay": "1000", "Content-Type": "application/json"})
    resp = conn.getresponse()
    outcome["status"] = resp.status
    body = b""
    try:
        while chunk := resp.read1(65536):
            body += chunk
            outcome["body"] = body
        outcome["ended"] = "clean"
    except (http.client.HTTPException, OSError) as e:
        outcome["ended"] = f"{type(e).__name__}: {e}"
    outcome["body"] = body


def test_a_hung_engine_is_replaced_and_its_stuck_stream_ends_cut(sshd: sshd_harness.SSHD,
                                                                tmp_path: Path) -> None:
    """An engine whose health check hangs (unhealthy_seconds 2) while its one
    response in flight is stuck: the proxy logs it hung (engine.unhealthy),
    stops it and starts it again (a new pid) with no request sent to trigger
    it; the stuck stream ends without its [DONE], as a crash cuts it; the next
    request is served by the new engine."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        watching(proxy)
        assert post(proxy.port, "mh")[0] == 200
        first = running(sshd, tmp_path)
        assert first["engine"] == "h"
        outcome: dict[str, Any] = {}
        client = threading.Thread(target=stuck_stream, args=(proxy.port, "mh", outcome))
        client.start()
        assert wait_until(lambda: b"assistant" in outcome.get("body", b""), timeout=10), \
            outcome
        (tmp_path / "health").write_text("hang")
        hung_at = time.monotonic()
        proxy.wait_for(r"engine h on gpu1 hung: its health check failed for [0-9.]+s and no "
                       r"response sent a byte; stopping it, restarting in 1s", timeout=15)
        (tmp_path / "health").unlink()              # the next start is healthy
        # Noticed by the agent's 2 s health checks (2 s timeout), then 2 s of silence.
        assert time.monotonic() - hung_at < 12
        client.join(timeout=20)
        assert not client.is_alive(), "the stuck stream did not end"
        assert outcome["status"] == 200 and b"[DONE]" not in outcome["body"], outcome
        assert outcome["ended"] != "clean", outcome     # a cut chunked body, not an end

        def replaced() -> dict[str, Any] | None:
            now = running(sshd, tmp_path)
            return now if now["engine"] == "h" and now.get("engine_pid") not in (
                None, first["engine_pid"]) else None

        again = wait_until(replaced, timeout=30, every=0.3)
        assert again, running(sshd, tmp_path)
        assert wait_gone(first["engine_pid"], 10)
        doc = proxy.get_json("/status")["hosts"][0]["engine"]["supervision"]["h"]
        assert doc["crashes"] == 1 and "hang" in doc["last_exit"], doc
        assert "died" not in proxy.output()          # a hang, not an exit the agent saw
        status, body = post(proxy.port, "mh")
        assert status == 200 and body["model"] == "mh"
        assert running(sshd, tmp_path)["engine_pid"] == again["engine_pid"]
    finally:
        proxy.stop()
        agent(sshd, tmp_path, "stop", {"grace": 2})
