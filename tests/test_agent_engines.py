"""llmproxy-agent with several engines on one host (protocol 2): starts that leave the others
running or stop them (exclusive), stop one or all, status listing every engine, a port held by
another engine of the agent, the migration of an older agent's engine.json, and the protocol
check that refuses an order of another version."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent import main as agent
from llmproxy.agent import processes, state
from llmproxy.agent.orders import healthy
from llmproxy.hosts import agentclient
from tests.agentrun import (
    STUBBORN,
    Agent,
    alive,
    call,
    gone,
    order,
    running,
    sim_command,
    start_order,
)
from tests.procs import free_port


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process in a session of its own, as the agent starts engines; killed after."""
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def record_of(p: subprocess.Popen[bytes], engine: str, port: int = 1) -> dict[str, Any]:
    """The record an agent keeps of process ``p`` started as ``engine``."""
    stat = processes.proc_stat(p.pid)
    assert stat is not None
    return {"engine": engine, "pid": p.pid, "starttime": stat[2], "command": ["sleep", "60"],
            "health_url": f"http://127.0.0.1:{port}/health", "started_at": time.time()}


def start_two(run: Agent) -> tuple[dict[str, Any], dict[str, Any], int, int]:
    pa, pb = free_port(), free_port()
    a = run(start_order("a", sim_command(pa), pa))
    b = run(start_order("b", sim_command(pb), pb))
    assert a["ok"] is True and b["ok"] is True, (a, b)
    return a, b, pa, pb


# -- the protocol --------------------------------------------------------------------------------


def test_both_sides_speak_the_same_protocol() -> None:
    """The agent's version and the proxy's are one number, changed together."""
    assert agent.PROTOCOL == agentclient.PROTOCOL == 4


@pytest.mark.parametrize(("given", "needle"), [
    ({}, "llmproxy-agent speaks protocol 4; the proxy sent protocol 1 (an order without a "
         "protocol field): upgrade llmproxy on the proxy's machine to this host's version"),
    ({"protocol": 1}, "llmproxy-agent speaks protocol 4; the proxy sent protocol 1: upgrade "
                      "llmproxy on the proxy's machine"),
    ({"protocol": 2}, "llmproxy-agent speaks protocol 4; the proxy sent protocol 2: upgrade "
                      "llmproxy on the proxy's machine"),
    ({"protocol": 3}, "llmproxy-agent speaks protocol 4; the proxy sent protocol 3: upgrade "
                      "llmproxy on the proxy's machine"),
    ({"protocol": 5}, "llmproxy-agent speaks protocol 4; the proxy sent protocol 5: upgrade "
                      "llmproxy on this host to the proxy's version"),
    ({"protocol": "3"}, "protocol must be a whole number, got '3'"),
    ({"protocol": True}, "protocol must be a whole number, got True"),
])
def test_an_order_of_another_protocol_is_refused_naming_both(tmp_path: Path,
                                                             given: dict[str, Any],
                                                             needle: str) -> None:
    """A JSON order without protocol 4 (an older proxy's, a newer one's) is refused with exit 2
    and an answer naming both versions and what to upgrade; the answer still says protocol 4."""
    status, answer = call(tmp_path, {"op": "status", **given})
    assert status == 2
    assert answer == {"ok": False, "protocol": 4, "error": answer["error"]}
    assert needle in answer["error"]


@pytest.mark.integration
def test_an_older_proxys_stop_is_not_served(tmp_path: Path,
                                            sleeper: subprocess.Popen[bytes]) -> None:
    """An order without a protocol is refused before anything is done: a protocol 1 proxy's
    stop leaves the engine running and recorded."""
    state.save(tmp_path, record_of(sleeper, "e"))
    status, answer = call(tmp_path, {"op": "stop", "grace": 0})
    assert status == 2 and "protocol 1" in answer["error"]
    time.sleep(0.1)
    assert sleeper.poll() is None and state.load(tmp_path, "e") is not None


@pytest.mark.integration
def test_a_person_may_give_the_order_on_the_command_line(tmp_path: Path,
                                                        sleeper: subprocess.Popen[bytes]) -> None:
    """`llmproxy-agent status` and `llmproxy-agent stop ENGINE`, nothing on stdin, need no
    protocol; the named engine alone is stopped."""
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        state.save(tmp_path, record_of(sleeper, "one"))
        state.save(tmp_path, record_of(other, "two"))
        status, answer = call(tmp_path, "", "status")
        assert status == 0 and sorted(running(answer)) == ["one", "two"]
        status, answer = call(tmp_path, "", "stop", "one")
        assert status == 0
        assert answer["stopped"] == [{"engine": "one", "pid": sleeper.pid, "killed": False}]
        assert gone(sleeper.pid, 2) and other.poll() is None
        assert running(call(tmp_path, "", "status")[1]) == {"two": other.pid}
    finally:
        other.kill()
        other.wait()


# -- several engines -----------------------------------------------------------------------------


@pytest.mark.integration
def test_a_start_leaves_the_other_engines_running(run: Agent) -> None:
    """Without exclusive, a start stops nothing: both engines run, healthy, and status lists
    both, oldest first, each with its command and health URL."""
    a, b, pa, pb = start_two(run)
    assert a["stopped"] == [] and b["stopped"] == []
    assert alive(a["pid"]) and alive(b["pid"])
    listed = run(order("status"))["engines"]
    assert [(e["engine"], e["pid"], e["healthy"]) for e in listed] == [
        ("a", a["pid"], True), ("b", b["pid"], True)]
    assert listed[1]["command"] == sim_command(pb)
    assert listed[0]["health_url"] == f"http://127.0.0.1:{pa}/health"
    assert listed[0]["started_at"] <= listed[1]["started_at"]
    assert sorted(p.name for p in (run.state_dir / state.ENGINES).iterdir()) == [
        "a.json", "b.json"]


@pytest.mark.integration
def test_stop_of_one_engine_leaves_the_others(run: Agent) -> None:
    """stop with an engine stops that one alone; stopping it again is no error and says it
    stopped nothing."""
    a, b, _, _ = start_two(run)
    stopped = run(order("stop", engine="a", grace=5))
    assert stopped == {"ok": True, "protocol": 4,
                       "stopped": [{"engine": "a", "pid": a["pid"], "killed": False}]}
    assert gone(a["pid"], 2) and alive(b["pid"])
    assert running(run(order("status"))) == {"b": b["pid"]}
    assert run(order("stop", engine="a")) == {"ok": True, "protocol": 4, "stopped": []}
    assert alive(b["pid"])


@pytest.mark.integration
def test_a_bare_stop_stops_every_engine_at_once(tmp_path: Path) -> None:
    """stop without an engine stops them all, signalled together: two engines that ignore
    SIGTERM are both SIGKILLed after one grace, not one grace each."""
    run = Agent(tmp_path / "state")
    try:
        pids = []
        for name in ("x", "y"):
            port = free_port()
            answer = run(start_order(name, [sys.executable, "-c", STUBBORN, str(port)], port))
            assert answer["ok"] is True, answer
            pids.append(answer["pid"])
        t0 = time.monotonic()
        status, stopped = call(run.state_dir, order("stop", grace=1.5))
        elapsed = time.monotonic() - t0
        assert status == 0 and sorted(stopped["stopped"], key=lambda s: s["engine"]) == [
            {"engine": "x", "pid": pids[0], "killed": True},
            {"engine": "y", "pid": pids[1], "killed": True}]
        assert 1.5 <= elapsed < 2.8  # one after the other would take 3 s and more
        assert all(gone(pid, 2) for pid in pids)
        assert state.records(run.state_dir) == []
    finally:
        run.cleanup()


@pytest.mark.integration
def test_an_exclusive_start_of_a_running_engine_stops_only_the_others(run: Agent) -> None:
    """exclusive with the engine already running healthy keeps it (already_running) and stops
    every other engine."""
    a, b, pa, _ = start_two(run)
    again = run(start_order("a", sim_command(pa), pa, exclusive=True))
    assert again["ok"] is True and again["already_running"] is True and again["pid"] == a["pid"]
    assert again["stopped"] == [{"engine": "b", "pid": b["pid"], "killed": False}]
    assert gone(b["pid"], 2) and alive(a["pid"])
    assert running(run(order("status"))) == {"a": a["pid"]}


@pytest.mark.integration
def test_a_start_with_another_command_restarts_that_engine_alone(run: Agent) -> None:
    """An engine running with another command than the order's is stopped and started anew;
    the other engines keep running."""
    a, b, pa, _ = start_two(run)
    again = run(start_order("a", sim_command(pa, "m2"), pa))
    assert again["ok"] is True and again["already_running"] is False
    assert again["stopped"] == [{"engine": "a", "pid": a["pid"], "killed": False}]
    assert gone(a["pid"], 2) and alive(again["pid"]) and alive(b["pid"])
    assert running(run(order("status"))) == {"a": again["pid"], "b": b["pid"]}


@pytest.mark.integration
def test_a_port_held_by_another_engine_of_the_agent_is_refused_naming_it(run: Agent) -> None:
    """A start whose health URL is another running engine's port fails, naming that engine and
    its pid; nothing is started, the other engine keeps running."""
    port = free_port()
    a = run(start_order("a", sim_command(port), port))
    answer = run(start_order("b", sim_command(port, "mb"), port))
    assert answer["ok"] is False
    assert answer["error"] == (
        f"http://127.0.0.1:{port}/health is the port of engine a (pid {a['pid']}), which this "
        "agent runs: stop it first or give b a port of its own")
    assert alive(a["pid"]) and running(run(order("status"))) == {"a": a["pid"]}
    assert state.load(run.state_dir, "b") is None


@pytest.mark.integration
def test_concurrent_starts_of_different_engines_both_run(run: Agent) -> None:
    """Two starts at once take turns on the lock and neither stops the other."""
    p1, p2 = free_port(), free_port()
    first = run.popen(start_order("one", sim_command(p1), p1))
    second = run.popen(start_order("two", sim_command(p2), p2))
    (s1, r1), (s2, r2) = run.answer(first), run.answer(second)
    assert s1 == s2 == 0 and r1["ok"] is True and r2["ok"] is True, (r1, r2)
    assert running(run(order("status"))) == {"one": r1["pid"], "two": r2["pid"]}


@pytest.mark.integration
def test_a_dead_engine_is_cleaned_and_the_others_listed(run: Agent) -> None:
    """An engine whose process died is left out of status and forgotten; the others stay."""
    a, b, _, _ = start_two(run)
    processes.terminate([a["pid"]], 5)
    assert running(run(order("status"))) == {"b": b["pid"]}
    assert state.load(run.state_dir, "a") is None and state.load(run.state_dir, "b") is not None


# -- an older agent's engine.json ----------------------------------------------------------------


@pytest.mark.integration
def test_an_older_agents_engine_is_migrated_not_orphaned(run: Agent) -> None:
    """engine.json left by a protocol 1 agent, its engine still running: the first call moves it
    to engines/NAME.json; status lists it, a start of it with the same command answers
    already_running, and a stop of it stops it."""
    port = free_port()
    engine = subprocess.Popen(sim_command(port), start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/health"
        deadline = time.monotonic() + 20
        while not healthy(url):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stat = processes.proc_stat(engine.pid)
        assert stat is not None
        run.state_dir.mkdir(mode=0o700)
        legacy = {"engine": "small", "pid": engine.pid, "starttime": stat[2],
                  "command": sim_command(port), "health_url": url, "started_at": 1000.0}
        (run.state_dir / state.LEGACY).write_text(json.dumps(legacy))
        [listed] = run(None, "status")["engines"]
        assert listed == {"engine": "small", "pid": engine.pid, "engine_pid": engine.pid,
                          "command": sim_command(port),
                          "health_url": url, "healthy": True, "started_at": 1000.0}
        assert not (run.state_dir / state.LEGACY).exists()
        assert state.load(run.state_dir, "small") == legacy
        again = run(start_order("small", sim_command(port), port, exclusive=True))
        assert again["already_running"] is True and again["pid"] == engine.pid
        stopped = run(order("stop", engine="small"))
        assert stopped["stopped"] == [{"engine": "small", "pid": engine.pid, "killed": False}]
        assert engine.wait(5) is not None
    finally:
        engine.kill()
        engine.wait()


@pytest.mark.integration
def test_an_older_agents_duplicate_of_a_recorded_engine_is_stopped(
        tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    """engine.json naming an engine this agent already records (an older agent ran after it):
    one name holds one record, so the recorded engine stays and the older agent's process is
    stopped, never left running unrecorded."""
    duplicate = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        state.save(tmp_path, record_of(sleeper, "e"))
        (tmp_path / state.LEGACY).write_text(json.dumps(record_of(duplicate, "e")))
        status, answer = call(tmp_path, order("status"))
        assert status == 0 and running(answer) == {"e": sleeper.pid}
        assert duplicate.wait(5) is not None and sleeper.poll() is None
        assert not (tmp_path / state.LEGACY).exists()
    finally:
        duplicate.kill()
        duplicate.wait()
