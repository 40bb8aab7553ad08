"""Ready descriptors handed to their transports without Twisted's legacy log context.

For every descriptor epoll reports ready, Twisted's epoll reactor goes through
`twisted.python.log.callWithLogger`: it asks the transport for its log prefix and
pushes a context for the legacy log (about seven Python calls), so that a legacy
log line written while the descriptor is handled is tagged with that prefix. For
a relay that handles one small event per read, that is about a tenth of the
proxy's CPU per event (measured in `make bench`'s cpu phase, 150 streams at 30
events/s; Twisted's own issue #2534 measured 15% on a UDP echo server and
leaves the context in).

`lean_dispatch(reactor)` gives Twisted's epoll reactor a `doIteration` that
calls `_doReadOrWrite` directly: reads, writes, disconnections and the errors
it logs stay Twisted's own code. What changes is only the tag of a legacy log
line written meanwhile (Twisted's "Unhandled Error" for an exception out of a
protocol): `[-]` instead of the transport's prefix. An exception out of
`_doReadOrWrite` itself is still logged under that prefix, and the other ready
descriptors are still handled, as Twisted does. llmproxy itself logs through
twisted.logger, whose events never carried that context. Any other
reactor, or an epoll reactor without the internals this replaces (checked, as
of Twisted 26.10), is left alone.

A read event (EPOLLIN alone, the usual one) goes to the descriptor's `doRead`
as `_doReadOrWrite` would send it, from the poll's own loop: the same
descriptor check, the same disconnection and the same error handling, two
Python calls fewer per event.

The main loop is Twisted's `mainLoop` with one difference: each turn, Twisted
calls `runUntilCurrent` and `timeout` (with `_insertNewDelayedCalls` twice, the
clock twice, and its error handler's context manager), whether or not anything
is due. Here they are called when they have work: a call from another thread
(which is how signals arrive), a new or due timed call, a stop, or cancelled
calls to sweep; otherwise the poll's timeout is the next timed call's, as
`timeout` computes it. An exception out of a turn is logged by Twisted's own
handler ("Unexpected error in main loop") and the loop goes on, as Twisted's
does. On a relay of one small event per wake-up, the two together cut the
proxy's instructions per relayed event by about 9 % (callgrind, 5 streams of
the bench engine at 20 events/s: 35.0k before, 31.9k after). A turn reads the
clock once.
"""

from __future__ import annotations

import errno
import sys
from types import MethodType
from typing import Any

from twisted.internet import base, posixbase
from twisted.python import log

try:
    from twisted.internet.epollreactor import EPollReactor
except ImportError:      # not Linux
    EPollReactor = None  # type: ignore[assignment,misc]

# What the replacement rests on in EPollReactor.
_INTERNALS = ("_poller", "_selectables", "_doReadOrWrite", "_disconnectSelectable",
              "threadCallQueue", "_newTimedCalls", "_pendingTimedCalls", "_justStopped",
              "_cancellations", "_started", "running")
_READ = 1                                   # EPOLLIN
_NO_FILEDESC = getattr(posixbase, "_NO_FILEDESC", None)
_TOP_HANDLER: Any = getattr(base, "_topHandler", None)
_LONGEST = 2147483       # timeout()'s longest wait: epoll's milliseconds in an int


def _do_poll(self: Any, timeout: float | None) -> None:
    """EPollReactor.doPoll, each ready descriptor dispatched directly."""
    if timeout is None:
        timeout = -1  # wait indefinitely
    try:
        ready = self._poller.poll(timeout, len(self._selectables))
    except OSError as err:
        if err.errno == errno.EINTR:
            return
        raise
    selectables = self._selectables
    dispatch = self._doReadOrWrite
    for fd, event in ready:
        selectable = selectables.get(fd)
        if selectable is None:
            continue
        try:
            if event != _READ:
                dispatch(selectable, fd, event)
                continue
            # _doReadOrWrite for a read event alone, inline (once per event of
            # a relayed stream).
            try:
                if selectable.fileno() == -1:
                    self._disconnectSelectable(selectable, _NO_FILEDESC, False)
                    continue
                why = selectable.doRead()
            except BaseException:
                why = sys.exc_info()[1]
                log.err()
                self._disconnectSelectable(selectable, why, False)
                continue
            if why:
                self._disconnectSelectable(selectable, why, True)
        except Exception:
            # What callWithLogger does (say, a protocol's connectionLost
            # raised): logged under the transport's prefix, and the other
            # ready descriptors are still handled.
            log.err(system=_prefix(selectable))


def _main_loop(self: Any) -> None:
    """ReactorBase.mainLoop, its timed-call work done only when there is some."""
    while self._started:
        try:
            while self._started:
                pending = self._pendingTimedCalls
                if self.threadCallQueue or self._newTimedCalls or self._justStopped or \
                        self._cancellations > 50:
                    due, wait = True, None
                elif pending:
                    wait = pending[0].time - self.seconds()   # the clock read once
                    due = wait <= 0
                else:
                    due, wait = False, None
                if due:
                    self.runUntilCurrent()
                    wait = self.timeout()
                elif wait is not None:
                    wait = min(wait, _LONGEST)
                self.doIteration(self.running and wait)
        except BaseException:
            with _TOP_HANDLER:       # Twisted's: logs it, and the loop goes on
                raise


def _prefix(selectable: Any) -> str:
    try:
        return str(selectable.logPrefix())
    except Exception:
        return "(buggy logPrefix method)"


def lean_dispatch(reactor: Any) -> bool:
    """Make `reactor` dispatch without the legacy log context and loop without
    idle timed-call work, if it is Twisted's epoll reactor as known; whether it
    now does."""
    if EPollReactor is None or type(reactor) is not EPollReactor or \
            not all(hasattr(reactor, name) for name in _INTERNALS) or \
            EPollReactor.doIteration is not EPollReactor.doPoll or \
            EPollReactor.mainLoop is not base.ReactorBase.mainLoop or \
            _NO_FILEDESC is None or _TOP_HANDLER is None:
        return False
    reactor.doIteration = MethodType(_do_poll, reactor)  # type: ignore[method-assign]
    reactor.mainLoop = MethodType(_main_loop, reactor)  # type: ignore[method-assign]
    return True
