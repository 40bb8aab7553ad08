"""A kept prompt cache with the real llama-server and model (`make test-llama`): twistd llmproxy
drives the real agent over a real sshd, the engine is tests/test_real_llama.py's llama-server
(Gemma 3 270M) with ``--slot-save-path`` and ``--swa-full`` and ``"kv_cache": "keep"``.

A long shared prompt (about 2,000 tokens) is answered by a fresh engine: llama-server's own
``timings.prompt_n`` counts every prompt token (what any restart without the restore costs).
The idle stop saves the slot; the same prompt again starts the engine, which is restored
before it is marked ready: ``prompt_n`` falls by at least 90 %. The figures (prompt tokens,
llama-server's ``prompt_ms`` and the time to the answer's first token) are printed for
docs/performance.md; only the token counts are asserted (no wall-clock assertions).
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests import sshd as sshd_harness
from tests.procs import Proxy, free_port
from tests.test_real_llama import ALIAS, agent, agent_call, llama

pytestmark = [pytest.mark.integration, pytest.mark.llama]
__all__ = ["llama"]

IDLE_STOP = 3.0
# About 2,000 Gemma tokens: numbered lines, so no run of it repeats.
PROMPT = "\n".join(f"Rule {i}: keep module {i} small, tested and documented." for i in range(113))


def config(sshd: sshd_harness.SSHD, tmp_path: Path, llama: tuple[Path, Path],
           port: int) -> dict[str, Any]:
    server, model = llama
    slots = tmp_path / "slots"
    slots.mkdir()
    command = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "-c", "4096", "-np", "1", "-t", "2", "--alias", ALIAS,
               "--slot-save-path", str(slots), "--swa-full"]
    return {
        "ssh_command": sshd.ssh_command, "runtime_dir": str(tmp_path / "locks"),
        "idle_stop_seconds": IDLE_STOP,
        "hosts": [{"name": "gpu1", "url": f"http://127.0.0.1:{port}", "ssh": sshd.target,
                   "agent": agent(tmp_path / "agent"),
                   "engines": {"gemma": {"command": command, "start_timeout_seconds": 90,
                                         "kv_cache": "keep"}}}],
        "models": {"gemma": {"host": "gpu1", "engine": "gemma", "upstream": ALIAS}},
    }


def first_token(port: int) -> tuple[dict[str, Any], float]:
    """A streamed greedy chat of the long prompt, one token: llama-server's `timings` (from
    its last chunk) and the seconds from the request to the first content chunk."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": "gemma", "stream": True, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": PROMPT},
                         {"role": "user", "content": "Which rule comes first?"}]}
    started = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    answer = conn.getresponse()
    assert answer.status == 200, answer.read()
    ttft, timings = None, None
    while line := answer.readline():
        text = line.decode().strip()
        if not text.startswith("data:") or text == "data: [DONE]":
            continue
        chunk = json.loads(text[len("data:"):])
        if ttft is None and any(c.get("delta", {}).get("content") for c in chunk["choices"]):
            ttft = time.monotonic() - started
        timings = chunk.get("timings", timings)
    conn.close()
    assert ttft is not None and isinstance(timings, dict), timings
    return timings, ttft


@pytest.mark.timeout(400)
def test_a_kept_cache_survives_an_idle_stop_of_the_real_llama_server(
        llama: tuple[Path, Path], sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """The fresh engine processes the whole prompt; after the idle stop (the slot saved) the
    restarted engine, restored before it is ready, processes at most a tenth of it."""
    proxy = Proxy(config(sshd, tmp_path, llama, free_port()), tmp_path)
    try:
        cold, cold_ttft = first_token(proxy.port)
        assert cold["prompt_n"] >= 1500, cold
        proxy.wait_for(r"kept the prompt cache of gemma on gpu1: 1 slot\(s\)",
                       timeout=IDLE_STOP + 60)
        proxy.wait_for(r"idle stop of gemma on gpu1: stopped", timeout=30)
        assert agent_call(sshd, tmp_path, "status")["engines"] == []
        warm, warm_ttft = first_token(proxy.port)   # the start included
        proxy.wait_for(r"restored the prompt cache of gemma on gpu1: 1 slot\(s\)", timeout=5)
        ready = proxy.wait_for(r"engine gemma on gpu1 ready", timeout=5)
        assert warm["prompt_n"] <= cold["prompt_n"] // 10, (cold, warm)
        print(f"\nkept prompt cache, real llama-server: prompt_n {cold['prompt_n']} -> "
              f"{warm['prompt_n']}; prompt_ms {cold['prompt_ms']:.0f} -> "
              f"{warm['prompt_ms']:.0f}; first token {cold_ttft:.2f} s -> {warm_ttft:.2f} s "
              f"(each with the engine's start; the second with the restore)")
        assert ready
    finally:
        proxy.stop()
        agent_call(sshd, tmp_path, "stop", grace=5)
