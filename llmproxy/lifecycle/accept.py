"""Open files: the process's limit, raised at start, and a listening port that
survives running out of file descriptors.

A systemd service starts with a soft RLIMIT_NOFILE of 1024, while every stream
takes two descriptors (the client's and the engine's): `raise_open_files`
lifts the soft limit to the hard one (`LimitNOFILE=` in the unit sets that).

When accept() still fails for want of descriptors (EMFILE, ENFILE), Twisted's
accept loop ends the round and logs a line per failure, and since the
listening socket stays readable the reactor calls it again at once: a busy
loop and a flood of lines. `GuardedPort` instead stops accepting for
RETRY_SECONDS (the connections wait in the kernel's queue, the ones open are
served on), and logs once per burst: when it begins, and when accepting has
run a while without a failure.
"""

from __future__ import annotations

import errno
import resource
import socket
from collections.abc import Callable
from typing import Any, cast

from twisted.internet import tcp
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import ServerFactory
from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger()

SHORT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
RETRY_SECONDS = 0.5

Limits = tuple[int, int]


def raise_open_files(getrlimit: Callable[[int], Limits] = resource.getrlimit,
                     setrlimit: Callable[[int, Limits], None] = resource.setrlimit) -> Limits:
    """Raise the soft limit of open files to the hard limit and log the figure;
    returns the (soft, hard) limits in force."""
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        log.info("open files: soft limit {soft} (the hard limit)", soft=_shown(soft))
        return soft, hard
    try:
        setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        log.warn("open files: soft limit {soft}, could not raise it to {hard}: {e}",
                 soft=_shown(soft), hard=_shown(hard), e=e)
        return soft, hard
    log.info("open files: soft limit raised from {soft} to {hard}", soft=_shown(soft),
             hard=_shown(hard))
    return hard, hard


def _shown(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


class _WatchedSocket(socket.socket):
    """The listening socket: an accept() that fails for want of descriptors is
    reported to the port and ends Twisted's accept round quietly, as if the
    queue were empty."""

    port: GuardedPort

    def accept(self) -> tuple[socket.socket, Any]:
        try:
            return super().accept()
        except BlockingIOError:
            raise
        except OSError as e:
            if e.errno not in SHORT_OF_DESCRIPTORS:
                raise
            self.port.short_of_descriptors(e.errno)
            raise BlockingIOError(errno.EAGAIN, "accepting paused") from None


class GuardedPort(tcp.Port):
    """A TCP port on an adopted listening socket that pauses accepting, with one
    log line per burst, when the process is out of file descriptors.

    A burst: from the first failed accept() until accepting has run for a whole
    RETRY_SECONDS without one. Meanwhile the port reads the listening socket
    again every RETRY_SECONDS, and stops at each failure."""

    retry_seconds = RETRY_SECONDS
    _burst_began: float | None = None
    _failures = 0
    _failed = False        # since the last tick
    _tick: IDelayedCall | None = None

    def startListening(self) -> None:
        adopted = self._preexistingSocket
        if adopted is not None:
            watched = _WatchedSocket(adopted.family, adopted.type, adopted.proto,
                                     fileno=adopted.detach())
            watched.setblocking(False)
            watched.port = self
            self._preexistingSocket = watched
        super().startListening()

    @property
    def _clock(self) -> IReactorTime:
        return cast(IReactorTime, self.reactor)

    def short_of_descriptors(self, code: int) -> None:
        """accept() failed with `code` (EMFILE...): stop accepting until the next tick."""
        self._failures += 1
        self._failed = True
        self.stopReading()
        if self._burst_began is None:
            self._burst_began = self._clock.seconds()
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.warn("open files: accept() failed with {name} ({why}; soft limit {soft}): "
                     "new connections wait in the listen queue, the open ones are served; "
                     "retrying every {retry}s", name=errno.errorcode.get(code, str(code)),
                     why=_why(code), soft=_shown(soft), retry=self.retry_seconds)
            self._tick = self._clock.callLater(self.retry_seconds, self._next_tick)

    def _next_tick(self) -> None:
        if not self._failed and self._burst_began is not None:
            log.info("open files: accepting again; {n} accept() failure(s) over {s:.1f}s",
                     n=self._failures, s=self._clock.seconds() - self._burst_began)
            self._burst_began, self._failures, self._tick = None, 0, None
            return
        self._failed = False
        if self.connected and not self.disconnecting:
            self.startReading()
        self._tick = self._clock.callLater(self.retry_seconds, self._next_tick)

    def connectionLost(self, reason: Failure) -> None:
        if self._tick is not None and self._tick.active():
            self._tick.cancel()
        self._tick = None
        super().connectionLost(reason)


def _why(code: int) -> str:
    return {errno.EMFILE: "this process's open files are at its limit",
            errno.ENFILE: "the system's open files are at its limit"}.get(code, "no memory")


def adopt_guarded(reactor: Any, fd: int, family: socket.AddressFamily,
                  factory: ServerFactory[Any]) -> GuardedPort:
    """What `reactor.adoptStreamPort` does, with a GuardedPort (Twisted's own
    constructor for an adopted socket; the fd is duplicated, as there)."""
    port: GuardedPort = GuardedPort._fromListeningDescriptor(reactor, fd, family, factory)
    port.startListening()
    return port
