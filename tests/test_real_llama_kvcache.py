"""A kept prompt cache with the real llama-server and model (`make test-llama`): twistd llmproxy
drives the real agent over a real sshd, the engine is tests/test_real_llama.py's llama-server
(Gemma 3 270M) with ``--slot-save-path`` and ``--swa-full`` and ``"kv_cache": "keep"``.

A long shared prompt (about 2,000 tokens) is answered by a fresh engine: llama-server's own
``timings.prompt_n`` counts every prompt token (what any restart without the restore costs).
The idle stop saves the slot; the same prompt again starts the engine, which is restored
before it is marked ready: ``prompt_n`` falls by at least 90 %. Then an eviction: a second
real engine (same binary and model, another alias, port and slot directory) on the same host,
whose ``memory_gb`` budget holds one of the two, is asked for: the kept engine is evicted (its
slot saved), and the long prompt again restarts it, restored: ``prompt_n`` falls by at least
90 % against the fresh figure once more. The figures (prompt tokens,
llama-server's ``prompt_ms`` and the time to the answer's first token) are printed for
docs/performance.md; only the token counts are asserted (no wall-clock assertions).
"""

from __future__ import annotations

import http.client
import json
import re
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
OTHER = f"{ALIAS}-b"   # the second engine's alias, the one that evicts the first
# About 2,000 Gemma tokens: numbered lines, so no run of it repeats.
PROMPT = "\n".join(f"Rule {i}: keep module {i} small, tested and documented." for i in range(113))


def config(sshd: sshd_harness.SSHD, tmp_path: Path, llama: tuple[Path, Path],
           port: int, other_port: int) -> dict[str, Any]:
    """gpu1 runs `gemma` (kept) on `port` and `other` on `other_port`, one at a time: the
    host's memory_gb holds one of them, so asking for either evicts the other."""
    server, model = llama

    def command(alias: str, at: int, slots: Path) -> list[str]:
        slots.mkdir()
        return [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(at),
                "-c", "4096", "-np", "1", "-t", "2", "--alias", alias,
                "--slot-save-path", str(slots), "--swa-full"]

    engines = {
        "gemma": {"command": command(ALIAS, port, tmp_path / "slots"), "memory_gb": 1,
                  "url": f"http://127.0.0.1:{port}", "start_timeout_seconds": 90,
                  "kv_cache": "keep"},
        "other": {"command": command(OTHER, other_port, tmp_path / "other-slots"),
                  "memory_gb": 1, "url": f"http://127.0.0.1:{other_port}",
                  "start_timeout_seconds": 90},
    }
    return {
        "ssh_command": sshd.ssh_command, "runtime_dir": str(tmp_path / "locks"),
        "idle_stop_seconds": IDLE_STOP,
        "hosts": [{"name": "gpu1", "url": f"http://127.0.0.1:{port}", "ssh": sshd.target,
                   "agent": agent(tmp_path / "agent"), "memory_gb": 1,
                   "min_engine_seconds": 0, "engines": engines}],
        "models": {"gemma": {"host": "gpu1", "engine": "gemma", "upstream": ALIAS},
                   "other": {"host": "gpu1", "engine": "other", "upstream": OTHER}},
    }


def first_token(port: int, model: str = "gemma",
                system: str = PROMPT) -> tuple[dict[str, Any], float]:
    """A streamed greedy chat of `system` (the long prompt) to `model`, one token:
    llama-server's `timings` (from its last chunk) and the seconds from the request to the
    first content chunk."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": model, "stream": True, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system},
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
def test_a_kept_cache_survives_an_idle_stop_and_an_eviction_of_the_real_llama_server(
        llama: tuple[Path, Path], sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """The fresh engine processes the whole prompt; after the idle stop (the slot saved) the
    restarted engine, restored before it is ready, processes at most a tenth of it. Then the
    other engine evicts it (the slot saved again), and the long prompt again restarts it,
    restored: again at most a tenth."""
    proxy = Proxy(config(sshd, tmp_path, llama, free_port(), free_port()), tmp_path)
    kept = r"kept the prompt cache of gemma on gpu1: 1 slot\(s\)"
    restored = r"restored the prompt cache of gemma on gpu1: 1 slot\(s\)"
    try:
        cold, cold_ttft = first_token(proxy.port)
        assert cold["prompt_n"] >= 1500, cold
        proxy.wait_for(kept, timeout=IDLE_STOP + 60)
        proxy.wait_for(r"idle stop of gemma on gpu1: stopped", timeout=30)
        assert agent_call(sshd, tmp_path, "status")["engines"] == []
        warm, warm_ttft = first_token(proxy.port)   # the start included
        proxy.wait_for(restored, timeout=5)
        ready = proxy.wait_for(r"engine gemma on gpu1 ready", timeout=5)
        assert warm["prompt_n"] <= cold["prompt_n"] // 10, (cold, warm)
        print(f"\nkept prompt cache, real llama-server: prompt_n {cold['prompt_n']} -> "
              f"{warm['prompt_n']}; prompt_ms {cold['prompt_ms']:.0f} -> "
              f"{warm['prompt_ms']:.0f}; first token {cold_ttft:.2f} s -> {warm_ttft:.2f} s "
              f"(each with the engine's start; the second with the restore)")
        assert ready

        # The idle stop's slot file goes, so the restore below can only be the eviction's save.
        saved = list((tmp_path / "slots").glob("llmproxy-gemma-slot*.bin"))
        assert len(saved) == 1, saved
        saved[0].unlink()
        # Asked for within the idle stop, the other engine evicts gemma, which is saved.
        first_token(proxy.port, "other", "Answer briefly.")
        proxy.wait_for(r"stop of gemma on gpu1 \(evicted for other\): stopped", timeout=30)
        assert len(re.findall(kept, proxy.output())) == 2, proxy.output()
        after, after_ttft = first_token(proxy.port)   # evicts other, restores gemma
        proxy.wait_for(r"stop of other on gpu1 \(evicted for gemma\): stopped", timeout=5)
        assert len(re.findall(restored, proxy.output())) == 2, proxy.output()
        assert after["prompt_n"] <= cold["prompt_n"] // 10, (cold, after)
        print(f"kept prompt cache after an eviction: prompt_n {cold['prompt_n']} -> "
              f"{after['prompt_n']}; prompt_ms {cold['prompt_ms']:.0f} -> "
              f"{after['prompt_ms']:.0f}; first token {cold_ttft:.2f} s -> "
              f"{after_ttft:.2f} s (the second with the other engine's stop, the start "
              f"and the restore)")
    finally:
        proxy.stop()
        agent_call(sshd, tmp_path, "stop", grace=5)
