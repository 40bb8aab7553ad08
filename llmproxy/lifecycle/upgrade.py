"""Zero-downtime upgrade on SIGUSR1, both sides of it, as one object (`Upgrade`).

The old process starts the newly installed code as a candidate that inherits
the listening socket and the host locks (`handover` says how), and waits for
its ready line. Then, in this order: this process stops accepting, disowns the
pid file, tells systemd `MAINPID=<new>` with `READY=1`, and stops (drains and
exits) like on SIGTERM. Until it has exited, it tells the successor which
engines its requests still stream from, as they change: request events drive
that, in the turn the request starts or ends. If the candidate exits or is
not ready in time, it is killed and this process serves on.

The new process reads the hand-over at start-up, tells the predecessor once it
serves, follows its `protect` lines, and knows when it has exited (a stop
waits for that, so systemd's final SIGKILL finds no stream to cut).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ProcessDone, ProcessExitedAlready
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from llmproxy import __version__
from llmproxy.core.clockwaits import within
from llmproxy.core.events import Event, RequestEnded, RequestRouted, UpgradeStage
from llmproxy.core.hub import Hub
from llmproxy.core.reactors import IProcessClock, IUpgradeReactor
from llmproxy.lifecycle.handover import (
    FIRST_LOCK_FD,
    HANDOVER_VARIABLE,
    INHERIT_WAIT,
    LISTEN_FD,
    PREDECESSOR_FD,
    READY_FD,
    SETTLED,
    Handover,
    InUse,
    handover_environ,
    parse_ready,
    protect_line,
    watch_predecessor,
    write_ready,
)
from llmproxy.lifecycle.pidfile import PidFile

# exec with SIGHUP and SIGUSR1 ignored (handlers would be reset to "terminate"
# by exec) and LISTEN_PID naming the exec'd process itself.
LAUNCH = 'trap "" HUP USR1; LISTEN_PID=$$; export LISTEN_PID; exec "$@"'


def candidate_argv(executable: str, argv: list[str], log_file: str | None = None) -> list[str]:
    """How the candidate is started: the same interpreter and argv, via sh.

    `--nodaemon` goes in front of twistd's own options: a daemonizing candidate
    would fork away, its parent would exit as if it had failed, and the ready
    handshake would be lost (the old process is already a daemon, if it was
    asked to be one; the candidate stays in its session). A daemon's log file
    (`log_file`, its absolute path) is named with `--logfile`: in the
    foreground without one, twistd would log to the daemon's standard output,
    /dev/null (a `--logfile` of the argv, later, names the same file)."""
    script, *options = argv
    logging = [f"--logfile={log_file}"] if log_file else []
    return ["/bin/sh", "-c", LAUNCH, "llmproxy-upgrade", executable, script, "--nodaemon",
            *logging, *options]


class UpgradeFailed(Exception):
    """The candidate did not become ready; the message says why."""


Ready = tuple[int, "str | None"]   # the candidate's pid and version


class _Candidate(ProcessProtocol):
    def __init__(self, ready: Deferred[Ready]) -> None:
        self.ready = ready
        self.ended: Deferred[None] = Deferred()
        self._buffer = b""

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD != READY_FD:
            return
        self._buffer += data
        line, newline, _ = self._buffer.partition(b"\n")
        if newline and line.startswith(b"ready") and not self.ready.called:
            assert self.transport is not None
            self.ready.callback((int(self.transport.pid or 0), parse_ready(line)))

    def processEnded(self, reason: Failure) -> None:
        # Gone first: whoever handles the failure must not signal a dead pid.
        self.ended.callback(None)
        if not self.ready.called:
            if reason.check(ProcessDone):
                why = "exited with status 0 before it was ready"
            else:
                code = getattr(reason.value, "exitCode", None)
                sig = getattr(reason.value, "signal", None)
                why = (f"was killed by signal {signal.Signals(sig).name} before it was ready"
                       if sig else f"exited with status {code} before it was ready")
            self.ready.errback(UpgradeFailed(why))


class Launcher:
    """Starts a candidate with the socket, the pipes and the locks, and waits
    until it says it is ready (or kills it)."""

    def __init__(self, reactor: IProcessClock, *, executable: str = sys.executable,
                 argv: list[str] | None = None, environ: Mapping[str, str] | None = None,
                 timeout: float = 30.0, cwd: str | None = None,
                 log_file: str | None = None) -> None:
        self._reactor = reactor
        self._executable = executable
        self._argv = list(sys.argv if argv is None else argv)
        self._environ = dict(os.environ if environ is None else environ)
        self.timeout = timeout
        # Where the candidate starts: twistd's own start directory (a daemon has
        # moved to its --rundir since), so relative paths of the argv mean the same.
        self._cwd = cwd
        self._log_file = log_file

    def spawn(self, *, generation: int, listen_fd: int, lock_fds: Mapping[str, int],
              pidfile: str | None, started_at: float | None = None
              ) -> tuple[Any, Deferred[Ready]]:
        """Start the candidate for `generation`: its transport, and a Deferred
        that fires with its pid and version once it is ready (UpgradeFailed if
        it is not; it is then gone)."""
        child_fds: dict[int, Any] = {0: 0, 1: 1, 2: 2, LISTEN_FD: listen_fd,
                                     READY_FD: "r", PREDECESSOR_FD: "w"}
        child_locks = {}
        for i, (target, fd) in enumerate(sorted(lock_fds.items())):
            child_fds[FIRST_LOCK_FD + i] = fd
            child_locks[target] = FIRST_LOCK_FD + i
        env = dict(self._environ)
        env[HANDOVER_VARIABLE] = handover_environ(
            generation=generation, predecessor_pid=os.getpid(), lock_fds=child_locks,
            pidfile=pidfile, started_at=started_at)
        env["LISTEN_FDS"] = "1"
        env["LISTEN_FDNAMES"] = "llmproxy-upgrade"
        env.pop("LISTEN_PID", None)       # the launch shell sets it to the candidate's pid
        ready: Deferred[Ready] = Deferred()
        candidate = _Candidate(ready)
        argv = candidate_argv(self._executable, self._argv, self._log_file)
        transport = self._reactor.spawnProcess(candidate, argv[0], argv, env=env,
                                               path=self._cwd, childFDs=child_fds)
        return transport, Deferred.fromCoroutine(self._wait(transport, candidate, ready))

    async def _wait(self, transport: Any, candidate: _Candidate,
                    ready: Deferred[Ready]) -> Ready:
        def too_slow() -> None:
            if not ready.called:
                ready.errback(UpgradeFailed(f"was not ready within {self.timeout:g}s"))

        timer: IDelayedCall = self._reactor.callLater(self.timeout, too_slow)
        pid = transport.pid
        try:
            result = await ready
        except UpgradeFailed as e:
            await self._kill(transport, candidate)
            raise UpgradeFailed(f"candidate pid {pid} {e}") from None
        finally:
            if timer.active():
                timer.cancel()
        return result

    async def _kill(self, transport: Any, candidate: _Candidate) -> None:
        """SIGTERM the candidate, SIGKILL it if it lingers; wait until it is gone."""
        for sig, grace in (("TERM", 2.0), ("KILL", 5.0)):
            if candidate.ended.called:
                return
            with contextlib.suppress(ProcessExitedAlready, OSError):
                transport.signalProcess(sig)
            await within(self._reactor, candidate.ended, grace)


class _InUse:
    """The engines this process's requests stream from (host -> engines: a host
    with memory_gb streams from several), kept from request events; `changed` is
    called when that set changes."""

    def __init__(self, changed: Callable[[InUse], None]) -> None:
        self._by_request: dict[str, tuple[str, str]] = {}
        self._changed = changed
        self.engines: InUse = {}

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestRouted) and event.engine is not None:
            self._by_request[event.request_id] = (event.host, event.engine)
        elif isinstance(event, RequestEnded) and event.request_id in self._by_request:
            del self._by_request[event.request_id]
        else:
            return
        found: dict[str, set[str]] = {}
        for host, engine in self._by_request.values():
            found.setdefault(host, set()).add(engine)
        engines = {host: frozenset(names) for host, names in found.items()}
        if engines != self.engines:
            self.engines = engines
            self._changed(engines)


HandOver = Callable[[int], Awaitable[None]]


class Upgrade:
    """This process's place in the line of generations, and the SIGUSR1 upgrade."""

    def __init__(self, reactor: IUpgradeReactor, hub: Hub, pidfile: PidFile, launcher: Launcher, *,
                 handover: Handover | None = None, pid: int | None = None) -> None:
        self._reactor = reactor
        self._hub = hub
        self._pidfile = pidfile
        self._launcher = launcher
        self.handover = handover
        self._pid = pid
        self.generation = handover.generation if handover else 1
        self.in_progress = False
        self.last: dict[str, Any] | None = None
        self.successor_pid: int | None = None
        self._successor_url: str | None = None
        self.predecessor_gone: Deferred[None] | None = None
        self._successor: Any = None      # the successor's process transport
        self._in_use = _InUse(self._tell_successor)
        hub.subscribe(self._in_use)

    @property
    def successor_url(self) -> str | None:
        """Where the successor serves (this socket, as this process reaches it), from
        the moment the hand-over begins; None before and without an upgrade."""
        return self._successor_url

    @property
    def pid(self) -> int:
        """This process's pid, read when asked: a daemon forks after it was built."""
        return self._pid or os.getpid()

    # -- the old process's side ------------------------------------------------
    def start(self, refusal: str | None, *, listen_fd: int, successor_url: str | None = None,
              lock_fds: Mapping[str, int], hand_over: HandOver) -> Deferred[dict[str, Any]]:
        """SIGUSR1: start a candidate unless `refusal` (or one in progress) says
        not now; once it is ready, it serves at `successor_url` (the socket
        `listen_fd` it inherits, as this process reaches it: `successor_url` from
        then on) and `hand_over(pid)` makes this process leave.
        Fires with the upgrade's record (`last`) once it has handed over or
        failed, or at once with outcome `ignored` and the reason."""
        refusal = refusal or ("an upgrade is in progress" if self.in_progress else None)
        if refusal:
            self._publish("ignored", reason=refusal)
            return succeed({"outcome": "ignored", "reason": refusal, "old_pid": self.pid,
                            "generation": self.generation})
        self.in_progress = True
        return Deferred.fromCoroutine(self._run(listen_fd, successor_url, lock_fds, hand_over))

    async def _run(self, listen_fd: int, successor_url: str | None,
                   lock_fds: Mapping[str, int], hand_over: HandOver) -> dict[str, Any]:
        generation = self.generation + 1
        started = self._reactor.seconds()
        removed = self._pidfile.release()   # twistd's check would refuse the candidate
        try:
            transport, ready = self._launcher.spawn(
                generation=generation, listen_fd=listen_fd, lock_fds=lock_fds,
                pidfile=self._pidfile.path, started_at=started)
            self._record("in progress", started, generation, new_pid=transport.pid)
            self._publish("started", candidate_pid=transport.pid, generation=generation)
            try:
                pid, version = await ready
            except UpgradeFailed as e:
                self._record("failed", started, generation, new_pid=transport.pid,
                             reason=str(e))
                self._publish("failed", candidate_pid=transport.pid, generation=generation,
                              reason=str(e))
                if removed:
                    self._pidfile.restore()
                return self.last or {}
        finally:
            self.in_progress = False
        elapsed = self._reactor.seconds() - started
        self._successor, self.successor_pid = transport, pid
        self._record("handed over", started, generation, new_pid=pid, new_version=version,
                     elapsed=round(elapsed, 3))
        self._publish("ready", candidate_pid=pid, generation=generation, elapsed=elapsed,
                      old_version=__version__, new_version=version)
        self._successor_url = successor_url
        await hand_over(pid)
        self.tell_successor(SETTLED + b"\n")    # after the state hand_over sent
        self._pidfile.disown()
        self._publish("handed_over", candidate_pid=pid, generation=generation)
        self._tell_successor(self._in_use.engines)
        return self.last or {}

    def _tell_successor(self, engines: InUse) -> None:
        """Until this process exits, the successor must not switch or stop these."""
        self.tell_successor(protect_line(engines))

    def tell_successor(self, line: bytes) -> None:
        """Write one line to the successor's pipe from its predecessor (once
        handed over; see `handover`)."""
        if self._successor is None:
            return
        try:
            self._successor.writeToChild(PREDECESSOR_FD, line)
        except Exception:   # the successor is gone; nothing to tell it
            self._successor = None

    def _record(self, outcome: str, at: float, generation: int, *, new_pid: int | None,
                reason: str | None = None, new_version: str | None = None,
                old_pid: int | None = None, old_version: str | None = __version__,
                elapsed: float | None = None) -> None:
        self.last = {"at": at, "outcome": outcome, "candidate_pid": new_pid, "reason": reason,
                     "old_pid": old_pid or self.pid, "old_version": old_version,
                     "new_pid": new_pid, "new_version": new_version,
                     "generation": generation, "elapsed": elapsed}

    def _publish(self, stage: str, **fields: Any) -> None:
        self._hub.publish(UpgradeStage(self._reactor.seconds(), stage, self.pid, **fields))

    # -- the new process's side ------------------------------------------------
    def follow_predecessor(self, protect: Callable[[InUse], None],
                           other: Callable[[bytes, bytes], None] | None = None,
                           settled: Callable[[], None] = lambda: None) -> None:
        """Hear the predecessor's protect lines (and its `other` lines), and when
        it has exited. `settled()` is called once the state it sends at the
        hand-over (its keys' use) has all come (its `settled` line, or its exit),
        at the latest INHERIT_WAIT seconds from now (stage state_late); at once
        without a predecessor."""
        handover = self.handover
        if handover is None:
            settled()
            return
        came: Deferred[None] = Deferred()
        gone = watch_predecessor(self._reactor, handover.predecessor_fd, protect, other,
                                 lambda: None if came.called else came.callback(None))
        within(self._reactor, came, INHERIT_WAIT).addCallback(self._inherited, settled)
        self.predecessor_gone = gone.addCallback(self._predecessor_exited)

    def _inherited(self, came: bool, settled: Callable[[], None]) -> None:
        """The predecessor's state came (`came`), or INHERIT_WAIT passed first."""
        if not came:
            assert self.handover is not None
            self._hub.publish(UpgradeStage(
                self._reactor.seconds(), "state_late", self.handover.predecessor_pid,
                candidate_pid=self.pid, generation=self.generation, elapsed=INHERIT_WAIT))
        settled()

    def _predecessor_exited(self, result: None) -> None:
        """The predecessor's pipe closed: it has drained and exited (`/status` says
        so already: the Deferred has fired)."""
        assert self.handover is not None
        self._hub.publish(UpgradeStage(self._reactor.seconds(), "predecessor_exited",
                                       self.handover.predecessor_pid, candidate_pid=self.pid,
                                       generation=self.generation))
        return result

    def serving(self) -> bool:
        """This process serves now: tell the predecessor, if there is one (it then
        tells systemd and leaves). Whether there was one."""
        handover = self.handover
        if handover is None:
            return False
        started = handover.started_at
        self._record("handed over", started if started is not None else self._reactor.seconds(),
                     self.generation, new_pid=self.pid, new_version=__version__,
                     old_pid=handover.predecessor_pid,
                     old_version=handover.predecessor_version,
                     elapsed=None if started is None
                     else round(self._reactor.seconds() - started, 3))
        write_ready(handover.ready_fd)
        self._hub.publish(UpgradeStage(self._reactor.seconds(), "serving",
                                       handover.predecessor_pid, candidate_pid=self.pid,
                                       generation=self.generation))
        return True

    def predecessor_exit(self) -> tuple[int, Deferred[None]] | None:
        """A predecessor still draining: its pid and a Deferred for its exit."""
        if self.handover is None or self.predecessor_gone is None or self.predecessor_gone.called:
            return None
        return self.handover.predecessor_pid, self.predecessor_gone

    def status(self) -> dict[str, Any]:
        """The generation, the predecessor and successor, the last upgrade."""
        return {
            "generation": self.generation,
            "predecessor": None if self.handover is None else {
                "pid": self.handover.predecessor_pid,
                "draining": not (self.predecessor_gone is not None
                                 and self.predecessor_gone.called)},
            "successor_pid": self.successor_pid,
            "last_upgrade": self.last,
        }
