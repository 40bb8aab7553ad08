"""Open files: the process's limit, raised at start, and a listening port that
survives running out of file descriptors.

A systemd service starts with a soft RLIMIT_NOFILE of 1024, while every stream
takes two descriptors (the client's and the engine's): `raise_open_files`
lifts the soft limit to the hard one (`LimitNOFILE=` in the unit sets that).

When accept() still fails for want of descriptors (EMFILE, ENFILE), Twisted's
accept loop closes the connections waiting in the queue. `GuardedPort` instead
stops accepting for RETRY_SECONDS (the connections wait in the kernel's queue,
the ones open are served on), and logs once per burst: when it begins, and when
accepting has run a while without a failure. It hears of the failure through
compat/acceptguard.py (Twisted has no public hook); with that entry off, the
port is Twisted's own.
"""

from __future__ import annotations

import errno
import resource
import socket
from collections.abc import Callable
from typing import Any, cast

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import ServerFactory
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmproxy.compat.acceptguard import WatchedPort, adopt_watched

log = Logger()

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


class GuardedPort(WatchedPort):
    """A TCP port on an adopted listening socket that pauses accepting, with one
    log line per burst, when the process is out of file descriptors.

    A burst: from the first failed accept() until accepting has run for a whole
    RETRY_SECONDS without one. Meanwhile the port reads the listening socket
    again every RETRY_SECONDS, and stops at each failure."""

    retry_seconds = RETRY_SECONDS
    burst_began: float | None = None
    failures = 0
    failed = False        # since the last tick
    tick: IDelayedCall | None = None

    @property
    def clock(self) -> IReactorTime:
        return cast(IReactorTime, self.reactor)

    def short_of_descriptors(self, code: int) -> None:
        """accept() failed with `code` (EMFILE...): stop accepting until the next tick."""
        self.failures += 1
        self.failed = True
        self.stopReading()
        if self.burst_began is None:
            self.burst_began = self.clock.seconds()
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.warn("open files: accept() failed with {name} ({why}; soft limit {soft}): "
                     "new connections wait in the listen queue, the open ones are served; "
                     "retrying every {retry}s", name=errno.errorcode.get(code, str(code)),
                     why=_why(code), soft=_shown(soft), retry=self.retry_seconds)
            self.tick = self.clock.callLater(self.retry_seconds, self.next_tick)

    def next_tick(self) -> None:
        if not self.failed and self.burst_began is not None:
            log.info("open files: accepting again; {n} accept() failure(s) over {s:.1f}s",
                     n=self.failures, s=self.clock.seconds() - self.burst_began)
            self.burst_began, self.failures, self.tick = None, 0, None
            return
        self.failed = False
        if self.connected and not self.disconnecting:
            self.startReading()
        self.tick = self.clock.callLater(self.retry_seconds, self.next_tick)

    def connectionLost(self, reason: Failure) -> None:
        if self.tick is not None and self.tick.active():
            self.tick.cancel()
        self.tick = None
        super().connectionLost(reason)


def _why(code: int) -> str:
    return {errno.EMFILE: "this process's open files are at its limit",
            errno.ENFILE: "the system's open files are at its limit"}.get(code, "no memory")


def adopt(reactor: Any, fd: int, family: socket.AddressFamily,
          factory: ServerFactory[Any], guarded: bool) -> Any:
    """The listening port on `fd` (duplicated, as `adoptStreamPort` does): a
    GuardedPort when the compat entry `accept_guard` is on, else Twisted's own."""
    if guarded:
        return adopt_watched(GuardedPort, reactor, fd, family, factory)
    return reactor.adoptStreamPort(fd, family, factory)
