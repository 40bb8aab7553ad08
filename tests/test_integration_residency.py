"""Several engines resident on one host (a host with `memory_gb`), for real:
twistd llmproxy drives llmproxy-agent over a real sshd on 127.0.0.1, and the
agent runs simulated engines, each on a port of its own, as the engine
commands: engines that run together, eviction of the idle one least recently
used (never the busy one, never cutting its stream), a per-engine TTL, a
preload list, the config errors `check` and twistd refuse, an upgrade that
adopts every resident engine without a restart, and an operator's stop of one
engine."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmproxy.agent.state import records
from tests import sshd as sshd_harness
from tests.managed import agent_argv, managed_config, managed_host, sim_command
from tests.procs import (
    BodyReader,
    Proxy,
    env,
    free_port,
    gone,
    stop_successor,
    wait_gone,
    wait_new_pid,
    wait_until,
)
from tests.test_integration_observe import Events

pytestmark = pytest.mark.integration

GB = 4          # what every engine here holds of its host's memory_gb


def agent(tmp_path: Path) -> list[str]:
    """The real agent, run through ssh from the checked-out code."""
    return agent_argv(tmp_path / "agent")


def engine_command(port: int, model: str) -> list[str]:
    return sim_command(port, model)


def config(sshd: sshd_harness.SSHD, tmp_path: Path, engines: str, memory_gb: float,
           engine_extra: dict[str, dict[str, Any]] | None = None,
           host_extra: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A budgeted host gpu1 whose engines (one letter each, `GB` apiece) listen on
    ports of their own: the first on the host's url, the others on their own;
    model `mX` runs on engine `X`. No residency (min_engine_seconds 0) unless
    `host_extra` gives one: these tests are about eviction itself."""
    ports = {name: free_port() for name in engines}
    first = engines[0]
    table: dict[str, Any] = {}
    for name in engines:
        table[name] = {"command": engine_command(ports[name], f"m{name}"), "memory_gb": GB,
                       "start_timeout_seconds": 20,
                       **({} if name == first else {"url": f"http://127.0.0.1:{ports[name]}"}),
                       **(engine_extra or {}).get(name, {})}
    host = managed_host(sshd, tmp_path, ports[first], table, memory_gb=memory_gb,
                        min_engine_seconds=0, **(host_extra or {}))
    return managed_config(sshd, tmp_path, [host],
                          {f"m{name}": {"host": "gpu1", "engine": name} for name in engines},
                          **{"idle_stop_seconds": 300, **extra})


def agent_status(sshd: sshd_harness.SSHD, tmp_path: Path) -> dict[str, dict[str, Any]]:
    """What the agent reports running, asked over ssh by hand (`llmproxy-agent
    status`): engine name -> its entry (pid, healthy, started_at)."""
    done = sshd.run(*agent(tmp_path), "status", "--host", "gpu1")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["ok"] is True and answer["protocol"] == 4, answer
    return {e["engine"]: e for e in answer["engines"]}


def stop_engines(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    # by hand: never refused by a lease
    sshd.run(*agent(tmp_path), "stop", "--host", "gpu1", input="")


def post(port: int, model: str, stream: bool = False, **headers: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": model, "stream": stream}),
                 headers)
    return conn.getresponse()


def answered(port: int, model: str) -> bool:
    """A non-streamed request for `model` answered 200 by that model (at once: the
    simulated engine's pace between tokens is for the streams)."""
    resp = post(port, model, **{"X-Sim-Delay": "0"})
    body = resp.read()
    return resp.status == 200 and json.loads(body)["model"] == model


def states(proxy: Proxy) -> dict[str, str]:
    """model -> its `llmproxy.state` in /v1/models."""
    return {m["id"]: m["llmproxy"]["state"] for m in proxy.get_json("/v1/models")["data"]}


def metrics(proxy: Proxy) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from /metrics."""
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def log(proxy: Proxy) -> str:
    """What the proxy (and, after an upgrade, its successor) printed so far. Not
    `output()`: once the first process has exited that waits for the end of the
    pipe, which the successor holds open."""
    return "\n".join(list(proxy.lines))


def stops(proxy: Proxy) -> list[str]:
    """Every stop the proxy logged: `stop of E on gpu1 (why)` / `idle stop of E`."""
    return re.findall(r"(?:idle stop of \w+ on gpu1|stop of \w+ on gpu1 \([^)]*\))(?=: stopped)",
                      log(proxy))


def long_stream(port: int, model: str, tokens: int = 40, delay: float = 0.12) -> BodyReader:
    """A stream of `tokens` tokens `delay` s apart (about 5 s: engine starts, evictions
    and an upgrade's hand-over fit inside it), read in the background."""
    return BodyReader(post(port, model, stream=True,
                           **{"X-Sim-Delay": str(delay), "X-Sim-Tokens": str(tokens)}))


def whole(stream: BodyReader, tokens: int, proxy: Proxy) -> None:
    """The stream ended without error, with every token and then `[DONE]`."""
    stream.join(30)
    assert not stream.is_alive() and stream.error is None, (stream.error, log(proxy))
    assert stream.body.count(b"tok") == tokens, stream.body
    assert stream.body.rstrip().endswith(b"data: [DONE]"), stream.body[-200:]


def test_two_engines_resident_at_once(sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """Engines a and b (4 GB each) on a host of 10 GB: both start, neither stops the
    other, both answer; the agent runs both; /v1/models says loaded for both and
    unloaded for c; /metrics has llmproxy_engine_resident for both and 8 GB used."""
    proxy = Proxy(config(sshd, tmp_path, "abc", 10), tmp_path)
    try:
        assert states(proxy) == {"ma": "unloaded", "mb": "unloaded", "mc": "unloaded"}
        assert answered(proxy.port, "ma")
        assert answered(proxy.port, "mb")
        assert answered(proxy.port, "ma")            # a still runs beside b
        running = agent_status(sshd, tmp_path)
        assert sorted(running) == ["a", "b"] and all(e["healthy"] for e in running.values())
        assert states(proxy) == {"ma": "loaded", "mb": "loaded", "mc": "unloaded"}
        found = metrics(proxy)
        for name in ("a", "b"):
            assert found[("llmproxy_engine_resident", (("engine", name), ("host", "gpu1")))] == 1
        assert ("llmproxy_engine_resident", (("engine", "c"), ("host", "gpu1"))) not in found
        assert found[("llmproxy_host_memory_used_gb", (("host", "gpu1"),))] == 2 * GB
        engine = proxy.get_json("/status")["hosts"][0]["engine"]
        assert engine["memory_gb"] == {"used": 2 * GB, "budget": 10}
        assert sorted((r["engine"], r["state"]) for r in engine["resident"]) == [
            ("a", "loaded"), ("b", "loaded")]
        assert stops(proxy) == []
    finally:
        proxy.stop()
        stop_engines(sshd, tmp_path)


def test_eviction_stops_the_idle_engine_never_the_busy_one(sshd: sshd_harness.SSHD,
                                                           tmp_path: Path) -> None:
    """a and b fill the 8 GB; b streams (and is the least recently used of the two:
    a answered after the stream began) when c is asked for: a, idle, is stopped
    `evicted for c` (log and engine.idle_stop event), c starts and answers while the
    stream on b goes on, the stream completes whole, and b is never stopped."""
    proxy = Proxy(config(sshd, tmp_path, "abc", 8), tmp_path)
    events = Events(proxy.port)
    try:
        assert answered(proxy.port, "ma") and answered(proxy.port, "mb")
        b_pid = agent_status(sshd, tmp_path)["b"]["pid"]
        stream = long_stream(proxy.port, "mb")
        assert wait_until(lambda: proxy.get_json("/status")["hosts"][0]["engine"]
                          ["in_flight"] == 1)
        assert answered(proxy.port, "ma")            # a is now used more recently than b
        assert answered(proxy.port, "mc")            # evicts a, not the LRU but busy b
        assert stream.is_alive(), "the stream ended before c started: raise its tokens"
        whole(stream, 40, proxy)
        assert stops(proxy) == ["stop of a on gpu1 (evicted for c)"]
        running = agent_status(sshd, tmp_path)
        assert sorted(running) == ["b", "c"] and running["b"]["pid"] == b_pid
        done = events.wait(lambda m: m["event"] == "engine.idle_stop"
                           and m["data"]["stage"] == "done")
        assert (done["data"]["engine"], done["data"]["why"]) == ("a", "evicted for c")
    finally:
        events.close()
        proxy.stop()
        stop_engines(sshd, tmp_path)


def test_the_least_recently_used_idle_engine_goes_first(sshd: sshd_harness.SSHD,
                                                        tmp_path: Path) -> None:
    """a, b and c fill the 12 GB, started in that order, then a is used again: d
    evicts b (least recently used), not a (started first) nor c, and only b."""
    proxy = Proxy(config(sshd, tmp_path, "abcd", 12), tmp_path)
    try:
        for model in ("ma", "mb", "mc", "ma"):
            assert answered(proxy.port, model)
        pids = {e: r["pid"] for e, r in agent_status(sshd, tmp_path).items()}
        assert sorted(pids) == ["a", "b", "c"]
        assert answered(proxy.port, "md")
        assert stops(proxy) == ["stop of b on gpu1 (evicted for d)"]
        running = agent_status(sshd, tmp_path)
        assert sorted(running) == ["a", "c", "d"]
        assert (running["a"]["pid"], running["c"]["pid"]) == (pids["a"], pids["c"])
        assert wait_gone(pids["b"], 10)
        assert states(proxy) == {"ma": "loaded", "mb": "unloaded", "mc": "loaded",
                                 "md": "loaded"}
    finally:
        proxy.stop()
        stop_engines(sshd, tmp_path)


def test_an_engines_own_ttl_stops_it_and_leaves_the_other(sshd: sshd_harness.SSHD,
                                                          tmp_path: Path) -> None:
    """engines.a.idle_stop_seconds 2 (the top-level one 300): about 2 s after its last
    request a is stopped (`ttl`) and its process ends; b, used before a, runs on."""
    ttl = 2.0
    proxy = Proxy(config(sshd, tmp_path, "ab", 8,
                         engine_extra={"a": {"idle_stop_seconds": ttl}}), tmp_path)
    try:
        assert answered(proxy.port, "mb")
        assert answered(proxy.port, "ma")
        used = time.monotonic()
        # The agent's own records, read at once (a status call over ssh could take
        # longer than the TTL).
        pids = {r["engine"]: r["pid"] for r in records(tmp_path / "agent" / "hosts" / "gpu1")}
        assert sorted(pids) == ["a", "b"]
        proxy.wait_for(r"stop of a on gpu1 \(ttl\): stopped in", timeout=15)
        assert time.monotonic() - used >= ttl
        assert wait_gone(pids["a"], 10)
        assert stops(proxy) == ["stop of a on gpu1 (ttl)"]
        running = agent_status(sshd, tmp_path)
        assert list(running) == ["b"] and running["b"]["pid"] == pids["b"]
        assert states(proxy) == {"ma": "unloaded", "mb": "loaded"}
        assert proxy.get_json("/status")["hosts"][0]["engine"]["idle_stop_in_seconds"] > 200
    finally:
        proxy.stop()
        stop_engines(sshd, tmp_path)


def test_a_preload_list_starts_each_engine_in_order_before_any_request(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """`preload: ["b", "a"]`: both start at start-up, b first, with no request sent
    (neither engine has seen a POST); c is not started."""
    cfg = config(sshd, tmp_path, "abc", 12, host_extra={"preload": ["b", "a"]})
    proxy = Proxy(cfg, tmp_path)
    try:
        want = {"ma": "loaded", "mb": "loaded", "mc": "unloaded"}
        assert wait_until(lambda: states(proxy) == want, timeout=30), \
            (states(proxy), log(proxy)[-4000:])
        # The states come over HTTP; the log's lines through the test's reader thread,
        # which may not have read them yet: wait for the last one asserted on.
        proxy.wait_for(r"engine a on gpu1 ready", 10)
        out = log(proxy)
        assert out.index("engine b on gpu1 ready") < out.index("starting a on gpu1")
        assert out.index("starting a on gpu1") < out.index("engine a on gpu1 ready")
        running = agent_status(sshd, tmp_path)
        assert sorted(running) == ["a", "b"]
        assert running["b"]["started_at"] < running["a"]["started_at"]
        for name in ("a", "b"):
            url = cfg["hosts"][0]["engines"][name].get("url", cfg["hosts"][0]["url"])
            with urllib.request.urlopen(url + "/sim/requests", timeout=5) as r:
                assert json.load(r) == [], name
        assert "POST /v1/chat/completions" not in out
    finally:
        proxy.stop()
        stop_engines(sshd, tmp_path)


BAD_BUDGET_ERRORS = (
    "hosts[0].preload: a, b need 12 GB together, more than the host's memory_gb (8)",
    "hosts[0].engines.c.url: the same as engine b's (http://127.0.0.1:9002): engines that "
    "run together need their own url",
    "hosts[0].engines.d.memory_gb: 16 is more than the host's memory_gb (8)",
)


def bad_budget_config(tmp_path: Path) -> dict[str, Any]:
    """A budgeted host with each of the three budget errors `check` names."""
    command = [sys.executable, "-c", "pass"]
    return {"runtime_dir": str(tmp_path / "locks"), "hosts": [{
        "name": "gpu1", "url": "http://127.0.0.1:9001", "ssh": "llm@192.0.2.1",
        "memory_gb": 8, "preload": ["a", "b"], "engines": {
            "a": {"command": command},
            "b": {"command": command, "memory_gb": 4, "url": "http://127.0.0.1:9002"},
            "c": {"command": command, "memory_gb": 4, "url": "http://127.0.0.1:9002"},
            "d": {"command": command, "memory_gb": 16, "url": "http://127.0.0.1:9003"}}}],
        "models": {"m": {"host": "gpu1", "engine": "b"}}}


def test_budget_errors_are_refused_by_check_and_by_twistd(tmp_path: Path) -> None:
    """A preload that needs more than the budget (a states no memory_gb: it counts for the
    whole budget), two of its engines on one url,
    an engine larger than the budget: `llmproxy check` exits 78 naming each, and
    twistd llmproxy refuses to start on the same file with 78, naming each too."""
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(bad_budget_config(tmp_path)))
    done = subprocess.run([sys.executable, "-m", "llmproxy.cli", "check", "-c", str(path)],
                          capture_output=True, text=True, env=env(), timeout=60, check=False)
    assert done.returncode == 78, done
    for error in BAD_BUDGET_ERRORS:
        assert error in done.stderr, done.stderr
    assert f"llmproxy check: {path}: 3 errors" in done.stderr
    proxy = Proxy(bad_budget_config(tmp_path), tmp_path, wait_ready=False)
    try:
        assert proxy.popen.wait(30) == 78
        out = proxy.output()      # it has exited: every line
        for error in BAD_BUDGET_ERRORS:
            assert error in out, out
        assert "Traceback" not in out and "ready: listening" not in out
    finally:
        proxy.stop()


def test_an_upgrade_adopts_both_resident_engines_without_a_restart(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """SIGUSR1 with a and b resident: the successor adopts both (each logged, same
    pids per the agent, no start after the upgrade), lists both loaded, and both
    answer from it; the old process exits 0."""
    proxy = Proxy(config(sshd, tmp_path, "abc", 8), tmp_path)
    successor = None
    try:
        assert answered(proxy.port, "ma") and answered(proxy.port, "mb")
        before = {e: r["pid"] for e, r in agent_status(sshd, tmp_path).items()}
        assert sorted(before) == ["a", "b"]
        starts = len(re.findall(r"engine \w+ on gpu1 ready in", log(proxy)))
        assert starts == 2
        proxy.signal(signal.SIGUSR1)
        successor = wait_new_pid(proxy, proxy.pid)
        assert proxy.popen.wait(20) == 0
        assert states(proxy) == {"ma": "loaded", "mb": "loaded", "mc": "unloaded"}
        assert answered(proxy.port, "ma") and answered(proxy.port, "mb")
        after = {e: r["pid"] for e, r in agent_status(sshd, tmp_path).items()}
        assert after == before
        for name in ("a", "b"):     # (lines that come through the reader thread: waited for)
            proxy.wait_for(rf"adopted engine {name} on gpu1 \(pid {before[name]}\), no restart",
                           10)
        out = log(proxy)
        assert len(re.findall(r"engine \w+ on gpu1 ready in", out)) == starts   # no start
        assert stops(proxy) == []
    finally:
        proxy.stop()
        stop_successor(successor)
        stop_engines(sshd, tmp_path)


def test_an_upgrade_during_streams_on_two_engines_evicts_neither(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """Streams run on a and b (8 GB full) when SIGUSR1 arrives, and the successor is
    asked for c at once: its start waits while the old process streams from both
    (both are protected, not only one per host), both streams complete whole, and
    c then starts by evicting one of them, once its stream has ended."""
    proxy = Proxy(config(sshd, tmp_path, "abc", 8), tmp_path)
    successor = None
    try:
        assert answered(proxy.port, "ma") and answered(proxy.port, "mb")
        one, two = long_stream(proxy.port, "ma"), long_stream(proxy.port, "mb")
        assert wait_until(lambda: proxy.get_json("/status")["hosts"][0]["engine"]
                          ["in_flight"] == 2)
        proxy.signal(signal.SIGUSR1)
        successor = wait_new_pid(proxy, proxy.pid)
        third = BodyReader(post(proxy.port, "mc", **{"X-Sim-Delay": "0"}))
        whole(one, 40, proxy)
        whole(two, 40, proxy)
        third.join(30)
        assert third.error is None and json.loads(third.body)["model"] == "mc"
        assert proxy.popen.wait(20) == 0
        # The successor's start of c waited for both (neither was evictable while
        # the old process streamed from it), then took the first to fall idle.
        assert "switching gpu1 from a, b to c: waiting for a, b to fall idle" in \
            log(proxy)
        evicted = stops(proxy)
        assert evicted in (["stop of a on gpu1 (evicted for c)"],
                           ["stop of b on gpu1 (evicted for c)"]), evicted
    finally:
        proxy.stop()
        stop_successor(successor)
        stop_engines(sshd, tmp_path)


def test_the_engine_command_stops_one_engine_and_leaves_the_other(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """`llmproxy engine gpu1 stop a` (the CLI, over the admin endpoint) exits 0 and
    stops a alone (`operator`): its process ends, b runs on and answers."""
    proxy = Proxy(config(sshd, tmp_path, "ab", 8), tmp_path)
    try:
        assert answered(proxy.port, "ma") and answered(proxy.port, "mb")
        pids = {e: r["pid"] for e, r in agent_status(sshd, tmp_path).items()}
        done = subprocess.run([sys.executable, "-m", "llmproxy.cli", "engine", "gpu1", "stop",
                               "a", "--url", proxy.url], capture_output=True, text=True,
                              env=env(), timeout=60, check=False)
        assert done.returncode == 0, done
        assert done.stdout.strip() == "gpu1: stopped a; running: b", done.stdout
        assert wait_gone(pids["a"], 10)
        assert stops(proxy) == ["stop of a on gpu1 (operator)"]
        running = agent_status(sshd, tmp_path)
        assert list(running) == ["b"] and running["b"]["pid"] == pids["b"]
        assert answered(proxy.port, "mb")
        assert states(proxy) == {"ma": "unloaded", "mb": "loaded"}
        assert not gone(pids["b"])
    finally:
        proxy.stop()
        stop_engines(sshd, tmp_path)
