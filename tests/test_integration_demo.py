"""The demo survives an upgrade (issue 45, item 10): SIGUSR1 to `twistd llmproxy
--demo` hands over with a stream intact (the successor binds the simulated
engines' ports beside its predecessor, SO_REUSEPORT, instead of dying on them);
a busy engine port is one clear line and a non-zero exit; --demo-port (`make demo
PORT=N`) picks the proxy's port. Run on ports of their own (`--demo -c`)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
from pathlib import Path

import pytest

from llmproxy.testing import demo
from tests.procs import Proc, free_port, kill_if_alive, twistd, wait_gone

pytestmark = pytest.mark.integration


def demo_config(tmp_path: Path, engine_ports: tuple[int, int]) -> Path:
    """The built-in demo config with its engines on `engine_ports`."""
    doc = json.loads(Path(demo.CONFIG_PATH).read_text())
    for host, port in zip(doc["hosts"], engine_ports, strict=True):
        host["url"] = f"http://127.0.0.1:{port}"
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(doc))
    return path


def stream(port: int, out: dict[str, object], started: threading.Event) -> None:
    """A streamed chat of 60 chunks 50 ms apart, read to its end into `out`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": "llama-demo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
        {"Content-Type": "application/json", "X-Sim-Tokens": "60", "X-Sim-Delay": "0.05"})
    resp = conn.getresponse()
    out["status"] = resp.status
    started.set()
    out["body"] = resp.read()
    conn.close()


def chat_status(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": "qwen-demo", "messages": [{"role": "user", "content": "hi"}]}),
        {"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


def test_the_demo_upgrades_with_a_stream_intact(tmp_path: Path) -> None:
    """--demo-port picks the port; SIGUSR1 starts a successor that becomes ready
    (it binds the engines' ports its predecessor holds), a stream begun before
    ends with [DONE], the old process exits, and the successor serves chats."""
    port = free_port()
    path = demo_config(tmp_path, (free_port(), free_port()))
    p = Proc([twistd(), "-n", "--pidfile=", "llmproxy", "--demo", "-c", str(path),
              "--demo-port", str(port)], cwd=tmp_path)
    new = 0
    try:
        p.wait_for(rf"ready: listening on http://127\.0\.0\.1:{port} ")
        out: dict[str, object] = {}
        started = threading.Event()
        client = threading.Thread(target=stream, args=(port, out, started), daemon=True)
        client.start()
        assert started.wait(10)
        p.signal(signal.SIGUSR1)
        new = int(p.wait_for(r"upgrade: handed over to pid (\d+)", timeout=30).group(1))
        client.join(30)
        assert out["status"] == 200
        assert b"data: [DONE]" in out["body"]     # type: ignore[operator]
        assert p.popen.wait(30) == 0
        assert "Traceback" not in p.output()
        assert chat_status(port) == 200          # the successor's own engines answer
    finally:
        p.stop()
        if new:
            os.kill(new, signal.SIGTERM)
            if not wait_gone(new, 20):
                kill_if_alive(new)


def test_a_busy_engine_port_is_one_clear_line(tmp_path: Path) -> None:
    """An engine port held by another program: exit non-zero with `llmproxy --demo:
    cannot listen on ... for a simulated engine: Address already in use`, no traceback."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        path = demo_config(tmp_path, (busy, free_port()))
        p = Proc([twistd(), "-n", "--pidfile=", "llmproxy", "--demo", "-c", str(path),
                  "--demo-port", str(free_port())], cwd=tmp_path)
        assert p.popen.wait(30) != 0
    out = p.output()
    assert (f"llmproxy --demo: cannot listen on 127.0.0.1:{busy} for a simulated engine: "
            "Address already in use") in out
    assert "Traceback" not in out


@pytest.mark.parametrize("value", ["http", "70000"])
def test_a_bad_demo_port_is_a_usage_error(value: str, tmp_path: Path) -> None:
    """--demo-port takes a port number."""
    p = Proc([twistd(), "-n", "--pidfile=", "llmproxy", "--demo", "--demo-port", value],
             cwd=tmp_path)
    assert p.popen.wait(30) != 0
    assert f"--demo-port: not a port number: {value!r}" in p.output()
