"""The root service's children: each an `IService` started and stopped by
Twisted's service machinery, in the order the root added them.

    host-locks        privileged start: lock the managed hosts, load the cordons;
                      stop: release this process's copies of the locks
    listener          privileged start: bind (or adopt) the socket; stop: close it
    fleet             once the proxy accepts: the watches and the idle stopper;
                      stop: no switch or idle stop begins from then on
    roster-refresher  once the proxy serves: the rosters re-read every refresh_seconds
    watchdog          WATCHDOG=1 to systemd, from the start until the stop ends

`MultiService` starts them in that order and stops them all at once; the stop
chain (stop.py) stops the fleet and the listener at its own steps first, so
every `stopService` here may be called again and is then a no-op. A child
gated on a Deferred (`begins`) starts its work when that fires, if it still runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmproxy.hosts.cordons import CordonFileError
from llmproxy.hosts.fleet import Fleet
from llmproxy.hosts.locks import LockHeld
from llmproxy.lifecycle.listen import Listener, ListenError
from llmproxy.lifecycle.notify import Watchdog
from llmproxy.lifecycle.signals import refuse_to_start


class HostLocksService(Service):
    """Holds the managed hosts' locks (taken before the reactor runs) and their cordons."""

    name = "host-locks"

    def __init__(self, fleet: Fleet, inherited: Callable[[], Mapping[str, int] | None]) -> None:
        self._fleet = fleet
        self._inherited = inherited

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        try:
            self._fleet.lock(self._inherited())
        except LockHeld as e:        # a restart would not change that: 78
            raise refuse_to_start(str(e)) from None
        except OSError as e:
            raise SystemExit(f"llmproxy: {e}") from None
        try:
            self._fleet.load_cordons()   # cordons outlive reloads, upgrades and restarts
            self._fleet.measured.load()  # so do measured engine memories (never raises)
        except CordonFileError as e:
            raise refuse_to_start(str(e)) from None
        except OSError as e:
            raise SystemExit(f"llmproxy: {e}") from None

    def stopService(self) -> None:
        # Our copies only: a successor that inherited a lock keeps holding it.
        super().stopService()
        self._fleet.release()


class ListenerService(Service):
    """The listening socket: bound before the reactor runs (connections wait in the
    kernel's queue), accepting when the root says, closed when stopped."""

    name = "listener"

    def __init__(self, listener: Listener) -> None:
        self.listener = listener

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        try:
            self.listener.open()
        except (ListenError, OSError) as e:
            raise SystemExit(f"llmproxy: {e}") from None

    def stopService(self) -> Deferred[None]:
        """Fires once this process's copy of the socket is closed."""
        super().stopService()
        return self.listener.stop_accepting()


class FleetService(Service):
    """The fleet's own timers and sessions: every managed host's watch and the idle
    stopper, begun once `begins` fires (the proxy accepts); stopped first of all
    by the stop chain, so no engine switch or idle stop begins during a drain."""

    name = "fleet"

    def __init__(self, fleet: Fleet, begins: Deferred[None],
                 handing_over: Callable[[], bool]) -> None:
        self.fleet = fleet
        self._handing_over = handing_over
        self._closed = False
        begins.addCallback(self._begin)

    def _begin(self, result: None) -> None:
        if self.running:
            self.fleet.start()

    def stopService(self) -> None:
        """Close the hosts: waiting requests go to an upgrade's successor when
        there is one (`handing_over`), else they are served during the drain."""
        super().stopService()
        if not self._closed:
            self._closed = True
            self.fleet.close(handing_over=self._handing_over())


class RosterRefresher(Service):
    """Every host's roster re-read every `period()` seconds on `clock`, the first one
    period after `begins` fires (start-up has just read them)."""

    name = "roster-refresher"
    log = Logger()

    def __init__(self, clock: IReactorTime, read: Callable[[], Deferred[None]],
                 period: Callable[[], float], begins: Deferred[None]) -> None:
        self._loop = LoopingCall(read)
        self._loop.clock = clock
        self._period = period
        begins.addCallback(self._begin)

    @property
    def refreshing(self) -> bool:
        return self._loop.running

    def _begin(self, result: None) -> None:
        if self.running and not self._loop.running:
            self._loop.start(self._period(), now=False).addErrback(
                lambda f: self.log.failure("roster refresh loop ended", f))

    def stopService(self) -> Deferred[Any]:
        """No more refreshes; a read in flight is not waited for (the upstream
        pool's close, last of the stop, ends it)."""
        super().stopService()
        if self._loop.running:
            self._loop.stop()
        return succeed(None)


class WatchdogService(Service):
    """systemd's watchdog pings (notify.Watchdog) while the service runs."""

    name = "watchdog"

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def startService(self) -> None:
        super().startService()
        self.watchdog.start()

    def stopService(self) -> None:
        super().stopService()
        self.watchdog.stop()
