"""Zero-downtime upgrade on SIGUSR1: start the newly installed code as a new
process that inherits the listening socket, and hand over once it is ready.

The candidate is started with the same interpreter and argv (so a re-installed
package is picked up), through `sh` so that it is exec'd with SIGHUP and SIGUSR1
ignored and with `LISTEN_PID` set to its own pid: it takes the socket exactly as
it would from systemd (fd 3). Besides the socket it gets:

    fd 4  a pipe it writes `ready` to once it has read its config and rosters
          and accepts;
    fd 5  a pipe from this process: lines `protect host=engine,...` naming the
          engines this process's streams still use (the candidate must not
          switch or stop them), and EOF when this process is gone;
    fd 6+ the per-host lock files, already locked (an inherited open file
          description keeps its flock, so nothing can grab a host in between);

and `LLMPROXY_HANDOVER` (JSON) describing them. If the candidate exits, or is
not ready within the timeout, it is killed and this process serves on as if
nothing happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessExitedAlready
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

HANDOVER_VARIABLE = "LLMPROXY_HANDOVER"
LISTEN_FD, READY_FD, PREDECESSOR_FD, FIRST_LOCK_FD = 3, 4, 5, 6
# exec with SIGHUP and SIGUSR1 ignored (handlers would be reset to "terminate"
# by exec) and LISTEN_PID naming the exec'd process itself.
LAUNCH = 'trap "" HUP USR1; LISTEN_PID=$$; export LISTEN_PID; exec "$@"'


@dataclass(frozen=True)
class Handover:
    """What a candidate process received from its predecessor."""

    generation: int
    predecessor_pid: int
    ready_fd: int
    predecessor_fd: int
    lock_fds: Mapping[str, int] = field(default_factory=dict)
    pidfile: str | None = None


def handover_from_environ(environ: MutableMapping[str, str]) -> Handover | None:
    """The hand-over this process was started with, if any (and forget it, so
    no child of ours mistakes it for its own)."""
    raw = environ.pop(HANDOVER_VARIABLE, None)
    if not raw:
        return None
    doc = json.loads(raw)
    handover = Handover(generation=int(doc["generation"]),
                        predecessor_pid=int(doc["predecessor_pid"]),
                        ready_fd=int(doc["ready_fd"]), predecessor_fd=int(doc["predecessor_fd"]),
                        lock_fds={str(k): int(v) for k, v in doc.get("lock_fds", {}).items()},
                        pidfile=doc.get("pidfile"))
    for fd in (handover.ready_fd, handover.predecessor_fd, *handover.lock_fds.values()):
        os.set_inheritable(fd, False)
    return handover


def candidate_argv(executable: str, argv: list[str]) -> list[str]:
    """How the candidate is started: the same interpreter and argv, via sh.

    `--nodaemon` goes in front of twistd's own options: a daemonizing candidate
    would fork away, its parent would exit as if it had failed, and the ready
    handshake would be lost (the old process is already a daemon, if it was
    asked to be one; the candidate stays in its session)."""
    script, *options = argv
    return ["/bin/sh", "-c", LAUNCH, "llmproxy-upgrade", executable, script, "--nodaemon",
            *options]


class UpgradeFailed(Exception):
    """The candidate did not become ready; the message says why."""


class _Candidate(ProcessProtocol):
    def __init__(self, ready: Deferred[int]) -> None:
        self.ready = ready
        self.ended: Deferred[None] = Deferred()
        self._buffer = b""

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD != READY_FD:
            return
        self._buffer += data
        if b"ready" in self._buffer and not self.ready.called:
            assert self.transport is not None
            self.ready.callback(int(self.transport.pid or 0))

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


class Upgrader:
    """Starts one candidate at a time and reports whether it became ready."""

    log = Logger()

    def __init__(self, reactor: Any, *, executable: str = sys.executable,
                 argv: list[str] | None = None, environ: Mapping[str, str] | None = None,
                 timeout: float = 30.0) -> None:
        self._reactor = reactor
        self._executable = executable
        self._argv = list(sys.argv if argv is None else argv)
        self._environ = dict(os.environ if environ is None else environ)
        self.timeout = timeout
        self.in_progress = False
        self.last: dict[str, Any] | None = None
        self.successor: Any = None   # the transport of the candidate that took over

    async def upgrade(self, *, generation: int, listen_fd: int, lock_fds: Mapping[str, int],
                      pidfile: str | None) -> int:
        """Start a candidate and wait until it is ready; returns its pid.

        Raises UpgradeFailed after killing a candidate that failed."""
        self.in_progress = True
        try:
            return await self._upgrade(generation, listen_fd, lock_fds, pidfile)
        finally:
            self.in_progress = False

    async def _upgrade(self, generation: int, listen_fd: int, lock_fds: Mapping[str, int],
                       pidfile: str | None) -> int:
        child_fds: dict[int, Any] = {0: 0, 1: 1, 2: 2, LISTEN_FD: listen_fd,
                                     READY_FD: "r", PREDECESSOR_FD: "w"}
        child_locks = {}
        for i, (target, fd) in enumerate(sorted(lock_fds.items())):
            child_fds[FIRST_LOCK_FD + i] = fd
            child_locks[target] = FIRST_LOCK_FD + i
        env = dict(self._environ)
        env[HANDOVER_VARIABLE] = json.dumps({
            "generation": generation + 1, "predecessor_pid": os.getpid(),
            "ready_fd": READY_FD, "predecessor_fd": PREDECESSOR_FD, "lock_fds": child_locks,
            "pidfile": pidfile})
        env["LISTEN_FDS"] = "1"
        env["LISTEN_FDNAMES"] = "llmproxy-upgrade"
        env.pop("LISTEN_PID", None)       # the launch shell sets it to the candidate's pid
        ready: Deferred[int] = Deferred()
        candidate = _Candidate(ready)
        argv = candidate_argv(self._executable, self._argv)
        transport = self._reactor.spawnProcess(candidate, argv[0], argv, env=env,
                                               childFDs=child_fds)
        pid = transport.pid
        self.log.info("upgrade: started candidate pid {pid} for generation {generation}",
                      pid=pid, generation=generation + 1)
        def too_slow() -> None:
            if not ready.called:
                ready.errback(UpgradeFailed(f"was not ready within {self.timeout:g}s"))

        timer: IDelayedCall = self._reactor.callLater(self.timeout, too_slow)
        try:
            await ready
        except UpgradeFailed as e:
            await self._kill(transport, candidate)
            self.last = {"at": self._reactor.seconds(), "outcome": "failed",
                         "candidate_pid": pid, "reason": f"candidate pid {pid} {e}"}
            raise UpgradeFailed(f"candidate pid {pid} {e}") from None
        finally:
            if timer.active():
                timer.cancel()
        self.successor = transport
        self.last = {"at": self._reactor.seconds(), "outcome": "handed over",
                     "candidate_pid": pid, "reason": None}
        return int(pid)

    async def _kill(self, transport: Any, candidate: _Candidate) -> None:
        """SIGTERM the candidate, SIGKILL it if it lingers; wait until it is gone."""
        from llmproxy.core.timing import within

        for sig, grace in (("TERM", 2.0), ("KILL", 5.0)):
            if candidate.ended.called:
                return
            with contextlib.suppress(ProcessExitedAlready, OSError):
                transport.signalProcess(sig)
            await within(self._reactor, candidate.ended, grace)

    def protect(self, engines: Mapping[str, str]) -> None:
        """Tell the successor which engines this process's streams still use."""
        if self.successor is None:
            return
        line = "protect " + ",".join(f"{h}={e}" for h, e in sorted(engines.items())) + "\n"
        try:
            self.successor.writeToChild(PREDECESSOR_FD, line.encode())
        except Exception:   # the successor is gone; nothing to protect from
            self.successor = None


def write_ready(fd: int) -> None:
    """Tell the predecessor this process is ready (and let go of the pipe)."""
    try:
        os.write(fd, f"ready {os.getpid()}\n".encode())
    finally:
        os.close(fd)


def watch_predecessor(reactor: Any, fd: int, on_protect: Callable[[dict[str, str]], None]
                      ) -> Deferred[None]:
    """Follow the predecessor's pipe: `protect` lines as they come; fires at EOF,
    that is when the predecessor has exited."""
    from twisted.internet import abstract, fdesc

    gone: Deferred[None] = Deferred()

    class Reader(abstract.FileDescriptor):
        buffer = b""

        def fileno(self) -> int:
            return fd

        def doRead(self) -> Any:
            return fdesc.readFromFD(fd, self.dataReceived)

        def dataReceived(self, data: bytes) -> None:
            self.buffer += data
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                if line.startswith(b"protect"):
                    pairs = line[len(b"protect"):].strip().decode()
                    on_protect(dict(p.split("=", 1) for p in pairs.split(",") if "=" in p))

        def connectionLost(self, reason: Failure) -> None:
            super().connectionLost(reason)
            os.close(fd)
            on_protect({})
            if not gone.called:
                gone.callback(None)

    fdesc.setNonBlocking(fd)
    reader = Reader(reactor)
    reader.startReading()
    return gone
