"""Inbound keys and upstream credentials with real processes: twistd llmproxy
with a keys file in front of a simulated engine that itself requires a key
(as llama-server started with --api-key)."""

from __future__ import annotations

import hashlib
import http.client
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import procs
from tests.procs import Proxy, SimEngine

pytestmark = pytest.mark.integration

ALICE, BOB, ROOT = "sk-alice-7f3e9a1c55", "sk-bob-41d2c8e6aa", "sk-root-93bd0f2e71"
UPSTREAM = "sk-engine-upstream-5c1a"
SECRETS = (ALICE, BOB, ROOT, UPSTREAM)


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def keys_doc(*extra: dict[str, Any]) -> dict[str, Any]:
    return {"keys": [{"name": "alice", "sha256": sha(ALICE), "models": ["qwen*"]},
                     {"name": "root", "sha256": sha(ROOT), "admin": True}, *extra]}


class Client:
    """Talks to the proxy; keeps every response body it saw (for the leak search)."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.bodies: list[bytes] = []

    def ask(self, method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.proxy.port, timeout=10)
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        out = resp.read()
        conn.close()
        self.bodies.append(out)
        return resp.status, out

    def chat(self, model: str, headers: dict[str, str] | None) -> tuple[int, bytes]:
        return self.ask("POST", "/v1/chat/completions", {
            "model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
            headers)


class EventCollector(threading.Thread):
    """Reads /api/events (with the admin key) for the whole test."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.conn.request("GET", "/api/events", headers={"Authorization": f"Bearer {ROOT}"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.data = bytearray()
        self.start()

    def run(self) -> None:
        try:
            while chunk := self.resp.read1(65536):
                self.data += chunk
        except (OSError, ValueError, http.client.HTTPException):
            pass    # stop() shut the socket

    def stop(self) -> bytes:
        if self.conn.sock is not None:
            self.conn.sock.shutdown(2)
        self.join(5)
        return bytes(self.data)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Proxy, SimEngine, Path]]:
    engine = SimEngine(["qwen-up", "mistral"], "--api-key", UPSTREAM, "--delay", "0.01")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(keys_doc()))
    config = {
        "keys_file": "keys.json",
        "hosts": [{"name": "gpu1", "url": engine.url, "api_key_env": "GPU1_KEY"}],
        "models": {"qwen": {"host": "gpu1", "upstream": "qwen-up"},
                   "mistral": {"host": "gpu1"}},
    }
    try:
        proxy = Proxy(config, tmp_path, extra_env={"GPU1_KEY": UPSTREAM})
    except BaseException:
        engine.stop()
        raise
    yield proxy, engine, keys
    proxy.stop()
    engine.stop()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_keys_scopes_reload_and_upstream_credentials_and_no_secret_leaks(
        setup: tuple[Proxy, SimEngine, Path]) -> None:
    """No key and a wrong key are 401, the right key streams; a model out of
    scope is the 404 of a missing one; /v1/models is filtered; the engine (which
    requires its own key) gets the configured key and never a client's; a
    SIGHUP that adds a key makes it work, a broken keys file keeps the old keys;
    and no secret is in the log, /status, the event stream or any body."""
    proxy, engine, keys = setup
    client = Client(proxy)
    events = EventCollector(proxy.port)

    assert client.chat("qwen", None)[0] == 401
    status, body = client.chat("qwen", bearer("sk-wrong"))
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, body = client.chat("qwen", bearer(ALICE))
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
    scoped = client.chat("mistral", bearer(ALICE))
    missing = client.chat("mistral-x", bearer(ALICE))
    assert scoped[0] == missing[0] == 404
    assert scoped[1] == missing[1].replace(b"mistral-x", b"mistral")
    listed = json.loads(client.ask("GET", "/v1/models", headers=bearer(ALICE))[1])
    assert {m["id"] for m in listed["data"]} == {"qwen"}
    assert client.ask("GET", "/status", headers=bearer(ALICE))[0] == 403
    assert client.chat("qwen", {"Authorization": "Bearer"})[0] == 401
    assert client.chat("qwen", {"Authorization": "Basic %%%"})[0] == 401
    status, body = client.chat("qwen", {**bearer(ALICE), "X-Big": "x" * 20000})
    assert status == 431 and b"xxxx" not in body

    # bob arrives with a SIGHUP, no restart.
    assert client.chat("mistral", bearer(BOB))[0] == 401
    keys.write_text(json.dumps(keys_doc({"name": "bob", "sha256": sha(BOB)})))
    proxy.signal(signal.SIGHUP)
    proxy.wait_for(r"reload: applied keys \(\+bob\); re-read keys file .*keys\.json \(3 keys\)")
    assert client.chat("mistral", bearer(BOB))[0] == 200
    # A broken file keeps the running keys, and the log says so by name.
    keys.write_text('{"keys": [{"name": "eve", "sha256": "' + BOB + '"}]}')
    proxy.signal(signal.SIGHUP)
    proxy.wait_for(r"reload: kept the running config: the keys file is invalid: .*keys\.json: "
                   r"keys\[0\]\.sha256")
    assert client.chat("mistral", bearer(BOB))[0] == 200
    assert client.chat("qwen", bearer(ALICE))[0] == 200

    records = [r for r in engine.requests() if r["path"] == "/v1/chat/completions"]
    assert len(records) == 4
    assert {r["headers"].get("authorization") for r in records} == {f"Bearer {UPSTREAM}"}
    assert not any(s in json.dumps(r["headers"]) for r in records for s in SECRETS[:3])

    status_doc = client.ask("GET", "/status", headers=bearer(ROOT))[1]
    per_key = {k["name"]: k["requests"] for k in json.loads(status_doc)["access"]["per_key"]}
    assert per_key["alice"] >= 5 and per_key["bob"] == 2
    streamed = events.stop()
    assert b'"key":"alice"' in streamed and b'"key":"bob"' in streamed
    haystack = proxy.output().encode() + status_doc + streamed + b"".join(client.bodies)
    for secret in SECRETS:
        assert secret.encode() not in haystack, "a secret leaked"
    assert sha(BOB).encode() not in proxy.output().encode()


def test_llmproxy_commands_send_the_key(setup: tuple[Proxy, SimEngine, Path],
                                        tmp_path: Path) -> None:
    """`llmproxy status` needs an admin key with keys on: from --key-file or
    LLMPROXY_KEY; without one it cannot ask (exit 2, saying 401)."""
    proxy, _, _ = setup
    key_file = tmp_path / "admin.key"
    key_file.write_text(ROOT + "\n")
    command = [sys.executable, "-m", "llmproxy.cli", "status", "--url", proxy.url]
    env = {**procs.env(), "LLMPROXY_KEY": ""}
    denied = subprocess.run(command, check=False, capture_output=True, text=True, env=env,
                            timeout=30)
    assert denied.returncode == 2 and "401" in denied.stderr
    by_file = subprocess.run([*command, "--key-file", str(key_file)], check=False,
                             capture_output=True, text=True, env=env, timeout=30)
    assert by_file.returncode == 0 and "ready" in by_file.stdout
    by_env = subprocess.run(command, check=False, capture_output=True, text=True, timeout=30,
                            env={**env, "LLMPROXY_KEY": ROOT})
    assert by_env.returncode == 0
    assert ROOT not in by_file.stdout + by_file.stderr + by_env.stdout + by_env.stderr
