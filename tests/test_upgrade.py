"""The upgrade with fakes: what the candidate is given (argv, fds, environment),
the ready handshake and every way it can fail, the pid file, and the engines in
use told to the successor from request events, in the turn they happen."""

from __future__ import annotations

import json
import os
from typing import Any
from unittest.mock import patch

from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from llmproxy import __version__
from llmproxy.core.events import RequestEnded, RequestRouted, UpgradeStage
from llmproxy.core.hub import Hub
from llmproxy.lifecycle.handover import (
    HANDOVER_VARIABLE,
    Handover,
    handover_from_environ,
    parse_protect,
    protect_line,
)
from llmproxy.lifecycle.pidfile import PidFile
from llmproxy.lifecycle.upgrade import LAUNCH, Launcher, Upgrade, candidate_argv


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
                     childFDs: dict[int, Any], path: str | None = None) -> FakeTransport:
        transport = FakeTransport(1000 + len(self.spawned))
        protocol.transport = transport
        self.spawned.append({"protocol": protocol, "executable": executable, "args": args,
                             "env": env, "childFDs": childFDs, "path": path})
        return transport


class Recorder:
    def __init__(self, hub: Hub) -> None:
        self.events: list[Any] = []
        hub.subscribe(self.events.append)

    def stages(self) -> list[str]:
        return [e.stage for e in self.events if isinstance(e, UpgradeStage)]


def start(reactor: FakeReactor, pidfile: PidFile | None = None,
          generation: int = 4) -> tuple[Upgrade, Any, list[int], Recorder]:
    """An Upgrade of generation 4 (pid 500) asked to upgrade: (upgrade, its
    Deferred, the pids handed over to, the events published)."""
    hub = Hub()
    events = Recorder(hub)
    launcher = Launcher(reactor, executable="/venv/bin/python",
                        argv=["/venv/bin/twistd", "-n", "llmproxy", "-c", "h.json"],
                        environ={"PATH": "/bin", "LISTEN_PID": "1"}, timeout=30)
    handover = Handover(generation=generation, predecessor_pid=400, ready_fd=-1,
                        predecessor_fd=-1)
    upgrade = Upgrade(reactor, hub, pidfile or PidFile("/run/x.pid"), launcher,
                      handover=handover, pid=500)
    handed: list[int] = []

    async def hand_over(pid: int) -> None:
        handed.append(pid)

    d = upgrade.start(None, listen_fd=17, lock_fds={"b@h": 21, "a@h": 20}, hand_over=hand_over)
    return upgrade, d, handed, events


def routed(request_id: str, host: str, engine: str | None) -> RequestRouted:
    return RequestRouted(0.0, request_id=request_id, method="POST", path="/v1/x",
                         model="m", host=host, engine=engine)


def ended(request_id: str) -> RequestEnded:
    return RequestEnded(0.0, request_id=request_id, method="POST", path="/v1/x", client="c",
                        model="m", host="gpu1", engine=None, status=200, bytes=1,
                        duration=0.1, outcome="completed")


def test_candidate_gets_the_socket_pipes_locks_and_a_handover_description() -> None:
    """Same interpreter and argv through sh (SIGHUP/SIGUSR1 ignored, LISTEN_PID
    = its own pid); fd 3 the listening socket, 4/5 the pipes, 6+ the locks."""
    reactor = FakeReactor()
    upgrade, d, _, events = start(reactor)
    [spawn] = reactor.spawned
    assert spawn["args"] == ["/bin/sh", "-c", LAUNCH, "llmproxy-upgrade", "/venv/bin/python",
                             "/venv/bin/twistd", "--nodaemon", "-n", "llmproxy", "-c", "h.json"]
    assert 'trap "" HUP USR1' in LAUNCH and "LISTEN_PID=$$" in LAUNCH
    assert spawn["childFDs"] == {0: 0, 1: 1, 2: 2, 3: 17, 4: "r", 5: "w", 6: 20, 7: 21}
    env = spawn["env"]
    assert env["LISTEN_FDS"] == "1" and "LISTEN_PID" not in env and env["PATH"] == "/bin"
    assert json.loads(env[HANDOVER_VARIABLE]) == {
        "generation": 5, "predecessor_pid": os.getpid(), "ready_fd": 4, "predecessor_fd": 5,
        "lock_fds": {"a@h": 6, "b@h": 7}, "pidfile": "/run/x.pid",
        "predecessor_version": __version__, "started_at": 0.0}
    assert upgrade.in_progress and not d.called
    assert events.stages() == ["started"]


def test_ready_line_completes_the_handshake() -> None:
    """`ready` on fd 4 is the hand-over: the process hands over to the candidate's
    pid; on fd 5 it says that the state the hand-over sent is all there
    (`settled`), then the (empty) set of engines in use goes to it."""
    reactor = FakeReactor()
    upgrade, d, handed, events = start(reactor)
    protocol = reactor.spawned[0]["protocol"]
    protocol.childDataReceived(1, b"ready (stdout is not the pipe)")
    assert not d.called and handed == []
    reactor.advance(0.75)
    assert upgrade.last is not None and upgrade.last["outcome"] == "in progress"
    protocol.childDataReceived(4, b"rea")
    protocol.childDataReceived(4, b"dy 1000 9.9.9")
    assert not d.called
    protocol.childDataReceived(4, b"\n")
    assert d.called and handed == [1000] and not upgrade.in_progress
    assert d.result == upgrade.last == {
        "at": 0.0, "outcome": "handed over", "candidate_pid": 1000, "reason": None,
        "old_pid": 500, "old_version": __version__, "new_pid": 1000, "new_version": "9.9.9",
        "generation": 5, "elapsed": 0.75}
    assert upgrade.successor_pid == 1000
    assert protocol.transport.written == [(5, b"settled\n"), (5, b"protect \n")]
    assert events.stages() == ["started", "ready", "handed_over"]
    [ready] = [e for e in events.events if e.stage == "ready"]
    assert ready.line() == ("info", f"upgrade: {__version__} (pid 500) -> 9.9.9 (pid 1000) "
                                    "ready in 0.8s")


def test_the_successor_hears_of_an_engine_in_use_in_the_same_turn() -> None:
    """After the hand-over, a request that starts streaming from an engine is
    told to the successor as the request event is published: no clock advance,
    no poll. Its end lifts the protection, also at once; a request on a host
    without engines changes nothing."""
    reactor = FakeReactor()
    upgrade, _, _, _ = start(reactor)
    hub_publish = upgrade._hub.publish
    protocol = reactor.spawned[0]["protocol"]
    hub_publish(routed("r1", "gpu1", "big"))     # before the hand-over: remembered
    protocol.childDataReceived(4, b"ready 1000\n")
    written = protocol.transport.written
    assert written == [(5, b"settled\n"), (5, b"protect gpu1=big\n")]
    hub_publish(routed("r2", "gpu2", "small"))
    assert written[-1] == (5, b"protect gpu1=big,gpu2=small\n")
    hub_publish(routed("r3", "laptop", None))
    hub_publish(ended("r1"))
    assert written[-1] == (5, b"protect gpu2=small\n")
    hub_publish(ended("r2"))
    assert written[-1] == (5, b"protect \n")
    assert len(written) == 5 and reactor.seconds() == 0


def test_protect_counts_every_request_on_an_engine() -> None:
    """Two requests stream from one engine: it stays protected until both ended."""
    reactor = FakeReactor()
    upgrade, _, _, _ = start(reactor)
    protocol = reactor.spawned[0]["protocol"]
    protocol.childDataReceived(4, b"ready 1000\n")
    upgrade._hub.publish(routed("a", "gpu1", "big"))
    upgrade._hub.publish(routed("b", "gpu1", "big"))
    upgrade._hub.publish(ended("a"))
    assert protocol.transport.written[-1] == (5, b"protect gpu1=big\n")
    upgrade._hub.publish(ended("b"))
    assert protocol.transport.written[-1] == (5, b"protect \n")


def test_every_engine_in_use_on_a_budgeted_host_is_protected() -> None:
    """Streams on two engines of one host (a host with memory_gb): the line names
    both, and the successor reads both back (one per host would leave the other to
    an eviction that cuts its stream); an older predecessor's line still parses."""
    reactor = FakeReactor()
    upgrade, _, _, _ = start(reactor)
    protocol = reactor.spawned[0]["protocol"]
    protocol.childDataReceived(4, b"ready 1000\n")
    upgrade._hub.publish(routed("r1", "gpu1", "chat"))
    upgrade._hub.publish(routed("r2", "gpu1", "embed"))
    assert protocol.transport.written[-1] == (5, b"protect gpu1=chat,gpu1=embed\n")
    assert parse_protect("gpu1=chat,gpu1=embed") == {"gpu1": frozenset({"chat", "embed"})}
    upgrade._hub.publish(ended("r1"))
    assert protocol.transport.written[-1] == (5, b"protect gpu1=embed\n")
    in_use = {"gpu1": frozenset({"a", "b"}), "gpu2": frozenset({"c"})}
    assert parse_protect(protect_line(in_use).decode()[len("protect"):].strip()) == in_use
    assert parse_protect("") == {} and parse_protect("gpu1=big") == {"gpu1": frozenset({"big"})}


def test_pidfile_released_for_the_candidate_restored_on_failure(tmp_path: Any) -> None:
    """The pid file is removed while the candidate starts (twistd would refuse it),
    written again with this pid when the candidate fails, and disowned (twistd's
    options say no pid file) after a hand-over."""
    path = tmp_path / "llmproxy.pid"
    path.write_text("500\n")
    runner = {"pidfile": str(path)}
    reactor = FakeReactor()
    _, _, _, _ = start(reactor, PidFile(str(path), runner, pid=lambda: 500))
    assert not path.exists()
    reactor.spawned[0]["protocol"].processEnded(Failure(ProcessTerminated(exitCode=1)))
    assert path.read_text() == "500\n" and runner["pidfile"] == str(path)
    reactor2 = FakeReactor()
    _, _, _, _ = start(reactor2, PidFile(str(path), runner, pid=lambda: 500))
    reactor2.spawned[0]["protocol"].childDataReceived(4, b"ready 1000\n")
    assert runner["pidfile"] == ""


def test_a_second_request_during_an_upgrade_is_ignored() -> None:
    """SIGUSR1 while a candidate starts: ignored, said so, nothing spawned."""
    reactor = FakeReactor()
    upgrade, _, _, events = start(reactor)

    async def never(pid: int) -> None:
        raise AssertionError("no hand-over")

    busy = upgrade.start(None, listen_fd=17, lock_fds={}, hand_over=never)
    early = upgrade.start("still starting", listen_fd=17, lock_fds={}, hand_over=never)
    assert busy.result["outcome"] == early.result["outcome"] == "ignored"
    assert early.result["reason"] == "still starting"
    assert len(reactor.spawned) == 1
    assert [e.reason for e in events.events if e.stage == "ignored"] == [
        "an upgrade is in progress", "still starting"]


def test_candidate_that_exits_first_fails_the_upgrade() -> None:
    """A candidate that exits before `ready` (bad config, import error, crash)
    fails the upgrade with its exit status."""
    reactor = FakeReactor()
    upgrade, d, handed, events = start(reactor)
    protocol = reactor.spawned[0]["protocol"]
    protocol.processEnded(Failure(ProcessTerminated(exitCode=1)))
    assert d.called and handed == []
    reason = "candidate pid 1000 exited with status 1 before it was ready"
    assert upgrade.last is not None
    assert (upgrade.last["outcome"], upgrade.last["candidate_pid"], upgrade.last["reason"]) == (
        "failed", 1000, reason)
    assert not upgrade.in_progress
    assert [(e.stage, e.reason) for e in events.events][-1] == ("failed", reason)
    assert reactor.spawned[0]["protocol"].transport.signals == []   # already gone


def test_candidate_not_ready_in_time_is_killed() -> None:
    """Not ready within the timeout: SIGTERM, then SIGKILL if it lingers, and the
    upgrade fails saying so."""
    reactor = FakeReactor()
    upgrade, d, handed, _ = start(reactor)
    protocol = reactor.spawned[0]["protocol"]
    transport = protocol.transport
    reactor.advance(30)
    assert transport.signals == ["TERM"] and not d.called
    reactor.advance(2)
    assert transport.signals == ["TERM", "KILL"]
    protocol.processEnded(Failure(ProcessTerminated(signal=9)))
    assert d.called and handed == []
    assert upgrade.last is not None and "was not ready within 30s" in upgrade.last["reason"]


def test_clean_exit_before_ready_is_a_failure_too() -> None:
    """Status 0 without `ready` is still a failed upgrade."""
    reactor = FakeReactor()
    upgrade, d, handed, _ = start(reactor)
    reactor.spawned[0]["protocol"].processEnded(Failure(ProcessDone(0)))
    assert d.called and handed == []
    assert upgrade.last is not None
    assert "exited with status 0 before it was ready" in upgrade.last["reason"]


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


def test_the_successor_publishes_its_predecessors_exit() -> None:
    """When the predecessor's pipe closes (it has drained and exited), the
    successor publishes `upgrade` stage predecessor_exited naming its pid, and
    `/status` says it no longer drains by then (what `llmproxy upgrade` waits on)."""
    from twisted.internet.error import ConnectionDone
    from twisted.internet.testing import MemoryReactorClock

    reactor = MemoryReactorClock()
    hub = Hub()
    events = Recorder(hub)
    seen: list[bool] = []
    read_fd, write_fd = os.pipe()
    handover = Handover(generation=5, predecessor_pid=400, ready_fd=-1,
                        predecessor_fd=read_fd)
    launcher = Launcher(reactor, executable="/venv/bin/python", argv=[], environ={},
                        timeout=30)
    upgrade = Upgrade(reactor, hub, PidFile("/run/x.pid"), launcher, handover=handover, pid=500)
    hub.subscribe(lambda e: seen.append(upgrade.status()["predecessor"]["draining"])
                  if isinstance(e, UpgradeStage) else None)
    upgrade.follow_predecessor(lambda engines: None)
    assert upgrade.status()["predecessor"] == {"pid": 400, "draining": True}
    assert events.stages() == []
    (reader,) = reactor.getReaders()
    os.close(write_fd)
    reader.connectionLost(Failure(ConnectionDone()))
    assert events.stages() == ["predecessor_exited"]
    event = events.events[-1]
    assert (event.pid, event.candidate_pid, event.generation) == (400, 500, 5)
    assert event.line() == ("info", "upgrade: predecessor pid 400 drained and exited")
    assert seen == [False]
    assert upgrade.predecessor_exit() is None


def test_a_daemons_candidate_is_told_its_log_file_and_starts_where_twistd_did() -> None:
    """A daemon's log file goes to the candidate as --logfile (in the foreground without
    one it would log to the daemon's /dev/null), and the candidate starts in twistd's start
    directory, so the argv's relative paths (--pidfile, -c) mean what they meant."""
    assert candidate_argv("/usr/bin/python3", ["/usr/bin/twistd", "--pidfile=p", "llmproxy"],
                          "/srv/twistd.log")[4:] == [
        "/usr/bin/python3", "/usr/bin/twistd", "--nodaemon", "--logfile=/srv/twistd.log",
        "--pidfile=p", "llmproxy"]
    reactor = FakeReactor()
    launcher = Launcher(reactor, executable="/venv/bin/python",
                        argv=["/venv/bin/twistd", "llmproxy", "-c", "h.json"], environ={},
                        cwd="/srv/proxy", log_file="/srv/proxy/twistd.log")
    launcher.spawn(generation=2, listen_fd=17, lock_fds={}, pidfile=None)
    [spawn] = reactor.spawned
    assert spawn["path"] == "/srv/proxy"
    assert "--logfile=/srv/proxy/twistd.log" in spawn["args"]


def test_the_upgrade_names_the_pid_of_the_process_it_runs_in_now() -> None:
    """Built before twistd daemonizes (makeService), the upgrade still names the daemon:
    its pid is read when an event or a status needs it, not when it was built."""
    reactor = FakeReactor()
    launcher = Launcher(reactor, argv=["/venv/bin/twistd", "llmproxy"], environ={})
    upgrade = Upgrade(reactor, Hub(), PidFile(None), launcher)
    with patch.object(os, "getpid", lambda: 4321):
        assert upgrade.pid == 4321
        d = upgrade.start("not now", listen_fd=3, lock_fds={}, hand_over=lambda pid: None)
        assert d.result["old_pid"] == 4321


def test_the_state_the_hand_over_sends_comes_before_settled() -> None:
    """What `hand_over` tells the successor (the keys' rate-limit and energy use)
    is written before the `settled` line that says it is all there."""
    reactor = FakeReactor()
    upgrade = Upgrade(reactor, Hub(), PidFile("/run/x.pid"), Launcher(
        reactor, executable="/venv/bin/python", argv=["/venv/bin/twistd", "llmproxy"],
        environ={}))

    async def hand_over(pid: int) -> None:
        upgrade.tell_successor(b"ratelimit {}\n")
        upgrade.tell_successor(b"energybudget {}\n")

    upgrade.start(None, listen_fd=17, lock_fds={}, hand_over=hand_over)
    protocol = reactor.spawned[0]["protocol"]
    protocol.childDataReceived(4, b"ready 1000\n")
    assert protocol.transport.written == [(5, b"ratelimit {}\n"), (5, b"energybudget {}\n"),
                                          (5, b"settled\n"), (5, b"protect \n")]


def following(reactor: Any, hub: Hub) -> tuple[Upgrade, int, list[str]]:
    """A successor (pid 500, generation 5) following its predecessor's pipe: the
    upgrade, the pipe's write end, and what it heard in order."""
    read_fd, write_fd = os.pipe()
    handover = Handover(generation=5, predecessor_pid=400, ready_fd=-1, predecessor_fd=read_fd)
    upgrade = Upgrade(reactor, hub, PidFile("/run/x.pid"),
                      Launcher(reactor, executable="/venv/bin/python", argv=[], environ={}),
                      handover=handover, pid=500)
    heard: list[str] = []
    upgrade.follow_predecessor(lambda engines: heard.append(f"protect {sorted(engines)}"),
                               lambda word, rest: heard.append(word.decode()),
                               lambda: heard.append("settled()"))
    return upgrade, write_fd, heard


def test_the_successor_is_settled_at_the_predecessors_settled_line() -> None:
    """The state lines are taken, then `settled()` is called at the `settled` line,
    once: not again at the predecessor's exit, nor when INHERIT_WAIT is over."""
    from twisted.internet.error import ConnectionDone
    from twisted.internet.testing import MemoryReactorClock

    from llmproxy.lifecycle.handover import INHERIT_WAIT

    reactor = MemoryReactorClock()
    _, write_fd, heard = following(reactor, Hub())
    (reader,) = reactor.getReaders()
    os.write(write_fd, b"ratelimit {}\nenergybudget {}\nsettled\nprotect gpu1=a\n")
    reader.doRead()
    assert heard == ["ratelimit", "energybudget", "settled()", "protect ['gpu1']"]
    assert reactor.getDelayedCalls() == []      # the deadline is cancelled
    os.close(write_fd)
    reader.connectionLost(Failure(ConnectionDone()))
    reactor.advance(INHERIT_WAIT)
    assert heard.count("settled()") == 1


def test_a_successor_whose_predecessor_says_nothing_is_settled_after_inherit_wait() -> None:
    """No `settled` line (a predecessor of an earlier make, or a wedged one): after
    INHERIT_WAIT seconds the successor goes on without the state, and says so
    (a warning, stage state_late); the predecessor's exit then changes nothing."""
    from twisted.internet.error import ConnectionDone
    from twisted.internet.testing import MemoryReactorClock

    from llmproxy.lifecycle.handover import INHERIT_WAIT

    reactor = MemoryReactorClock()
    hub = Hub()
    events = Recorder(hub)
    _, write_fd, heard = following(reactor, hub)
    reactor.advance(INHERIT_WAIT - 0.1)
    assert heard == [] and events.stages() == []
    reactor.advance(0.1)
    assert heard == ["settled()"] and events.stages() == ["state_late"]
    assert events.events[-1].line() == (
        "warn", "upgrade: predecessor pid 400 sent its keys' rate-limit and energy use not "
                "within 5s: keys with limits are judged without it")
    (reader,) = reactor.getReaders()
    os.close(write_fd)
    reader.connectionLost(Failure(ConnectionDone()))
    assert heard == ["settled()", "protect []"]
    assert events.stages() == ["state_late", "predecessor_exited"]


def test_a_predecessor_gone_without_settled_settles_the_successor() -> None:
    """The predecessor exits before its `settled` line: nothing more can come, so
    the successor is settled then (no warning)."""
    from twisted.internet.error import ConnectionDone
    from twisted.internet.testing import MemoryReactorClock

    reactor = MemoryReactorClock()
    hub = Hub()
    events = Recorder(hub)
    _, write_fd, heard = following(reactor, hub)
    (reader,) = reactor.getReaders()
    os.close(write_fd)
    reader.connectionLost(Failure(ConnectionDone()))
    assert heard == ["protect []", "settled()"]
    assert events.stages() == ["predecessor_exited"] and reactor.getDelayedCalls() == []


def test_a_process_started_afresh_is_settled_at_once() -> None:
    reactor = FakeReactor()
    upgrade = Upgrade(reactor, Hub(), PidFile("/run/x.pid"),
                      Launcher(reactor, executable="/venv/bin/python", argv=[], environ={}))
    heard: list[str] = []
    upgrade.follow_predecessor(lambda engines: None, None, lambda: heard.append("settled()"))
    assert heard == ["settled()"] and reactor.getDelayedCalls() == []
