"""What passes between two generations of llmproxy in an upgrade (see `upgrade`).

The candidate is started with, besides the listening socket (fd 3, as from systemd):

    fd 4  a pipe it writes `ready PID` to once it has read its config and rosters
          and accepts;
    fd 5  a pipe from its predecessor: lines `protect host=engine,...` naming the
          engines the predecessor's streams still use (the candidate must not
          switch or stop them; a host with memory_gb may appear once per engine),
          lines `ratelimit {JSON}` carrying the keys' rate-limit state
          (web/ratelimit.py), lines `energybudget {JSON}` their energy today
          (web/energybudget.py), then one line `settled` once all of that
          state as of the hand-over is written (what comes later are
          updates), and EOF when the predecessor is gone;
    fd 6+ the per-host lock files, already locked (an inherited open file
          description keeps its flock, so nothing can grab a host in between);

and `LLMPROXY_HANDOVER` (JSON) describing them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, MutableMapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFDSet
from twisted.python.failure import Failure

from llmproxy import __version__

HANDOVER_VARIABLE = "LLMPROXY_HANDOVER"
LISTEN_FD, READY_FD, PREDECESSOR_FD, FIRST_LOCK_FD = 3, 4, 5, 6
SETTLED = b"settled"    # the predecessor's line after its state as of the hand-over
# Seconds a successor waits at most for that state (the keys' use): requests of
# keys with limits wait that long at most (web/access.py).
INHERIT_WAIT = 5.0


@dataclass(frozen=True)
class Handover:
    """What a candidate process received from its predecessor."""

    generation: int
    predecessor_pid: int
    ready_fd: int
    predecessor_fd: int
    lock_fds: Mapping[str, int] = field(default_factory=dict)
    pidfile: str | None = None
    predecessor_version: str | None = None
    started_at: float | None = None      # when the predecessor began the upgrade (Unix time)


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
                        pidfile=doc.get("pidfile"),
                        predecessor_version=doc.get("predecessor_version"),
                        started_at=doc.get("started_at"))
    for fd in (handover.ready_fd, handover.predecessor_fd, *handover.lock_fds.values()):
        os.set_inheritable(fd, False)
    return handover


def handover_environ(*, generation: int, predecessor_pid: int, lock_fds: Mapping[str, int],
                     pidfile: str | None, started_at: float | None = None) -> str:
    """The `LLMPROXY_HANDOVER` value for a candidate of `generation`."""
    return json.dumps({
        "generation": generation, "predecessor_pid": predecessor_pid,
        "ready_fd": READY_FD, "predecessor_fd": PREDECESSOR_FD, "lock_fds": dict(lock_fds),
        "pidfile": pidfile, "predecessor_version": __version__, "started_at": started_at})


def parse_ready(line: bytes) -> str | None:
    """The version in a candidate's `ready PID VERSION` line (None if it gave none)."""
    parts = line.split()
    return parts[2].decode("ascii", "replace") if len(parts) > 2 else None


InUse = dict[str, frozenset[str]]     # host -> the engines streams use there


def protect_line(engines: Mapping[str, AbstractSet[str]]) -> bytes:
    """The line that tells a successor which engines are still in use: one
    `host=engine` pair per engine (a budgeted host runs several)."""
    return ("protect " + ",".join(f"{h}={e}" for h in sorted(engines)
                                  for e in sorted(engines[h])) + "\n").encode()


def parse_protect(pairs: str) -> InUse:
    """The engines in use a protect line names (after `protect`), per host."""
    found: dict[str, set[str]] = {}
    for pair in pairs.split(","):
        host, sep, engine = pair.strip().partition("=")
        if sep:
            found.setdefault(host, set()).add(engine)
    return {host: frozenset(engines) for host, engines in found.items()}


def write_ready(fd: int) -> None:
    """Tell the predecessor this process is ready (and let go of the pipe)."""
    try:
        os.write(fd, f"ready {os.getpid()} {__version__}\n".encode())
    finally:
        os.close(fd)


def watch_predecessor(reactor: IReactorFDSet, fd: int, on_protect: Callable[[InUse], None],
                      on_line: Callable[[bytes, bytes], None] | None = None,
                      on_settled: Callable[[], None] = lambda: None) -> Deferred[None]:
    """Follow the predecessor's pipe: `protect` lines as they come, its
    `settled` line to `on_settled()` (called at EOF too: nothing more comes),
    any other line to `on_line(word, rest)`; fires at EOF, that is when the
    predecessor has exited."""
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
                    on_protect(parse_protect(line[len(b"protect"):].strip().decode()))
                elif line == SETTLED:
                    on_settled()
                elif on_line is not None:
                    word, _, rest = line.partition(b" ")
                    on_line(word, rest)

        def connectionLost(self, reason: Failure) -> None:
            super().connectionLost(reason)
            os.close(fd)
            on_protect({})
            on_settled()
            if not gone.called:
                gone.callback(None)

    fdesc.setNonBlocking(fd)
    reader = Reader(reactor)
    reader.startReading()
    return gone
