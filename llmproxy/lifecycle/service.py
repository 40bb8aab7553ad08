"""The root service: wires config, rosters, the site and the listener together,
and sequences the start (rosters before the first accept) and the stop (the
chain in drain.py) itself, instead of MultiService's all-at-once."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from twisted.application.service import IService, MultiService
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmproxy.config import Config, ConfigError, load_config
from llmproxy.core.timing import sleep
from llmproxy.hosts.catalog import Catalog
from llmproxy.hosts.fleet import Engines
from llmproxy.hosts.locks import LockHeld
from llmproxy.hosts.roster import RosterFetcher, Rosters, http_fetcher
from llmproxy.lifecycle.listen import Inherited, Listener, ListenError
from llmproxy.lifecycle.notify import INotifier, NullNotifier, Watchdog
from llmproxy.lifecycle.reload import Reloader, ReloadResult
from llmproxy.lifecycle.signals import (
    EXIT_CLEAN,
    EXIT_CUT,
    HARD_DEADLINE_MARGIN,
    HardDeadline,
    SignalLatch,
    exit_now,
    install_stop_signals,
)
from llmproxy.lifecycle.stop import StopBudget, StopChain
from llmproxy.lifecycle.upgrade import (
    Handover,
    UpgradeFailed,
    Upgrader,
    watch_predecessor,
    write_ready,
)
from llmproxy.observe.requests import Exchange, InFlight
from llmproxy.observe.status import status_doc
from llmproxy.web.forward import Forwarder, HTTPClient
from llmproxy.web.site import ProxySite, Root

# How long a stop waits for the first request of a connection accepted just
# before admission stopped (clients send it right after connecting).
FIRST_REQUEST_GRACE = 2.0


class LLMProxyService(MultiService):
    """The proxy. Starts accepting only once every host's roster was read;
    stops by draining under one budget."""

    log = Logger()

    def __init__(self, config: Config, reactor: Any, http: HTTPClient, *,
                 fetch: RosterFetcher | None = None, pool: Any = None,
                 notifier: INotifier | None = None, engines: Engines | None = None,
                 exit: Callable[[int], None] = exit_now,
                 hard_deadline: HardDeadline | None = None,
                 install_signals: Callable[..., None] = install_stop_signals,
                 config_path: str | None = None, hangup: SignalLatch | None = None,
                 environ: dict[str, str] | None = None,
                 inherited: Inherited | None = None, handover: Handover | None = None,
                 upgrade_signal: SignalLatch | None = None, pidfile: str | None = None,
                 disown_pidfile: Callable[[], None] = lambda: None,
                 upgrader: Upgrader | None = None) -> None:
        super().__init__()
        self.config = config
        self._reactor = reactor
        self._pool = pool
        self.notifier: INotifier = notifier or NullNotifier()
        self.engines = engines or Engines(config, reactor, environ or {})
        self._exit = exit
        self._hard_deadline = hard_deadline or HardDeadline(exit)
        self._install_signals = install_signals
        self._started = reactor.seconds()
        self._ready = False
        self.stop_t0: float | None = None   # when the stop began (its budget starts there)
        self.exit_status = EXIT_CLEAN
        self.rosters = Rosters(reactor, fetch or http_fetcher(http),
                               config.roster_timeout_seconds, on_change=self._rebuild)
        self._catalog = Catalog(config, {})
        self.inflight = InFlight(reactor)
        self.forwarder = Forwarder(reactor, http, lambda: self.config.header_timeout_seconds,
                                   lambda: self.engines.managers)
        self.site = ProxySite(Root(self), config.max_body_bytes, reactor)
        self.listener = Listener(reactor, config.listen, self.site, inherited)
        self.startup: Deferred[None] | None = None
        self._refresher = LoopingCall(self._refresh)
        self._refresher.clock = reactor
        self.config_path = config_path
        self._hangup = hangup or SignalLatch()
        self.reloader = Reloader(
            load=self._read_config, current=lambda: self.config, apply=self._apply_config,
            clock=reactor, on_begin=self.notifier.reloading, on_end=self._reload_done,
            engine_models=self._models_on_running_engines)
        self._watchdog = Watchdog(self.notifier, reactor, environ or {}, _pid())
        # Upgrades (SIGUSR1): this process's place in the line of generations.
        self.handover = handover
        self.generation = handover.generation if handover else 1
        self._usr1 = upgrade_signal or SignalLatch(signal.SIGUSR1)
        self._pidfile = pidfile
        self._disown_pidfile = disown_pidfile
        self.upgrader = upgrader or Upgrader(reactor, environ=environ,
                                             timeout=config.upgrade_timeout_seconds)
        self.successor_pid: int | None = None
        self.predecessor_gone: Deferred[None] | None = None

    # -- what the web layer reads -------------------------------------------
    @property
    def catalog(self) -> Catalog:
        return self._catalog

    @property
    def ready(self) -> bool:
        return self._ready

    def status(self) -> dict[str, Any]:
        doc = status_doc(config=self.config, rosters=self.rosters.by_host,
                         inflight=self.inflight, now=self._reactor.seconds(),
                         started=self._started, ready=self._ready,
                         listening=self._listening())
        last = self.reloader.last
        doc["config"] = {"path": self.config_path, "generation": self.reloader.generation,
                         "last_reload": last.as_dict() if last else None}
        doc["stopping"] = self.stop_t0 is not None
        doc["generation"] = self.generation
        doc["predecessor"] = None if self.handover is None else {
            "pid": self.handover.predecessor_pid,
            "draining": not (self.predecessor_gone is not None and self.predecessor_gone.called)}
        doc["successor_pid"] = self.successor_pid
        doc["last_upgrade"] = self.upgrader.last
        engines = self.engines.snapshot(self._reactor.seconds())
        for host in doc["hosts"]:
            host["engine"] = engines.get(host["name"])
        return doc

    def _listening(self) -> str | None:
        bound = self.listener.bound_address()
        if bound is None:
            return None
        host, port = bound
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _rebuild(self) -> None:
        self._catalog = Catalog(self.config, self.rosters.by_host)

    # -- reload --------------------------------------------------------------
    def reload_requested(self) -> Deferred[ReloadResult] | None:
        """SIGHUP (or the admin endpoint): reload unless the proxy is stopping."""
        if self.stop_t0 is not None:
            self.log.info("reload: ignored: the proxy is stopping")
            return None
        return self.reloader.request()

    def _read_config(self) -> Config:
        if self.config_path is None:
            raise ConfigError(["no config file to reload (the service was built from a value)"])
        config = load_config(self.config_path)
        self._hangup.config_read()
        return config

    async def _apply_config(self, new: Config, changes: list[str]) -> None:
        # One assignment each: a request reads `catalog` once, at its start, so it
        # sees either the old catalog or the new one, never a mix.
        self.config = new
        self._rebuild()
        await self.rosters.read_all(new.hosts)

    def _models_on_running_engines(self) -> set[str]:
        """Catalog models whose engine runs now on its managed host."""
        managers = self.engines.managers
        return {name for name, m in self.config.models.items()
                if m.engine is not None and m.host in managers
                and managers[m.host].running == m.engine}

    def _reload_done(self, result: ReloadResult) -> None:
        if self.stop_t0 is None:
            self.notifier.ready(result.message)

    # -- start ---------------------------------------------------------------
    def privilegedStartService(self) -> None:
        # Bound before the reactor runs: a busy port stops twistd with a clear
        # message, and early connections wait in the kernel's queue.
        try:
            self.engines.lock(self.handover.lock_fds if self.handover else None)
            self.listener.open()
        except (ListenError, LockHeld, OSError) as e:
            raise SystemExit(f"llmproxy: {e}") from None
        super().privilegedStartService()

    def startService(self) -> None:
        super().startService()
        # The reactor installs its own SIGTERM/SIGINT handlers as it starts:
        # ours go in after that.
        self._reactor.callWhenRunning(self._install_signals, self._reactor, self.signal_received)
        self._hangup.connect(self._reactor, self.reload_requested)
        self._usr1.connect(self._reactor, self.upgrade_requested)
        self._watchdog.start()
        if self.handover is not None:
            self.predecessor_gone = watch_predecessor(
                self._reactor, self.handover.predecessor_fd, self._predecessor_protects)
        self.startup = Deferred.fromCoroutine(self._start())

    async def _start(self) -> None:
        hosts = self.config.hosts
        self.log.info("reading the rosters of {n} host(s)", n=len(hosts))
        # Both before the first accept: what each host serves, and which engine
        # runs on each managed host (adopted as it is, never restarted).
        await DeferredList([self.rosters.read_all(hosts), self.engines.adopt()])
        if self.stop_t0 is not None or not self.running:
            return
        self.listener.start_accepting()
        self._ready = True
        failed = [h.name for h in hosts if self.rosters.by_host.get(h.name) is None
                  or self.rosters.by_host[h.name].generation == 0]
        summary = (f"{len(self._catalog.routes())} model name(s) from "
                   f"{len(hosts) - len(failed)} of {len(hosts)} host(s)")
        self.log.info("ready: listening on http://{address} ({origin}), {summary}{failed}",
                      address=self._listening(), origin=self.listener.origin, summary=summary,
                      failed=f" (no roster from {', '.join(failed)})" if failed else "")
        if self.handover is not None:
            # The predecessor tells systemd (MAINPID=us, READY=1) once it hears this.
            write_ready(self.handover.ready_fd)
            self.log.info("upgrade: generation {generation} ready; predecessor pid {pid} "
                          "stops accepting and drains", generation=self.generation,
                          pid=self.handover.predecessor_pid)
        else:
            self.notifier.ready(f"ready: {summary}")
        # Start-up has just read them: the first refresh is one period away.
        self._refresher.start(self.config.refresh_seconds, now=False)
        self.engines.start()

    def _refresh(self) -> Deferred[None]:
        return self.rosters.read_all(self.config.hosts)

    # -- upgrade ---------------------------------------------------------------
    def upgrade_requested(self) -> None:
        """SIGUSR1: start the installed code as a successor; hand over when ready."""
        reason = ("the proxy is stopping" if self.stop_t0 is not None else
                  "an upgrade is in progress" if self.upgrader.in_progress else
                  "still starting" if not self._ready or self.listener.port is None else None)
        if reason:
            self.log.info("upgrade: ignored SIGUSR1: {reason}", reason=reason)
            return
        Deferred.fromCoroutine(self._upgrade())

    async def _upgrade(self) -> None:
        assert self.listener.port is not None
        # twistd's pid file check would refuse the candidate while we hold it.
        removed = self._release_pidfile()
        try:
            pid = await self.upgrader.upgrade(
                generation=self.generation, listen_fd=self.listener.fileno(),
                lock_fds=self.engines.lock_fds(), pidfile=self._pidfile)
        except UpgradeFailed as e:
            self.log.warn("upgrade: failed, this process keeps serving: {reason}", reason=e)
            if removed:
                self._write_pidfile()
            return
        self.successor_pid = pid
        # The successor accepts from now on; we stop at once, before telling
        # systemd, so no new connection lands on the process that is leaving.
        await self.listener.stop_accepting()
        self._disown_pidfile()
        self.notifier.hand_over(pid, f"upgraded: pid {pid} serves generation "
                                     f"{self.generation + 1}")
        self.log.info("upgrade: handed over to pid {pid} (generation {generation}); this "
                      "process stops accepting, drains and exits", pid=pid,
                      generation=self.generation + 1)
        # Until we exit, the successor must not switch or stop the engines our
        # streams use: tell it which, as they change.
        protect = LoopingCall(lambda: self.upgrader.protect(
            Engines.in_use(self.inflight.active.values())))
        protect.clock = self._reactor
        protect.start(0.25)
        self.stop_t0 = self._reactor.seconds()
        self._hard_deadline.arm(self._budget().total + HARD_DEADLINE_MARGIN)
        self._reactor.stop()

    def _release_pidfile(self) -> bool:
        if not self._pidfile:
            return False
        try:
            os.unlink(self._pidfile)
        except OSError:
            return False
        return True

    def _write_pidfile(self) -> None:
        if self._pidfile:
            with open(self._pidfile, "w") as f:
                f.write(f"{os.getpid()}\n")

    def _predecessor_protects(self, engines: dict[str, str]) -> None:
        self.engines.protect(engines)

    # -- stop ----------------------------------------------------------------
    def signal_received(self, signum: int) -> None:
        """SIGTERM/SIGINT, on the reactor thread: the first stops gracefully,
        a second one exits at once."""
        name = signal.Signals(signum).name
        if self.stop_t0 is None:
            self.stop_t0 = self._reactor.seconds()
            self.log.info("received {signal}: stopping gracefully", signal=name)
            self._hard_deadline.arm(self._budget().total + HARD_DEADLINE_MARGIN)
            self._reactor.stop()   # twistd's shutdown runs stopService, the chain
            return
        status = 128 + signum
        self.log.warn("received {signal} again during the stop: exiting now with status "
                      "{status}, cutting {n} request(s) in flight",
                      signal=name, status=status, n=len(self.inflight.active))
        self._exit(status)

    def _budget(self) -> StopBudget:
        return StopBudget(prestop=self.config.prestop_seconds, drain=self.config.drain_seconds)

    def stopService(self) -> Deferred[None]:
        if self.stop_t0 is None:
            self.stop_t0 = self._reactor.seconds()
        return Deferred.fromCoroutine(self._stop(self.stop_t0))

    async def _stop(self, t0: float) -> None:
        result = await StopChain(self._reactor, self._budget(), self).run(t0)
        self.exit_status = EXIT_CLEAN if result.clean else EXIT_CUT
        self._hard_deadline.disarm()
        self._watchdog.stop()

    # Stoppable, for the chain:
    def stop_readiness(self) -> None:
        self._ready = False
        self.engines.close()
        self.notifier.stopping(f"stopping: {len(self.inflight.active)} request(s) in flight")

    def stop_admission(self) -> Deferred[None]:
        if self.startup is not None and not self.startup.called:
            self.startup.cancel()
        closed = self.site.start_closing()
        if closed:
            self.log.info("closed {n} idle connection(s)", n=closed)
        return self.listener.stop_accepting()

    def engine_operations(self) -> Sequence[Deferred[Any]]:
        return self.engines.operations()

    def in_flight(self) -> Sequence[Exchange]:
        return list(self.inflight.active.values())

    def drained(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._drained())

    async def _drained(self) -> None:
        # A connection accepted just before admission stopped may not have
        # delivered its request yet: give it FIRST_REQUEST_GRACE to arrive
        # (it is then served and drained like any other), then close it.
        grace_end = self._reactor.seconds() + FIRST_REQUEST_GRACE
        while True:
            await self.inflight.idle()
            if not self.site.unserved() or self._reactor.seconds() >= grace_end:
                break
            await sleep(self._reactor, min(0.05, grace_end - self._reactor.seconds()))
        for channel in self.site.unserved():
            channel.loseConnection()

    def predecessor_exit(self) -> tuple[int, Deferred[None]] | None:
        if self.handover is None or self.predecessor_gone is None or self.predecessor_gone.called:
            return None
        return self.handover.predecessor_pid, self.predecessor_gone

    def drain_progress(self, remaining: int, seconds_left: float) -> None:
        self.notifier.status(f"draining: {remaining} request(s) in flight, "
                             f"{seconds_left:.0f}s left")

    def stop_services(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._stop_services())

    async def _stop_services(self) -> None:
        if self._refresher.running:
            self._refresher.stop()
        await super().stopService()
        if self._pool is not None:
            await self._pool.closeCachedConnections()
        # Our copies only: a successor that inherited a lock keeps holding it.
        self.engines.release()


def _pid() -> int:
    return os.getpid()


def _quiet_pool_class() -> Any:
    from twisted.web.client import HTTPConnectionPool, _HTTP11ClientFactory

    class QuietFactory(_HTTP11ClientFactory):
        noisy = False  # no "Starting factory" line per upstream connection

    class QuietPool(HTTPConnectionPool):
        _factory = QuietFactory

    return QuietPool


def build_service(config: Config, reactor: Any, extra: list[IService] | None = None,
                  notifier: INotifier | None = None, config_path: str | None = None,
                  hangup: SignalLatch | None = None,
                  environ: dict[str, str] | None = None,
                  inherited: Inherited | None = None, **upgrade: Any) -> LLMProxyService:
    """The whole proxy as one service, on the given reactor and real HTTP client."""
    from http.cookiejar import DefaultCookiePolicy

    from treq.client import HTTPClient as TreqClient
    from treq.cookies import IndexableCookieJar
    from twisted.web.client import Agent

    pool = _quiet_pool_class()(reactor, persistent=True)
    pool.maxPersistentPerHost = 16
    # Below llama-server's 5 s keep-alive: a POST on a connection the engine has
    # just closed is not retried by the Agent.
    pool.cachedConnectionTimeout = 3
    agent = Agent(reactor, connectTimeout=config.connect_timeout_seconds, pool=pool)
    # Cookies an engine sets must never travel to another client's request.
    no_cookies = IndexableCookieJar(DefaultCookiePolicy(allowed_domains=[]))
    service = LLMProxyService(config, reactor, TreqClient(agent, cookiejar=no_cookies),
                              pool=pool, notifier=notifier, config_path=config_path,
                              hangup=hangup, environ=environ, inherited=inherited, **upgrade)
    for child in extra or []:
        child.setServiceParent(service)
    return service
