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
"""

from __future__ import annotations

import errno
from types import MethodType
from typing import Any

from twisted.python import log

try:
    from twisted.internet.epollreactor import EPollReactor
except ImportError:      # not Linux
    EPollReactor = None  # type: ignore[assignment,misc]

# What the replacement rests on in EPollReactor.
_INTERNALS = ("_poller", "_selectables", "_doReadOrWrite")


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
        if selectable is not None:
            try:
                dispatch(selectable, fd, event)
            except Exception:
                # What callWithLogger does (say, a protocol's connectionLost
                # raised): logged under the transport's prefix, and the other
                # ready descriptors are still handled.
                log.err(system=_prefix(selectable))


def _prefix(selectable: Any) -> str:
    try:
        return str(selectable.logPrefix())
    except Exception:
        return "(buggy logPrefix method)"


def lean_dispatch(reactor: Any) -> bool:
    """Make `reactor` dispatch without the legacy log context, if it is Twisted's
    epoll reactor as known; whether it now does."""
    if EPollReactor is None or type(reactor) is not EPollReactor or \
            not all(hasattr(reactor, name) for name in _INTERNALS) or \
            EPollReactor.doIteration is not EPollReactor.doPoll:
        return False
    reactor.doIteration = MethodType(_do_poll, reactor)  # type: ignore[method-assign]
    return True
