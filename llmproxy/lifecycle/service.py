"""The root service: wires the parts and orders start and stop, nothing more.

Its children (children.py) are started by Twisted's service machinery in the
order added: the host locks and the listening socket (privileged, before the
reactor runs; connections wait in the kernel's queue), the fleet, the roster
refresher, the watchdog. Start: read every roster and adopt the running engines
-> accept -> ready (to systemd, or to the predecessor of an upgrade) -> the
fleet's watches and idle stops and the periodic roster reads begin. A standby
(`--standby`) reads the rosters, accepts (answering /healthz, /readyz 503
`standby`, no model request), and waits for every managed host's lease
(hosts/lease.py), adopting each host's engines as it takes the lease; then ready.

Stop: the chain in `stop`, under one budget from the signal; this service is
its `Stoppable` and stops its children at the chain's steps: the fleet with
readiness, the listener with admission, the rest at the end. The web sees the
proxy through its own facade (webapp.py). What each part does lives in that
part; what happened is published to the hub, where the log and every other
view subscribe.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import Any

from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.logger import ILogObserver, Logger

from llmproxy.core.clockwaits import within
from llmproxy.core.events import Ready, StopStage
from llmproxy.core.reactors import IServiceReactor
from llmproxy.hosts.catalog import Catalog
from llmproxy.lifecycle.children import (
    FleetService,
    HostLocksService,
    ListenerService,
    RosterRefresher,
    WatchdogService,
)
from llmproxy.lifecycle.components import Parts
from llmproxy.lifecycle.front import front_door
from llmproxy.lifecycle.keysfile import access_status, reloadable_parts
from llmproxy.lifecycle.notify import Watchdog
from llmproxy.lifecycle.reload import Reloader, ReloadResult
from llmproxy.lifecycle.signals import (
    EXIT_CLEAN,
    EXIT_CUT,
    HARD_DEADLINE_MARGIN,
)
from llmproxy.lifecycle.stop import StopBudget, StopChain
from llmproxy.lifecycle.webapp import WebApp
from llmproxy.observe.fastpaths import log_report
from llmproxy.observe.inflight import Exchange
from llmproxy.observe.status import StatusView, status_doc
from llmproxy.web.energybudget import WORD as BUDGET_WORD

# How long a stop waits for the first request of a connection accepted just
# before admission stopped (clients send it right after connecting).
FIRST_REQUEST_GRACE = 2.0
# How long the end of a stop waits for closed connections to flush and go.
CLOSE_WAIT = 2.0


class LLMProxyService(MultiService):
    """The proxy. Accepts only once every roster was read; stops by draining."""

    log = Logger()
    # Set by tap.py: twistd takes its log observer from the application, after
    # the root service joined it (see logtext.py).
    log_observer: ILogObserver | None = None

    def setServiceParent(self, parent: Any) -> None:
        if self.log_observer is not None and hasattr(parent, "setComponent"):
            parent.setComponent(ILogObserver, self.log_observer)
        super().setServiceParent(parent)

    def __init__(self, reactor: IServiceReactor, parts: Parts) -> None:
        super().__init__()
        self._reactor = reactor
        self.clock: IReactorTime = reactor
        self.parts = parts
        self.runtime, self.fleet, self.inflight = parts.runtime, parts.fleet, parts.inflight
        self.forwarder, self.upgrade, self.notifier = parts.forwarder, parts.upgrade, parts.notifier
        self.events, self.metrics, self.access = parts.events, parts.metrics, parts.access
        self.site, self.listener = front_door(parts, reactor, WebApp(parts, reactor, self))
        self.reloader = Reloader(
            load=self.runtime.read_config, current=lambda: self.runtime.config,
            apply=self.runtime.apply, clock=reactor, on_begin=self.notifier.reloading,
            on_end=self._reload_done, publish=parts.hub.publish,
            engine_models=lambda: self.runtime.models_on_running_engines(self.fleet),
            parts=reloadable_parts(parts))
        self._add_children(parts)
        self._started = reactor.seconds()
        self._ready = False
        self.stop_t0: float | None = None   # when the stop began (its budget starts there)
        self.exit_status = EXIT_CLEAN
        self.startup: Deferred[None] | None = None
        self._reload_after_start: Deferred[ReloadResult] | None = None
        self._signals = 0

    def _add_children(self, parts: Parts) -> None:
        """The child services, in the order they start (see children.py); the fleet
        begins once the proxy accepts, the roster refresher once it serves."""
        self._accepting: Deferred[None] = Deferred()
        self._serving: Deferred[None] = Deferred()
        handover = self.upgrade.handover
        HostLocksService(self.fleet, lambda: handover.lock_fds if handover else None
                         ).setServiceParent(self)
        self._listening = ListenerService(self.listener)
        self._listening.setServiceParent(self)
        self._fleet = FleetService(self.fleet, self._accepting,
                                   lambda: self.upgrade.successor_url is not None)
        self._fleet.setServiceParent(self)
        self._refresher = RosterRefresher(self._reactor, self.runtime.read_rosters,
                                          lambda: self.runtime.config.refresh_seconds,
                                          self._serving)
        self._refresher.setServiceParent(self)
        WatchdogService(Watchdog(self.notifier, self._reactor, parts.process.environ,
                                 os.getpid)).setServiceParent(self)
        if parts.tracing is not None:       # its stop sends the spans still queued
            parts.tracing.service(self._reactor).setServiceParent(self)

    # -- what the web layer asks (through webapp.WebApp) -----------------------
    @property
    def catalog(self) -> Catalog:
        return self.runtime.catalog

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def standby(self) -> bool:
        """Whether this proxy waits, as a standby, for the hosts' leases."""
        return self.fleet.leases.standby

    @property
    def state(self) -> str:
        """starting, standby, ready, reloading, upgrading or draining."""
        return ("draining" if self.stop_t0 is not None else
                "standby" if self.standby else
                "starting" if not self._ready else
                "upgrading" if self.upgrade.in_progress else
                "reloading" if self.reloader.busy else "ready")

    def status(self) -> dict[str, Any]:
        now = self._reactor.seconds()
        last = self.reloader.last
        doc = status_doc(StatusView(
            state=self.state, events=self.events, config=self.runtime.config,
            rosters=self.runtime.rosters.by_host, inflight=self.inflight, now=now,
            started=self._started, ready=self._ready, listening=self.listener.address(),
            engines=self.fleet.snapshot(now), capacity=self.fleet.capacity(now),
            queues=None if self.parts.queues is None else {
                name: self.parts.queues.queue(gate) for name, gate in self.fleet.gates.items()},
            models=self.catalog.placement(),
            config_state={"path": self.runtime.path, "generation": self.reloader.generation,
                          "last_reload": last.as_dict() if last else None},
            stopping=self.stop_t0 is not None, upgrade=self.upgrade.status()))
        return doc | access_status(self.access, self.parts.key_usage, now) | {
            "standby": self.standby, "waiting_for": self.fleet.leases.waiting_for()
            if self.standby else {},
            "speedups": self.parts.speedups.as_json(), "compat": self.parts.compat.as_json(),
            "energy": None if self.parts.energy is None else self.parts.energy.snapshot()}

    def reload(self) -> Deferred[ReloadResult] | None:
        """SIGHUP (or the admin endpoint): reload unless the proxy is stopping. One
        that arrives during start-up is folded into it: it runs (reading the file
        again) once the proxy serves, so nothing tells systemd RELOADING=1 or
        READY=1 before the first READY=1."""
        if self.stop_t0 is not None:
            self.log.info("reload: ignored: the proxy is stopping")
            return None
        if not self._ready:
            if self._reload_after_start is None:
                self.log.info("reload: requested during start-up: it runs once the proxy "
                              "serves")
                self._reload_after_start = Deferred()
            return self._reload_after_start
        return self.reloader.request()

    def _reload_done(self, result: ReloadResult) -> None:
        if self.stop_t0 is None:
            self.notifier.ready(result.message)

    # -- start ---------------------------------------------------------------
    def privilegedStartService(self) -> None:
        # The children lock the hosts and bind before the reactor runs: a busy
        # port stops twistd with a clear message, and early connections wait in
        # the kernel's queue.
        self.parts.process.raise_open_files()
        super().privilegedStartService()
        self._warn_if_listen_differs()

    def _warn_if_listen_differs(self) -> None:
        listen = self.runtime.config.listen
        if self.parts.inherited is None or listen.port == 0:
            return
        configured = str(listen)
        bound = self.listener.address()
        if bound is not None and bound != configured:
            self.log.warn("listen: the config says {configured} but the inherited socket is "
                          "{bound}: serving {bound} (change the socket unit to move it)",
                          configured=configured, bound=bound)

    def startService(self) -> None:
        super().startService()
        process = self.parts.process
        # The reactor installs its own SIGTERM/SIGINT handlers as it starts:
        # ours go in after that.
        self._reactor.callWhenRunning(process.install_signals, self._reactor,
                                      self.signal_received)
        process.hangup.connect(self._reactor, self.reload)
        process.upgrade_signal.connect(self._reactor, self.upgrade_requested)
        self.upgrade.follow_predecessor(self.fleet.protect, self._from_predecessor,
                                        self.access.inherit())
        self.startup = Deferred.fromCoroutine(self._start())

    async def _start(self) -> None:
        hosts = self.runtime.config.hosts
        log_report("speedups", self.parts.speedups.as_json())
        log_report("compat", self.parts.compat.as_json())
        self.log.info("reading the rosters of {n} host(s)", n=len(hosts))
        # Both before the first accept: what each host serves, and which engine
        # runs on each managed host (adopted as it is, never restarted).
        await DeferredList([self.runtime.read_rosters()] + (
            [] if self.standby else [self.fleet.adopt()]))
        if self.stop_t0 is not None or not self.running:
            return
        if self.standby:
            await self._wait_as_standby()
            if self.stop_t0 is not None or not self.running:
                return
        self.fleet.preload()     # not awaited: requests queue behind it
        self.parts.process.settle_heap()    # before the first request (gcfreeze.py)
        if self.listener.port is None:
            self.listener.start_accepting()
        self._ready = True
        failed = self.runtime.failed_hosts()
        summary = (f"{len(self.catalog.routes())} model name(s) from "
                   f"{len(hosts) - len(failed)} of {len(hosts)} host(s)")
        self.parts.hub.publish(Ready(self._reactor.seconds(), self.listener.address(),
                                     self.listener.origin, summary, tuple(failed),
                                     self.upgrade.generation, self.listener.scheme))
        if not self.upgrade.serving():     # else the predecessor tells systemd
            self.notifier.ready(f"ready: {summary}")
        pending, self._reload_after_start = self._reload_after_start, None
        if pending is not None:
            self.reloader.request().chainDeferred(pending)
        # Start-up has just read them: the first refresh is one period away.
        _fire(self._serving)
        _fire(self._accepting)

    async def _wait_as_standby(self) -> None:
        """Accept (health checks, 503 `standby` to the rest), watch every managed host,
        and wait until this proxy holds every lease and adopted what runs there."""
        self.listener.start_accepting()
        _fire(self._accepting)
        waiting = "; ".join(f"{h}: {w}" for h, w in self.fleet.leases.waiting_for().items())
        self.log.info("standby: waiting for the lease of every managed host ({waiting})",
                      waiting=waiting or "none")
        self.notifier.status(f"standby: waiting for the hosts' leases ({waiting})")
        await self.fleet.leases.taken()
        self.fleet.leases.took_over()
        self.log.info("standby: holding every managed host's lease: taking over")

    # -- upgrade and stop ------------------------------------------------------------
    def upgrade_requested(self) -> Deferred[dict[str, Any]]:
        """SIGUSR1 (or the admin endpoint): start the installed code as a successor;
        hand over when ready. Fires with the upgrade's outcome."""
        refusal = ("the proxy is stopping" if self.stop_t0 is not None else
                   "still starting" if not self._ready or self.listener.port is None else None)
        if refusal:
            return self.upgrade.start(refusal, listen_fd=-1, successor_url=None, lock_fds={},
                                      hand_over=self._hand_over)
        return self.upgrade.start(None, listen_fd=self.listener.fileno(),
                                  successor_url=self.listener.loopback_url(),
                                  lock_fds=self.fleet.lock_fds(), hand_over=self._hand_over)

    async def _hand_over(self, pid: int) -> None:
        # The successor accepts from now on; we stop at once, before telling
        # systemd, so no new connection lands on the process that is leaving.
        # Requests still waiting here for an engine switch go to it (same socket).
        url = self.upgrade.successor_url
        if url is not None and self.parts.upstream_tls is not None:
            self.parts.upstream_tls.trust_own_socket(url)
        await self._listening.stopService()
        if self.access.limits is not None:    # the successor counts on from here
            self.access.limits.forward_to(self.upgrade.tell_successor)
        if self.access.energy is not None:
            self.access.energy.forward_to(self.upgrade.tell_successor)
        self.notifier.hand_over(pid, f"upgraded: pid {pid} serves generation "
                                     f"{self.upgrade.generation + 1}")
        self._begin_stop()

    def _from_predecessor(self, word: bytes, rest: bytes) -> None:
        """A line of the predecessor's besides `protect`: its rate-limit and energy state."""
        if word == b"ratelimit" and self.access.limits is not None:
            self.access.limits.take(rest)
        elif word == BUDGET_WORD and self.access.energy is not None:
            self.access.energy.take(rest)

    def signal_received(self, signum: int) -> None:
        """SIGTERM/SIGINT, on the reactor thread: the first stops gracefully,
        a second one exits at once."""
        name = signal.Signals(signum).name
        self._signals += 1
        if self._signals == 1:
            # A process draining after an upgrade takes its first signal as a
            # first one (Ctrl-C in a terminal reaches both generations).
            self.parts.hub.publish(StopStage(self._reactor.seconds(), "signal", reason=name))
            if self.stop_t0 is None:
                self._begin_stop()
            return
        status = 128 + signum
        killed = self.fleet.kill_agent_calls()
        self.log.warn("received {signal} again during the stop: exiting now with status "
                      "{status}, cutting {n} request(s) in flight{calls}",
                      signal=name, status=status, n=len(self.inflight.active),
                      calls=f", killing {killed} ssh call(s)" if killed else "")
        self.parts.process.exit(status)

    def _begin_stop(self) -> None:
        self.stop_t0 = self._reactor.seconds()
        self.parts.process.hard_deadline.arm(self._budget().total + HARD_DEADLINE_MARGIN)
        self._reactor.stop()   # twistd's shutdown runs stopService, the chain

    def _budget(self) -> StopBudget:
        config = self.runtime.config
        return StopBudget(prestop=config.prestop_seconds, drain=config.drain_seconds)

    def stopService(self) -> Deferred[None]:
        if self.stop_t0 is None:
            self.stop_t0 = self._reactor.seconds()
        return Deferred.fromCoroutine(self._stop(self.stop_t0))

    async def _stop(self, t0: float) -> None:
        chain = StopChain(self._reactor, self._budget(), self, self.parts.hub)
        result = await chain.run(t0)
        self.exit_status = EXIT_CLEAN if result.clean else EXIT_CUT
        self.parts.process.hard_deadline.disarm()

    # -- Stoppable, for the chain ------------------------------------------------
    def stop_readiness(self) -> None:
        self._ready = False
        # No switch or idle stop from now on; after an upgrade's hand-over, what
        # waits here goes to the successor.
        self._fleet.stopService()
        self.notifier.stopping(f"stopping: {len(self.inflight.active)} request(s) in flight")

    def stop_admission(self) -> Deferred[None]:
        if self.startup is not None and not self.startup.called:
            self.startup.cancel()
        closed = self.site.start_closing()
        if closed:
            self.log.info("closed {n} idle connection(s)", n=closed)
        stopped: Deferred[None] = self._listening.stopService()
        return stopped

    def engine_operations(self) -> Sequence[Deferred[Any]]:
        return self.fleet.operations()

    def in_flight(self) -> Sequence[Exchange]:
        return list(self.inflight.active.values())

    def drained(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self.site.drained(self.inflight.idle, FIRST_REQUEST_GRACE))

    def predecessor_exit(self) -> tuple[int, Deferred[None]] | None:
        return self.upgrade.predecessor_exit()

    def drain_progress(self, remaining: int, seconds_left: float) -> None:
        self.notifier.status(f"draining: {remaining} request(s) in flight, "
                             f"{seconds_left:.0f}s left")

    def stop_services(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._stop_services())

    async def _stop_services(self) -> None:
        self._refresher.stopService()
        # Every connection was asked to close (idle ones, event streams, the
        # rest after their response): let their last bytes reach the clients.
        if not await self.site.closed(CLOSE_WAIT):
            self.log.info("{n} connection(s) still open at exit",
                          n=len(self.site.channels) + len(self.site.multiplexed))
        if self.parts.captures is not None:   # captures still being packed, kept
            await within(self._reactor, self.parts.captures.settled(), CLOSE_WAIT)
        await super().stopService()   # the children left: host locks, watchdog, demo engines
        self.forwarder.stop()
        if self.parts.pool is not None:
            await self.parts.pool.closeCachedConnections()


def _fire(gate: Deferred[None]) -> None:
    if not gate.called:
        gate.callback(None)
