"""Engine logs for real: twistd llmproxy reads a managed engine's log through a real sshd on
127.0.0.1 and the real agent's `log` order; `llmproxy logs` prints its last lines, follows
a line the engine writes after the command started, and leaves no agent or ssh process
behind when it is interrupted or when the proxy stops under it."""

from __future__ import annotations

import http.client
import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import sshd as sshd_harness
from tests.managed import managed_config, managed_host
from tests.procs import ROOT, Proc, Proxy, free_port, gone, wait_until
from tests.test_integration_supervision import agent, agent_calls, cli, watching

pytestmark = pytest.mark.integration

# Prints ten lines as it loads, then one line per request naming the request's `marker`.
PRINTER = """
import http.server, json, sys
port = int(sys.argv[1])
for i in range(1, 11):
    print(f"loading layer {i}", flush=True)
class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self, doc):
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.answer({"status": "ok", "data": [{"id": "ma"}]})
    def do_POST(self):
        doc = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        print(f"served {doc.get('marker')}", flush=True)
        self.answer({"model": "ma", "choices": []})
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def config(sshd: sshd_harness.SSHD, tmp_path: Path) -> dict[str, Any]:
    port = free_port()
    host = managed_host(sshd, tmp_path, port, {
        "a": {"command": [sys.executable, "-c", PRINTER, str(port)], "start_timeout_seconds": 20}})
    return managed_config(sshd, tmp_path, [host], {"ma": {"host": "gpu1", "engine": "a"}})


def served(proxy: Proxy, marker: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "ma", "marker": marker}))
    assert conn.getresponse().status == 200


def interruptible() -> None:
    """In the child before exec: SIGINT back to its default, so the CLI gets
    Python's KeyboardInterrupt as from a terminal's Ctrl-C (a process started in
    the background by a shell without job control inherits SIGINT ignored,
    and Python then leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def follow(proxy: Proxy) -> Proc:
    return Proc([sys.executable, "-m", "llmproxy.cli", "logs", "gpu1", "-f", "-n", "3",
                 "--url", proxy.url], cwd=ROOT, preexec_fn=interruptible)


def test_logs_prints_the_last_lines(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """`llmproxy logs gpu1 -n 5`: exactly the log's last five lines (as the agent keeps
    it on the host), the engine's latest line among them; exit 0, no session left."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        watching(proxy)
        served(proxy, "first")
        before = set(agent_calls(tmp_path))
        done = cli(proxy, "logs", "gpu1", "-n", "5")
        assert done.returncode == 0, done.stdout + done.stderr
        log = (tmp_path / "agent" / "hosts" / "gpu1" / "engine-a.log").read_text().splitlines()
        assert done.stdout.splitlines() == log[-5:]
        assert done.stdout.splitlines()[-1] == "served first"
        assert "loading layer 10" in done.stdout
        assert wait_until(lambda: set(agent_calls(tmp_path)) <= before, timeout=5)
    finally:
        proxy.stop()
        agent(sshd, tmp_path, "stop", {"grace": 2})


def test_logs_follows_and_leaves_nothing_behind(sshd: sshd_harness.SSHD,
                                                tmp_path: Path) -> None:
    """`llmproxy logs gpu1 -f` prints the tail, then a line the engine writes after the
    command started; its log session shows in the process table (ssh client and agent)
    while it runs; Ctrl-C exits 0 and every process of that session is gone within 5 s."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        watching(proxy)
        served(proxy, "first")
        watch = set(agent_calls(tmp_path))
        reader = follow(proxy)
        try:
            reader.wait_for(r"^served first$", timeout=20)
            session = wait_until(lambda: set(agent_calls(tmp_path)) - watch, timeout=5)
            assert session, "the log order's ssh client and agent run while it follows"
            served(proxy, "after")
            reader.wait_for(r"^served after$", timeout=10)
            reader.signal(signal.SIGINT)
            assert reader.popen.wait(10) == 0, reader.output()
        finally:
            reader.stop()
        assert wait_until(lambda: all(gone(pid) for pid in session), timeout=5), \
            [pid for pid in session if not gone(pid)]
        assert "Traceback" not in proxy.output()
    finally:
        proxy.stop()
        agent(sshd, tmp_path, "stop", {"grace": 2})


def test_the_proxys_stop_ends_a_follow(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """The proxy stops while a log is followed: it exits 0 promptly (the stream never
    holds it), the command says the proxy is stopping and exits 1, and no agent call of
    this state directory is left."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        watching(proxy)
        served(proxy, "first")
        reader = follow(proxy)
        try:
            reader.wait_for(r"^served first$", timeout=20)
            assert proxy.stop(timeout=10) == 0, proxy.output()
            assert reader.popen.wait(10) == 1
            assert "the proxy is stopping" in reader.output()
        finally:
            reader.stop()
        assert wait_until(lambda: not agent_calls(tmp_path), timeout=5), agent_calls(tmp_path)
    finally:
        proxy.stop()
        agent(sshd, tmp_path, "stop", {"grace": 2})
