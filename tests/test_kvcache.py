"""A kept prompt cache (``"kv_cache": "keep"``), unit by unit with fakes: the agent's save and
restore (llmproxy/agent/kvcache.py) against a fake engine API and a temporary slot directory,
the config key, the orders the proxy sends for each kind of stop (hosts/agentcalls.py) and the
events it publishes from the answers (hosts/kvreport.py, core/kvcache.py)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock

from llmproxy.agent import kvcache
from llmproxy.agent.protocol import KV_CACHE, SAVE_KV
from llmproxy.config import ConfigError, EngineConfig, HostConfig, parse_config
from llmproxy.config.kvcache import needs_swa_full
from llmproxy.core.events import Event
from llmproxy.core.kvcache import KvFailed, KvRestored, KvSaved
from llmproxy.hosts.agentcalls import AgentCalls
from llmproxy.testing.agentfakes import FakeAgentTransport

URL = "http://127.0.0.1:9"


class FakeEngine:
    """llama-server's slot API as `kvcache.Request` calls it: `slots` maps a slot id to the
    prompt tokens it holds (0: never used); saves write a file of `size` bytes."""

    def __init__(self, where: Path, slots: dict[int, int], size: int = 100) -> None:
        self.where, self.slots, self.size = where, dict(slots), size
        self.calls: list[tuple[str, str, Any]] = []
        self.fail: str | None = None      # "save" or "restore": answer 500
        self.hang = threading.Event()     # set: a save never answers (until released)
        self.release = threading.Event()

    def __call__(self, method: str, url: str, body: Any, timeout: float) -> tuple[int, Any]:
        self.calls.append((method, url[len(URL):], body))
        if url.endswith("/slots"):
            return 200, [{"id": s, "n_ctx": 4096, **({"id_task": 1, "n_prompt_tokens": n}
                                                      if n else {})}
                         for s, n in self.slots.items()]
        slot, action = int(url.split("/slots/")[1].partition("?")[0]), url.rsplit("=", 1)[1]
        if self.fail == action:
            return 500, {"error": {"message": f"simulated {action} failure"}}
        if action == "save":
            if self.hang.is_set():
                self.release.wait(30)
                return 599, None
            (self.where / body["filename"]).write_bytes(b"k" * self.size)
            return 200, {"n_saved": self.slots[slot], "n_written": self.size}
        return 200, {"n_restored": 7, "n_read": self.size}


def record(where: Path, engine: str = "e", model: str = "m.gguf", **keep: Any) -> dict[str, Any]:
    command = ["llama-server", "-m", model, "--slot-save-path", str(where), "--swa-full"]
    return {"engine": engine, "pid": 1, "command": command, "health_url": URL + "/health",
            KV_CACHE: kvcache.keep_field(kvcache.Keep(**keep), command)}


def test_save_writes_each_used_slot_by_engine_and_slot_then_restore_loads_them(
        tmp_path: Path) -> None:
    """A save writes only the slots that hold a prompt, named by engine and slot, with the
    command's digest; a restore of the same command loads exactly those slots back."""
    fake = FakeEngine(tmp_path, {0: 0, 1: 2000, 2: 30})
    done = kvcache.save_all([record(tmp_path)], fake)
    assert done == {"e": {"saved": [1, 2], "tokens": 2030, "bytes": 200, "pruned": []}}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "llmproxy-e-slot1.bin", "llmproxy-e-slot2.bin", "llmproxy-e.json"]
    fake.calls.clear()
    assert kvcache.restore(record(tmp_path), fake) == {"restored": [1, 2], "tokens": 14}
    assert [(m, u) for m, u, _ in fake.calls] == [
        ("POST", "/slots/1?action=restore"), ("POST", "/slots/2?action=restore")]
    assert fake.calls[0][2] == {"filename": "llmproxy-e-slot1.bin"}


def test_a_changed_command_or_model_discards_the_files_instead_of_restoring(
        tmp_path: Path) -> None:
    """Saved under one command, restored under another (another model file): the files go and
    nothing is restored; a model file replaced in place changes the digest too."""
    fake = FakeEngine(tmp_path, {0: 50})
    model = tmp_path / "m.gguf"
    model.write_bytes(b"one")
    kvcache.save_all([record(tmp_path, model=str(model))], fake)
    fake.calls.clear()
    assert kvcache.restore(record(tmp_path, model="other.gguf"), fake) == {
        "restored": [], "tokens": 0, "discarded": 1}
    assert fake.calls == [] and not list(tmp_path.glob("llmproxy-*"))
    running = record(tmp_path, model=str(model))    # its digest: taken at its start
    model.write_bytes(b"a new model")                  # replaced while the engine runs
    kvcache.save_all([running], fake)                 # saved as what the engine loaded
    assert kvcache.restore(record(tmp_path, model=str(model)), fake)["discarded"] == 1


def test_files_are_bounded_in_number_and_size_the_oldest_removed(tmp_path: Path) -> None:
    """After a save the slot directory keeps at most max_files slot files and max_bytes of
    them: the oldest (other engines' included) go first; other files are never touched."""
    for i in range(5):
        old = tmp_path / kvcache.slot_file(f"old{i}", 0)
        old.write_bytes(b"x" * 100)
        os.utime(old, (1000 + i, 1000 + i))
    (tmp_path / "model.gguf").write_bytes(b"m")
    fake = FakeEngine(tmp_path, {0: 10, 1: 10})
    done = kvcache.save_all([record(tmp_path, max_files=4, max_bytes=10**6)], fake)["e"]
    assert done["pruned"] == ["llmproxy-old0-slot0.bin", "llmproxy-old1-slot0.bin",
                              "llmproxy-old2-slot0.bin"]
    done = kvcache.save_all([record(tmp_path, max_files=99, max_bytes=250)], fake)["e"]
    assert done["pruned"] == ["llmproxy-old3-slot0.bin", "llmproxy-old4-slot0.bin"]
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == [
        "llmproxy-e-slot0.bin", "llmproxy-e-slot1.bin"]
    assert (tmp_path / "model.gguf").exists()


def test_a_failing_or_hanging_save_is_an_error_within_the_deadline(tmp_path: Path) -> None:
    """A save the engine refuses is an error; one that never answers is cut at its deadline
    (the stop goes on); an engine not kept is not saved at all."""
    fake = FakeEngine(tmp_path, {0: 10})
    fake.fail = "save"
    said = kvcache.save_all([record(tmp_path)], fake)["e"]
    assert said == {"error": "saving the slots of e: saving slot 0 answered HTTP 500: "
                             "simulated save failure"}
    fake.fail = None
    fake.hang.set()
    try:
        said = kvcache.save_all([record(tmp_path, deadline=0.2)], fake)["e"]
    finally:
        fake.release.set()
    assert said == {"error": "saving the slots of e not done within 0.2 s"}
    plain = {k: v for k, v in record(tmp_path).items() if k != KV_CACHE}
    assert kvcache.save_all([plain], fake) == {}
    assert kvcache.restore(plain, fake) is None


def test_a_failing_restore_is_an_error_and_an_unreachable_engine_too(tmp_path: Path) -> None:
    """A restore the engine refuses, or an engine that does not answer, is said as an error,
    never raised."""
    fake = FakeEngine(tmp_path, {0: 10})
    kvcache.save_all([record(tmp_path)], fake)
    fake.fail = "restore"
    assert "restoring slot 0 answered HTTP 500" in kvcache.restore(record(tmp_path), fake)["error"]
    gone = {**record(tmp_path), "health_url": "http://127.0.0.1:1/health"}
    assert "saving the slots of e: " in kvcache.save_all([gone])["e"]["error"]


def test_the_start_order_field_is_checked() -> None:
    """A start order's kv_cache is an object of positive bounds, else bad input."""
    assert kvcache.of_order({}) is None
    assert kvcache.of_order({KV_CACHE: {"deadline": 3}}) == kvcache.Keep(deadline=3)
    for bad in ([], {"deadline": 0}, {"max_files": 1.5}, {"max_bytes": True}):
        with pytest.raises(ValueError):
            kvcache.of_order({KV_CACHE: bad})


def _config(engine: dict[str, Any]) -> dict[str, Any]:
    return {"listen": "127.0.0.1:0", "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081",
            "ssh": "root@10.0.0.5", "engines": {"e": engine}}],
            "models": {"m": {"host": "gpu1", "engine": "e"}}}


def test_config_kv_cache_keep_needs_slot_save_path() -> None:
    """kv_cache "keep" on a command without --slot-save-path is an error naming the field;
    "keep" with it, and "drop", are accepted; anything else is refused."""
    with pytest.raises(ConfigError, match=r"hosts\[0\]\.engines\.e\.kv_cache: \"keep\" needs "
                       r"--slot-save-path DIR"):
        parse_config(_config({"command": ["llama-server"], "kv_cache": "keep"}))
    with pytest.raises(ConfigError, match=r"engines\.e\.kv_cache: must be \"keep\" or \"drop\""):
        parse_config(_config({"command": ["llama-server"], "kv_cache": True}))
    kept = parse_config(_config({"command": ["llama-server", "--slot-save-path=/kv"],
                                 "kv_cache": "keep"}))
    assert kept.hosts[0].engines["e"].kv_cache == "keep"
    assert parse_config(_config({"command": ["x"]})).hosts[0].engines["e"].kv_cache == "drop"


def test_needs_swa_full_names_sliding_window_models_without_the_flag() -> None:
    """Gemma 3 without --swa-full needs it; with it, or another model, does not."""
    gemma = ["llama-server", "-m", "/m/gemma3-270m-q4_k_m.gguf"]
    assert needs_swa_full(gemma) == "/m/gemma3-270m-q4_k_m.gguf"
    assert needs_swa_full([*gemma, "--swa-full"]) is None
    assert needs_swa_full(["llama-server", "--model=/m/qwen2.5-7b.gguf"]) is None


def _calls(kv_cache: str = "keep") -> tuple[AgentCalls, FakeAgentTransport, list[Event], Clock]:
    engines = {"a": EngineConfig("a", ("llama-server", "--slot-save-path", "/kv"),
                                 kv_cache=kv_cache),
               "b": EngineConfig("b", ("other",))}
    host = HostConfig("gpu1", "http://10.0.0.5:8081", "root@10.0.0.5", engines=engines)
    transport, events, clock = FakeAgentTransport(), [], Clock()
    return AgentCalls(host, transport, 10.0, clock, events.append), transport, events, clock


def test_planned_stops_ask_for_a_save_a_hung_engines_stop_does_not() -> None:
    """On a host with a kept engine, a stop the proxy chose and a switch carry save_kv (and
    wait the save's deadline longer); the stop of a hung engine does not; a start of the kept
    engine carries its kv_cache; a host without a kept engine sends neither."""
    calls, transport, _, _ = _calls()
    ensureDeferred(calls.stop("a"))
    ensureDeferred(calls.stop("a", save=False))
    ensureDeferred(calls.start("a", exclusive=True))
    ensureDeferred(calls.start("b", exclusive=False))
    stop, hung, switch, beside = (c.order for c in transport.calls)
    assert stop[SAVE_KV] is True and SAVE_KV not in hung
    assert transport.calls[0].timeout > transport.calls[1].timeout
    assert switch[SAVE_KV] is True and switch[KV_CACHE] == {"deadline": 15.0}
    assert KV_CACHE not in beside and SAVE_KV not in beside
    calls, transport, _, _ = _calls("drop")
    ensureDeferred(calls.stop("a"))
    ensureDeferred(calls.start("a", exclusive=True))
    assert all(SAVE_KV not in c.order and KV_CACHE not in c.order for c in transport.calls)


def test_the_answers_kv_results_are_published_as_events() -> None:
    """A stop's saved slots are an engine.kv_saved event, a failed save an engine.kv_failed
    warning (the stop still succeeds), a start's restore engine.kv_restored."""
    calls, transport, events, clock = _calls()
    clock.advance(5)
    stopped: Deferred[str | None] = ensureDeferred(calls.stop(None))
    transport.calls[0].answer({"ok": True, "stopped": [
        {"engine": "a", "pid": 1, "killed": False,
         KV_CACHE: {"saved": [0, 1], "tokens": 2090, "bytes": 14 << 20, "pruned": ["x"]}},
        {"engine": "c", "pid": 2, "killed": False, KV_CACHE: {"error": "HTTP 500"}},
        {"engine": "b", "pid": 3, "killed": False}]})
    assert stopped.result is None
    started: Deferred[str | None] = ensureDeferred(calls.start("a", exclusive=False))
    transport.calls[1].answer({"ok": True, "engine": "a", "stopped": [],
                               KV_CACHE: {"restored": [0, 1], "tokens": 2090}})
    assert started.result is None
    assert events == [KvSaved(5, "gpu1", "a", (0, 1), 2090, 14 << 20, 1),
                      KvFailed(5, "gpu1", "c", "save", "HTTP 500"),
                      KvRestored(5, "gpu1", "a", (0, 1), 2090)]
    level, text = events[1].line()
    assert level == "warn" and "save of the prompt cache of c on gpu1 failed" in text
    assert json.dumps(events[0].fields())


def test_doctor_says_when_a_kept_cache_needs_swa_full() -> None:
    """`llmproxy doctor`: a kept Gemma 3 engine without --swa-full is a warning whose fix names
    the flag and the field; with the flag the row is ok; a cache not kept has no row."""
    from llmproxy.cli import doctor
    from llmproxy.config import Config
    from llmproxy.config.values import ListenAddress

    def rows(command: tuple[str, ...], kv_cache: str = "keep") -> dict[str, doctor.Row]:
        engine = EngineConfig("g", command, kv_cache=kv_cache)
        host = HostConfig("gpu1", "http://10.0.0.5:8081", "llm@10.0.0.5", engines={"g": engine})
        found = {"python": "3.11.2", "engines": {"g": {"executable": "/usr/bin/llama-server",
                                                       "models": []}},
                 "listening": [], "nvidia_smi": None, "gpus": None, "gpu_error": None}

        def run(argv: list[str], **kwargs: Any) -> Any:
            import subprocess
            return subprocess.CompletedProcess(argv, 0, json.dumps(found) + "\n", "")

        def agent(config: Config, host: HostConfig) -> tuple[dict[str, Any], None]:
            return {"ok": True, "protocol": 4, "engines": [], "lease": None}, None

        config = Config(listen=ListenAddress("127.0.0.1", 8080), hosts=(host,))
        return {r.check: r for r in doctor.check_host(config, host, run=run, agent=agent)}

    gemma = ("llama-server", "-m", "/m/gemma-3-4b-it.gguf", "--slot-save-path", "/kv")
    row = rows(gemma)["g: kv_cache"]
    assert row.status == "warn" and "sliding-window" in row.detail
    assert row.fix.startswith("add --swa-full to engines.g.command")
    assert rows((*gemma, "--swa-full"))["g: kv_cache"].status == "ok"
    assert "g: kv_cache" not in rows(gemma, "drop")


def test_the_agent_refuses_a_kept_start_without_a_slot_directory(tmp_path: Path) -> None:
    """A start order with kv_cache whose command gives no --slot-save-path, or a malformed
    kv_cache, is bad input (exit status 2), refused before anything starts."""
    from llmproxy.agent.main import run
    from llmproxy.agent.orders import BadInput

    order = {"protocol": 4, "op": "start", "engine": "e", "command": ["llama-server"],
             "health_url": URL + "/health", KV_CACHE: {}}
    with pytest.raises(BadInput, match="kv_cache needs --slot-save-path DIR in the command"):
        run(order, tmp_path, by_hand=True)
    with pytest.raises(BadInput, match=r"kv_cache\.deadline must be a positive number"):
        run({**order, "command": ["x", "--slot-save-path=/kv"], KV_CACHE: {"deadline": -1}},
            tmp_path, by_hand=True)
    assert not (tmp_path / "e.json").exists() and not list(tmp_path.glob("**/*.log"))


def test_llmproxy_check_names_the_field_and_exits_78(tmp_path: Path) -> None:
    """`llmproxy check` on a kept engine without --slot-save-path: exit 78 (a config error),
    the message naming hosts[0].engines.e.kv_cache and the flag."""
    import subprocess
    import sys

    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(_config({"command": ["llama-server"], "kv_cache": "keep"})))
    done = subprocess.run([sys.executable, "-m", "llmproxy.cli", "check", "-c", str(path)],
                          capture_output=True, text=True, timeout=60, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 78, done
    assert 'hosts[0].engines.e.kv_cache: "keep" needs --slot-save-path DIR' in done.stderr + \
        done.stdout
