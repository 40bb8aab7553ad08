"""A kept prompt cache (``"kv_cache": "keep"``) for real: twistd llmproxy drives the real agent
over a real sshd on 127.0.0.1, and the engines are simulated llama-servers serving the slot API
(llmproxy/testing/simslots.py: a restored slot shows as a small ``timings.prompt_n``, as on the
real engine). An idle stop, an eviction and a switch save the used slots and the next start restores
them; a crash saves nothing; a failing save is a warning and the stop goes on; old files are
bounded. The real llama-server's figures are tests/test_real_llama_kvcache.py's."""

from __future__ import annotations

import http.client
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent.protocol import KV_MAX_FILES
from llmproxy.agent.state import records
from tests import sshd as sshd_harness
from tests.managed import agent_argv, managed_config, managed_host, sim_command
from tests.procs import Proxy, free_port, wait_gone

pytestmark = pytest.mark.integration

PROMPT = " ".join(f"w{i}" for i in range(400))   # the long shared system prompt
FILES = "llmproxy-{engine}-slot0.bin"


def kept(port: int, model: str, slots: Path, *extra: str) -> dict[str, Any]:
    """A simulated llama-server on `port` whose slots are saved in `slots`, kept."""
    slots.mkdir(exist_ok=True)
    return {"command": sim_command(port, model, "--slot-save-path", str(slots), *extra),
            "start_timeout_seconds": 20, "kv_cache": "keep"}


def ask(port: int, model: str, question: str = "hi") -> int:
    """A non-streamed chat with the long system prompt: the prompt words the engine had
    to process (its `timings.prompt_n`)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": model, "max_tokens": 2, "messages": [
        {"role": "system", "content": PROMPT}, {"role": "user", "content": question}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    answer = conn.getresponse()
    doc = json.loads(answer.read())
    assert answer.status == 200, doc
    return int(doc["timings"]["prompt_n"])


def stop_engines(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    # by hand: never refused by a lease, and never a save (no save_kv)
    sshd.run(*agent_argv(tmp_path / "agent"), "stop", "--host", "gpu1", input="")


def log(proxy: Proxy) -> str:
    return "\n".join(list(proxy.lines))


def test_an_idle_stop_saves_the_slots_and_the_next_start_restores_them(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """The first request processes the whole prompt; the idle stop saves the used slot (file
    named by engine and slot); the next request starts the engine, which is restored before
    it serves: it processes only the new words. Stale files of others beyond the bound go."""
    port, slots = free_port(), tmp_path / "slots"
    engine = kept(port, "m", slots)
    for i in range(KV_MAX_FILES + 4):       # other engines' old files, oldest first
        old = slots / FILES.format(engine=f"old{i}")
        old.write_bytes(b"x")
        os.utime(old, (1000 + i, 1000 + i))
    host = managed_host(sshd, tmp_path, port, {"a": engine}, min_engine_seconds=0)
    proxy = Proxy(managed_config(sshd, tmp_path, [host], {"m": {"host": "gpu1", "engine": "a"}},
                                 idle_stop_seconds=1.5), tmp_path)
    try:
        assert ask(proxy.port, "m") == 401
        proxy.wait_for(r"kept the prompt cache of a on gpu1: 1 slot\(s\), 401 tokens", 20)
        proxy.wait_for(r"idle stop of a on gpu1: stopped", 20)
        assert (slots / FILES.format(engine="a")).is_file()
        left = sorted(p.name for p in slots.glob("*.bin"))
        assert len(left) == KV_MAX_FILES and FILES.format(engine="a") in left
        assert FILES.format(engine="old0") not in left       # the oldest went first
        assert ask(proxy.port, "m", "again") == 1           # only the new question
        proxy.wait_for(r"restored the prompt cache of a on gpu1: 1 slot\(s\), 401 tokens", 10)
    finally:
        proxy.stop()
        stop_engines(sshd, tmp_path)


def test_an_eviction_saves_and_a_failing_save_never_blocks_the_stop(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """A host with room for one engine of two: asking for b evicts a, whose slots are saved
    first; asking for a again evicts b, whose engine fails every save (a warning, the stop
    done all the same), and a comes back restored."""
    pa, pb = free_port(), free_port()
    host = managed_host(sshd, tmp_path, pa, {
        "a": {**kept(pa, "ma", tmp_path / "sa"), "url": f"http://127.0.0.1:{pa}",
              "memory_gb": 4},
        "b": {**kept(pb, "mb", tmp_path / "sb", "--slot-save", "fail"),
              "url": f"http://127.0.0.1:{pb}", "memory_gb": 4},
    }, memory_gb=4, min_engine_seconds=0)
    models = {"ma": {"host": "gpu1", "engine": "a"}, "mb": {"host": "gpu1", "engine": "b"}}
    proxy = Proxy(managed_config(sshd, tmp_path, [host], models), tmp_path)
    try:
        assert ask(proxy.port, "ma") == 401
        assert ask(proxy.port, "mb") == 401                 # evicts a
        proxy.wait_for(r"kept the prompt cache of a on gpu1: 1 slot\(s\)", 20)
        assert ask(proxy.port, "ma", "again") == 1          # evicts b, restores a
        proxy.wait_for(r"save of the prompt cache of b on gpu1 failed \(the engine goes on "
                       r"without it\): .*HTTP 500", 20)
        proxy.wait_for(r"stop of b on gpu1 \(evicted for a\): stopped", 20)
        assert not list((tmp_path / "sb").glob("llmproxy-b-slot*"))
    finally:
        proxy.stop()
        stop_engines(sshd, tmp_path)


def test_a_switch_saves_the_engine_it_replaces(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """One engine at a time on one port: the switch to b (the agent stops a on b's start)
    saves a's slots, and the switch back restores them."""
    port = free_port()
    host = managed_host(sshd, tmp_path, port, {"a": kept(port, "ma", tmp_path / "sa"),
                                               "b": kept(port, "mb", tmp_path / "sb")},
                        min_engine_seconds=0)
    models = {"ma": {"host": "gpu1", "engine": "a"}, "mb": {"host": "gpu1", "engine": "b"}}
    proxy = Proxy(managed_config(sshd, tmp_path, [host], models), tmp_path)
    try:
        assert ask(proxy.port, "ma") == 401
        assert ask(proxy.port, "mb") == 401
        proxy.wait_for(r"kept the prompt cache of a on gpu1: 1 slot\(s\), 401 tokens", 20)
        assert ask(proxy.port, "ma", "again") == 1
        proxy.wait_for(r"kept the prompt cache of b on gpu1", 20)
        proxy.wait_for(r"restored the prompt cache of a on gpu1: 1 slot\(s\), 401 tokens", 10)
    finally:
        proxy.stop()
        stop_engines(sshd, tmp_path)


def test_a_crash_saves_nothing(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """An engine killed under the proxy is a crash, not a stop the proxy chose: nothing is
    saved, and its restart restores nothing."""
    port, slots = free_port(), tmp_path / "slots"
    host = managed_host(sshd, tmp_path, port, {"a": kept(port, "m", slots)},
                        min_engine_seconds=0)
    proxy = Proxy(managed_config(sshd, tmp_path, [host], {"m": {"host": "gpu1", "engine": "a"}}),
                  tmp_path)
    try:
        assert ask(proxy.port, "m") == 401
        [record] = records(tmp_path / "agent" / "hosts" / "gpu1")
        os.kill(record["engine_pid"], signal.SIGKILL)
        assert wait_gone(record["pid"], 10)
        proxy.wait_for(r"engine a on gpu1 died \(signal 9\)", 20)
        assert ask(proxy.port, "m") == 401     # served by its restart, nothing restored
        assert not list(slots.glob("llmproxy-*")), list(slots.iterdir())
        assert "prompt cache" not in log(proxy)
    finally:
        proxy.stop()
        stop_engines(sshd, tmp_path)


