"""Tests for llmproxy-agent: orders, state, and real engine processes started and stopped."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent import processes, state
from tests.agentrun import (
    STUBBORN,
    Agent,
    alive,
    call,
    gone,
    group_members,
    order,
    running,
    sim_command,
    start_order,
)
from tests.procs import free_port

# -- without engines ---------------------------------------------------------------------------


P = '"protocol": 3, '


@pytest.mark.parametrize(("stdin", "argv", "needle"), [
    ("not json", [], "not JSON"),
    ("[1, 2]", [], "one JSON object"),
    ("", [], "no op"),
    ('{' + P + '"op": "restart"}', [], "unknown op 'restart'"),
    ("", ["reboot"], "unknown op 'reboot'"),
    ("", ["status", "--frobnicate"], "unrecognized arguments"),
    ("", ["stop", "../e"], "engine must be a name"),
    ('{' + P + '"op": "start", "engine": "e", "health_url": "http://h/health"}', [], "command"),
    ('{' + P + '"op": "start", "engine": "../e", "command": ["x"], "health_url": "http://h/"}',
     [], "engine"),
    ('{' + P + '"op": "start", "engine": "e", "command": ["x"]}', [], "health_url"),
    ('{' + P + '"op": "start", "engine": "e", "command": ["x"], '
     '"health_url": "file:///etc/passwd"}', [], "health_url"),
    ('{' + P + '"op": "start", "engine": "e", "command": ["x"], "health_url": "http://h/", '
     '"timeout": "soon"}', [], "timeout"),
    ('{' + P + '"op": "start", "engine": "e", "command": ["x"], "health_url": "http://h/", '
     '"exclusive": "yes"}', [], "exclusive must be true or false"),
    ('{' + P + '"op": "stop", "grace": -1}', [], "grace"),
    ('{' + P + '"op": "stop", "engine": "a/b"}', [], "engine must be a name"),
])
def test_bad_input_is_answered_with_exit_2(tmp_path: Path, stdin: str, argv: list[str],
                                            needle: str) -> None:
    """Bad JSON, an unknown op, missing or invalid fields: ok false naming the problem, exit 2,
    and nothing was started or recorded."""
    status, answer = call(tmp_path / "s", stdin, *argv)
    assert status == 2
    assert answer["ok"] is False
    assert needle in answer["error"]
    assert not (tmp_path / "s" / state.ENGINES).exists()


def test_bad_input_exit_status_of_the_real_program(run: Agent) -> None:
    """The program itself exits 2 with one JSON answer line when stdin is not JSON."""
    status, answer = run.answer(run.popen("{not json"))
    assert status == 2 and answer["ok"] is False and "not JSON" in answer["error"]
    status, answer = run.answer(run.popen({"protocol": 3, "op": 42}))
    assert status == 2 and answer["ok"] is False and "unknown op 42" in answer["error"]


def test_status_when_nothing_runs(run: Agent) -> None:
    """With no engine recorded, status lists none and creates the state dir 0700; the op
    may come from argv with nothing on stdin."""
    expected = {"ok": True, "protocol": 3, "engines": [], "lease": None}
    assert run(None, "status") == expected
    assert run(order("status")) == expected
    assert run.state_dir.stat().st_mode & 0o777 == 0o700


def test_stdin_fields_override_argv_op(tmp_path: Path) -> None:
    """When argv names an op and stdin holds JSON too, the stdin fields win."""
    status, answer = call(tmp_path, order("stop"), "status")
    assert status == 0 and answer == {"ok": True, "protocol": 3, "stopped": []}


def test_state_dir_precedence(tmp_path: Path) -> None:
    """--state-dir wins, then $LLMPROXY_AGENT_DIR, then $XDG_RUNTIME_DIR/llmproxy-agent, then
    ~/.cache/llmproxy-agent."""
    env = {"LLMPROXY_AGENT_DIR": "/a", "XDG_RUNTIME_DIR": "/run/user/1"}
    assert state.state_dir("/opt", env) == Path("/opt")
    assert state.state_dir(None, env) == Path("/a")
    assert state.state_dir(None, {"XDG_RUNTIME_DIR": "/run/user/1"}) == Path(
        "/run/user/1/llmproxy-agent")
    assert state.state_dir(None, {}) == Path.home() / ".cache" / "llmproxy-agent"


@pytest.mark.parametrize("where", ["engines/e.json", "engine.json"])
def test_unreadable_record_is_dropped(tmp_path: Path, where: str) -> None:
    """A corrupt record (or one naming pid 0 or 1, or another engine than its file's name),
    of this agent or an older one's engine.json, is never signalled and is removed."""
    (tmp_path / state.ENGINES).mkdir()
    exited = subprocess.Popen(["true"])
    exited.wait()
    dead = exited.pid  # records name a process that is gone: nothing may be signalled
    for text in ("{broken", json.dumps({"engine": "e", "pid": 1, "starttime": "1"}),
                 json.dumps({"engine": "e", "pid": 0}),
                 json.dumps({"engine": "../e", "pid": dead, "starttime": "1"}),
                 *([json.dumps({"engine": "f", "pid": dead, "starttime": "1"})]
                   if where != "engine.json" else [])):
        (tmp_path / where).write_text(text)
        status, answer = call(tmp_path, order("stop", grace=0))
        assert status == 0 and answer["stopped"] == []
        assert not (tmp_path / where).exists()
        assert state.records(tmp_path) == []


# -- real engines ------------------------------------------------------------------------------


@pytest.mark.integration
def test_start_status_stop(run: Agent) -> None:
    """start brings the engine up healthy in its own session, status reports it, stop ends it
    gracefully (no SIGKILL needed) and forgets it."""
    port = free_port()
    command = sim_command(port)
    started = run(start_order("small", command, port))
    assert started["ok"] is True and started["healthy"] is True, started
    assert started["engine"] == "small" and started["already_running"] is False
    pid = started["pid"]
    assert alive(pid)
    assert os.getsid(pid) == pid
    assert "starting small" in (run.state_dir / "engine-small.log").read_text()

    [status] = run(None, "status")["engines"]
    assert status["engine"] == "small" and status["pid"] == pid and status["healthy"] is True
    assert status["command"] == command and status["started_at"] <= time.time()
    assert status["health_url"] == f"http://127.0.0.1:{port}/health"

    stopped = run(order("stop", grace=10))
    assert stopped == {"ok": True, "protocol": 3,
                       "stopped": [{"engine": "small", "pid": pid, "killed": False}]}
    assert gone(pid, 0.5)
    assert not state.record_path(run.state_dir, "small").exists()
    assert run(None, "status")["engines"] == []


@pytest.mark.integration
def test_start_same_engine_again_is_already_running(run: Agent) -> None:
    """Starting the engine that already runs healthy with the same command keeps its process."""
    port = free_port()
    first = run(start_order("small", sim_command(port), port))
    again = run(start_order("small", sim_command(port), port))
    assert again["ok"] is True and again["already_running"] is True
    assert again["pid"] == first["pid"] and alive(first["pid"]) and again["stopped"] == []


@pytest.mark.integration
def test_exclusive_start_replaces_the_first(run: Agent) -> None:
    """An exclusive start stops the running engine (its process is gone, the answer lists it)
    before the new one runs: what a host that runs one engine at a time asks for."""
    p1, p2 = free_port(), free_port()
    first = run(start_order("small", sim_command(p1), p1))
    second = run(start_order("big", sim_command(p2), p2, exclusive=True))
    assert second["ok"] is True and second["healthy"] is True
    assert second["stopped"] == [{"engine": "small", "pid": first["pid"], "killed": False}]
    assert gone(first["pid"], 0.5)
    assert alive(second["pid"]) and running(run(None, "status")) == {"big": second["pid"]}


@pytest.mark.integration
def test_engine_that_exits_at_once(run: Agent) -> None:
    """A command that exits fails the start with its status and log tail; nothing is recorded."""
    port = free_port()
    command = [sys.executable, "-c", "import sys; print('no GPU here', file=sys.stderr); "
               "sys.exit(3)"]
    answer = run(start_order("broken", command, port))
    assert answer["ok"] is False
    assert "status 3" in answer["error"]
    assert "no GPU here" in answer["log_tail"]
    assert state.records(run.state_dir) == []
    assert run(None, "status")["engines"] == []


@pytest.mark.integration
def test_engine_never_healthy_is_killed(run: Agent) -> None:
    """An engine whose health URL never answers fails after the timeout and is not left running."""
    port = free_port()
    t0 = time.monotonic()
    answer = run(start_order("slow", ["sleep", "30"], port, timeout=1))
    assert answer["ok"] is False
    assert f"not healthy within 1 s (no 200 from http://127.0.0.1:{port}/health)" in \
        answer["error"]
    assert time.monotonic() - t0 < 10
    assert gone(answer["pid"], 0.5)
    assert state.records(run.state_dir) == []


@pytest.mark.integration
def test_command_that_cannot_run(run: Agent) -> None:
    """A command that does not exist fails the start with the reason, and nothing is recorded."""
    answer = run(start_order("x", ["/nonexistent/llama-server"], free_port()))
    assert answer["ok"] is False and "/nonexistent/llama-server" in answer["error"]
    assert state.records(run.state_dir) == []


@pytest.mark.integration
def test_foreign_listener_on_the_health_port(run: Agent) -> None:
    """If the health URL already answers before the engine is started, another process holds the
    port: the start fails and starts nothing (a healthy answer would not be our engine's)."""
    class OK(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), OK)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        answer = run(start_order("e", ["sleep", "30"], server.server_address[1]))
    finally:
        server.shutdown()
        server.server_close()
    assert answer["ok"] is False and "another process holds its port" in answer["error"]
    assert state.records(run.state_dir) == []


@pytest.mark.integration
def test_dead_pid_in_state_file(run: Agent) -> None:
    """A record naming a process that has exited: status does not list it and forgets it."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    run.state_dir.mkdir(mode=0o700)
    state.save(run.state_dir, {"engine": "old", "pid": dead.pid, "starttime": "1",
                               "command": ["true"], "health_url": "http://127.0.0.1:1/",
                               "started_at": 0})
    assert state.record_path(run.state_dir, "old").exists()
    assert run(None, "status")["engines"] == []
    assert not state.record_path(run.state_dir, "old").exists()


@pytest.mark.integration
def test_reused_pid_is_never_signalled(run: Agent) -> None:
    """A state file whose pid now belongs to another process (different start time): status and
    stop report no engine, and that process is not signalled."""
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        run.state_dir.mkdir(mode=0o700)
        record = {"engine": "old", "pid": other.pid, "starttime": "1", "command": ["sleep", "30"],
                  "health_url": "http://127.0.0.1:1/", "started_at": 0}
        state.save(run.state_dir, record)
        assert run(order("stop", grace=0)) == {"ok": True, "protocol": 3, "stopped": []}
        assert state.records(run.state_dir) == []
        state.save(run.state_dir, record)
        assert run(None, "status")["engines"] == []
        time.sleep(0.1)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


@pytest.mark.integration
def test_concurrent_exclusive_starts_leave_one_engine(run: Agent) -> None:
    """Two exclusive starts at once on one host (different engines and ports) run one after the
    other: both answer ok and exactly one engine process is alive afterwards, the recorded one."""
    p1, p2 = free_port(), free_port()
    a = run.popen(start_order("one", sim_command(p1), p1, exclusive=True))
    b = run.popen(start_order("two", sim_command(p2), p2, exclusive=True))
    (sa, ra), (sb, rb) = run.answer(a), run.answer(b)
    assert sa == sb == 0 and ra["ok"] is True and rb["ok"] is True, (ra, rb)
    time.sleep(0.2)
    living = [r for r in (ra, rb) if alive(r["pid"])]
    assert len(living) == 1
    assert running(run(None, "status")) == {living[0]["engine"]: living[0]["pid"]}


@pytest.mark.integration
def test_calls_wait_for_the_lock(run: Agent) -> None:
    """While another call holds agent.lock, a call waits for it and answers once it is free."""
    run.state_dir.mkdir(mode=0o700)
    fd = os.open(run.state_dir / "agent.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        p = run.popen(None, "status")
        time.sleep(0.5)
        assert p.poll() is None
    finally:
        os.close(fd)
    status, answer = run.answer(p)
    assert status == 0 and answer["ok"] is True


@pytest.mark.integration
def test_stop_kills_an_engine_that_ignores_sigterm(run: Agent) -> None:
    """stop SIGKILLs an engine that ignores SIGTERM once the grace is over (killed true), and the
    whole process group goes, a child of the engine included."""
    port = free_port()
    command = ["sh", "-c", 'sleep 60 & exec "$0" -c "$1" "$2"', sys.executable, STUBBORN,
               str(port)]
    started = run(start_order("stubborn", command, port))
    assert started["ok"] is True, started
    pid = started["pid"]
    members = group_members(pid)
    # the reaper (the group's leader), the engine and its sleep
    assert pid in members and started["engine_pid"] in members and len(members) == 3
    run.pids.extend(members)
    t0 = time.monotonic()
    stopped = run(order("stop", engine="stubborn", grace=0.5))
    assert stopped["stopped"] == [{"engine": "stubborn", "pid": pid, "killed": True}]
    assert time.monotonic() - t0 >= 0.5
    assert all(gone(m, 0.5) for m in members)


@pytest.mark.integration
def test_interrupted_start_kills_what_it_started(run: Agent) -> None:
    """A start whose agent gets SIGTERM while waiting for health gives up, kills the engine it
    started and forgets it, and still answers."""
    port = free_port()
    p = run.popen(start_order("slow", ["sleep", "30"], port, timeout=20))
    deadline = time.monotonic() + 10
    while not state.record_path(run.state_dir, "slow").exists():  # started and recorded
        assert time.monotonic() < deadline
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    status, answer = run.answer(p)
    assert status == 0 and answer["ok"] is False
    assert "interrupted by signal SIGTERM" in answer["error"]
    assert gone(answer["pid"], 0.5)
    assert state.records(run.state_dir) == []


@pytest.mark.integration
@pytest.mark.skipif(not Path("/bin/ps").exists() and not Path("/usr/bin/ps").exists(),
                    reason="needs ps")
def test_ps_fallback_without_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no /proc (macOS), process state, group and start time come from ps."""
    monkeypatch.setattr(processes, "_HAVE_PROC", False)
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        stat = processes.proc_stat(other.pid)
        assert stat is not None and stat[0] == "S" and stat[1] == other.pid and stat[2]
        assert processes.proc_stat(other.pid) == stat  # the start time is stable
        assert processes.group_alive(other.pid)
        record = {"pid": other.pid, "starttime": stat[2]}
        assert processes.leader_alive(record)
        assert not processes.leader_alive({**record, "starttime": "Thu Jan  1 00:00:00 1970"})
    finally:
        other.kill()
        other.wait()
    assert processes.proc_stat(other.pid) is None
    assert not processes.group_alive(other.pid)
