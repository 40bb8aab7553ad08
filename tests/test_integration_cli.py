"""The `llmproxy` command against a real twistd (issue 45, items 4 and 12): it asks
the proxy its arguments name (the -c file's `listen`, localhost included; --url
over a broken -c), and `llmproxy upgrade` waits on the event stream, not by
polling /status, until the old process has drained and exited."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.procs import ROOT, Proxy, SimEngine, env, free_port, kill_if_alive, one_host, wait_gone

pytestmark = pytest.mark.integration


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", *args], env=env(),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


ENGINE_MODELS = ("m-up",)   # the `fresh_engine` fixture's (conftest.py)


def test_the_file_names_the_proxy_and_url_wins(engine: SimEngine, tmp_path: Path) -> None:
    """`-c` whose listen is `localhost:PORT` reaches the proxy there (twistd
    listens on 127.0.0.1); a -c that cannot be read is exit 2 naming it, and
    the same with --url reaches the proxy --url names."""
    port = free_port()
    proxy = Proxy(one_host(engine, "m-up", listen=f"localhost:{port}"), tmp_path)
    try:
        assert proxy.port == port
        ok = cli("reload", "-c", str(proxy.config_path))
        assert ok.returncode == 0, ok.stderr
        missing = str(tmp_path / "nope.json")
        unnamed = cli("reload", "-c", missing)
        assert unnamed.returncode == 2
        assert f"{missing}: cannot read" in unnamed.stderr and "--url" in unnamed.stderr
        named = cli("status", "-c", missing, "--url", proxy.url)
        assert named.returncode == 0, named.stderr
    finally:
        proxy.stop()


def test_a_401_names_the_ways_to_send_a_key(engine: SimEngine, tmp_path: Path) -> None:
    """With keys on, `llmproxy status` without a key exits 2 saying how to give one
    (--key-file, $LLMPROXY_KEY), not what HTTP header to send; with $LLMPROXY_KEY
    set to an admin key it succeeds."""
    secret = "sk-admin-0a1b2c"
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [
        {"name": "ops", "sha256": hashlib.sha256(secret.encode()).hexdigest(),
         "admin": True}]}))
    proxy = Proxy(one_host(engine, "m-up", listen="127.0.0.1:0", keys_file="keys.json"), tmp_path)
    try:
        refused = cli("status", "--url", proxy.url)
        assert refused.returncode == 2
        assert "401" in refused.stderr
        assert "--key-file PATH" in refused.stderr and "$LLMPROXY_KEY" in refused.stderr
        keyed = subprocess.run([sys.executable, "-m", "llmproxy.cli", "status", "--url",
                                proxy.url], env={**env(), "LLMPROXY_KEY": secret},
                               capture_output=True, text=True, timeout=60, check=False)
        assert keyed.returncode == 0, keyed.stderr
    finally:
        proxy.stop()


def stream_chat(port: int, out: dict[str, object], started: threading.Event) -> None:
    """A streamed chat of 80 chunks, 50 ms apart, read to its end into `out`;
    `started` is set once its head has come."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"model": "m", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]})
    conn.request("POST", "/v1/chat/completions", body,
                 {"Content-Type": "application/json", "X-Sim-Tokens": "80",
                  "X-Sim-Delay": "0.05"})
    resp = conn.getresponse()
    out["status"] = resp.status
    started.set()
    out["body"] = resp.read()
    conn.close()


def test_upgrade_waits_on_the_event_stream(engine: SimEngine, tmp_path: Path) -> None:
    """With a 4 s stream in flight, `llmproxy upgrade -c FILE` returns once the old
    process has drained (the stream ends intact) and exited, says so, and asked
    /status at most once (no access line per poll)."""
    proxy = Proxy(one_host(engine, "m-up", listen=f"127.0.0.1:{free_port()}"), tmp_path)
    old, new = proxy.pid, 0
    try:
        out: dict[str, object] = {}
        started = threading.Event()
        client = threading.Thread(target=stream_chat, args=(proxy.port, out, started),
                                  daemon=True)
        client.start()
        assert started.wait(10)
        done = cli("upgrade", "-c", str(proxy.config_path), "--timeout", "30")
        assert done.returncode == 0, done.stdout + done.stderr
        m = re.search(rf"pid {old} drained and exited; pid (\d+) serves", done.stdout)
        assert m is not None, done.stdout
        new = int(m.group(1))
        assert wait_gone(old, 0.5), "the old process was still there when upgrade returned"
        client.join(10)
        assert out["status"] == 200 and b"data: [DONE]" in out["body"]   # type: ignore[operator]
        status_reads = [line for line in proxy.output().splitlines()
                        if "GET /status" in line]
        assert len(status_reads) <= 1, status_reads
        assert proxy.serving_pid() == new
    finally:
        proxy.stop()
        if new and new != old:
            os.kill(new, signal.SIGTERM)
            if not wait_gone(new, 20):
                kill_if_alive(new)
