"""The upgrade hand-over with fakes: what the candidate is given (argv, fds,
environment) and the ready handshake, including every way it can fail."""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from llmproxy.lifecycle.upgrade import (
    HANDOVER_VARIABLE,
    LAUNCH,
    Handover,
    UpgradeFailed,
    Upgrader,
    candidate_argv,
    handover_from_environ,
)


class FakeTransport:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.signals: list[str] = []
        self.written: list[tuple[int, bytes]] = []

    def signalProcess(self, sig: str) -> None:
        self.signals.append(sig)

    def writeToChild(self, fd: int, data: bytes) -> None:
        self.written.append((fd, data))


class FakeReactor(Clock):
    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[dict[str, Any]] = []

    def spawnProcess(self, protocol: Any, executable: str, args: list[str], env: dict[str, str],
                     childFDs: dict[int, Any]) -> FakeTransport:
        transport = FakeTransport(1000 + len(self.spawned))
        protocol.transport = transport
        self.spawned.append({"protocol": protocol, "executable": executable, "args": args,
                             "env": env, "childFDs": childFDs})
        return transport


def start(reactor: FakeReactor, **kw: Any) -> Any:
    from twisted.internet.defer import Deferred

    upgrader = Upgrader(reactor, executable="/venv/bin/python",
                        argv=["/venv/bin/twistd", "-n", "llmproxy", "-c", "h.json"],
                        environ={"PATH": "/bin", "LISTEN_PID": "1"}, timeout=30)
    d = Deferred.fromCoroutine(upgrader.upgrade(generation=4, listen_fd=17,
                                                lock_fds={"b@h": 21, "a@h": 20},
                                                pidfile="/run/x.pid", **kw))
    return upgrader, d


def test_candidate_gets_the_socket_pipes_locks_and_a_handover_description() -> None:
    """Same interpreter and argv through sh (SIGHUP/SIGUSR1 ignored, LISTEN_PID
    = its own pid); fd 3 the listening socket, 4/5 the pipes, 6+ the locks."""
    reactor = FakeReactor()
    upgrader, d = start(reactor)
    [spawn] = reactor.spawned
    assert spawn["args"] == ["/bin/sh", "-c", LAUNCH, "llmproxy-upgrade", "/venv/bin/python",
                             "/venv/bin/twistd", "--nodaemon", "-n", "llmproxy", "-c", "h.json"]
    assert 'trap "" HUP USR1' in LAUNCH and "LISTEN_PID=$$" in LAUNCH
    assert spawn["childFDs"] == {0: 0, 1: 1, 2: 2, 3: 17, 4: "r", 5: "w", 6: 20, 7: 21}
    env = spawn["env"]
    assert env["LISTEN_FDS"] == "1" and "LISTEN_PID" not in env and env["PATH"] == "/bin"
    assert json.loads(env[HANDOVER_VARIABLE]) == {
        "generation": 5, "predecessor_pid": os.getpid(), "ready_fd": 4, "predecessor_fd": 5,
        "lock_fds": {"a@h": 6, "b@h": 7}, "pidfile": "/run/x.pid"}
    assert upgrader.in_progress and not d.called


def test_ready_line_completes_the_handshake() -> None:
    """`ready` on fd 4 is the hand-over: the upgrade returns the candidate's pid
    and protect lines go to it on fd 5."""
    reactor = FakeReactor()
    upgrader, d = start(reactor)
    protocol = reactor.spawned[0]["protocol"]
    protocol.childDataReceived(1, b"ready (stdout is not the pipe)")
    assert not d.called
    protocol.childDataReceived(4, b"rea")
    protocol.childDataReceived(4, b"dy 1000\n")
    assert d.result == 1000 and not upgrader.in_progress
    assert upgrader.last["outcome"] == "handed over"
    upgrader.protect({"gpu1": "big"})
    assert upgrader.successor.written == [(5, b"protect gpu1=big\n")]


def test_candidate_that_exits_first_fails_the_upgrade() -> None:
    """A candidate that exits before `ready` (bad config, import error, crash)
    fails the upgrade with its exit status."""
    reactor = FakeReactor()
    upgrader, d = start(reactor)
    protocol = reactor.spawned[0]["protocol"]
    protocol.processEnded(Failure(ProcessTerminated(exitCode=1)))
    failure = d.result
    d.addErrback(lambda f: None)
    assert isinstance(failure, Failure) and failure.check(UpgradeFailed)
    assert str(failure.value) == "candidate pid 1000 exited with status 1 before it was ready"
    assert upgrader.last["outcome"] == "failed" and not upgrader.in_progress
    assert reactor.spawned[0]["protocol"].transport.signals == []   # already gone


def test_candidate_not_ready_in_time_is_killed() -> None:
    """Not ready within the timeout: SIGTERM, then SIGKILL if it lingers, and the
    upgrade fails saying so."""
    reactor = FakeReactor()
    _, d = start(reactor)
    protocol = reactor.spawned[0]["protocol"]
    transport = protocol.transport
    reactor.advance(30)
    assert transport.signals == ["TERM"] and not d.called
    reactor.advance(2)
    assert transport.signals == ["TERM", "KILL"]
    protocol.processEnded(Failure(ProcessTerminated(signal=9)))
    assert d.called
    failure = d.result
    d.addErrback(lambda f: None)
    assert "was not ready within 30s" in str(failure.value)


def test_clean_exit_before_ready_is_a_failure_too() -> None:
    """Status 0 without `ready` is still a failed upgrade."""
    reactor = FakeReactor()
    _, d = start(reactor)
    reactor.spawned[0]["protocol"].processEnded(Failure(ProcessDone(0)))
    assert "exited with status 0 before it was ready" in str(d.result.value)
    d.addErrback(lambda f: None)


def test_handover_is_read_and_forgotten(tmp_path: Any) -> None:
    """A candidate reads its hand-over from the environment and removes it, so
    its own children never see it; the fds become non-inheritable."""
    r, w = os.pipe()
    os.set_inheritable(r, True)
    environ = {HANDOVER_VARIABLE: json.dumps({
        "generation": 3, "predecessor_pid": 77, "ready_fd": w, "predecessor_fd": r,
        "lock_fds": {}, "pidfile": None}), "PATH": "/bin"}
    try:
        handover = handover_from_environ(environ)
        assert handover == Handover(generation=3, predecessor_pid=77, ready_fd=w,
                                    predecessor_fd=r)
        assert HANDOVER_VARIABLE not in environ
        assert not os.get_inheritable(r)
        assert handover_from_environ(environ) is None
    finally:
        os.close(r)
        os.close(w)


def test_candidate_argv_uses_the_same_interpreter_and_never_daemonizes() -> None:
    """The re-installed code is picked up: same interpreter path, same argv; a
    daemonized twistd's candidate stays in the foreground (--nodaemon)."""
    assert candidate_argv("/usr/bin/python3", ["/usr/bin/twistd", "llmproxy", "-c", "x"])[4:] == [
        "/usr/bin/python3", "/usr/bin/twistd", "--nodaemon", "llmproxy", "-c", "x"]
