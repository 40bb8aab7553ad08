"""The root service: wires config, rosters, the site and the listener together."""

from __future__ import annotations

from typing import Any

from twisted.application.service import IService, MultiService
from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmproxy.catalog import Catalog
from llmproxy.config import Config
from llmproxy.inflight import InFlight
from llmproxy.listen import Listener, ListenError
from llmproxy.proxy import Forwarder, HTTPClient
from llmproxy.roster import RosterFetcher, Rosters, http_fetcher
from llmproxy.status import status_doc
from llmproxy.web import ProxySite, Root


class LLMProxyService(MultiService):
    """The proxy. Starts accepting only once every host's roster was read."""

    log = Logger()

    def __init__(self, config: Config, reactor: Any, http: HTTPClient,
                 fetch: RosterFetcher | None = None, pool: Any = None) -> None:
        super().__init__()
        self.config = config
        self._reactor = reactor
        self._pool = pool
        self._started = reactor.seconds()
        self._ready = False
        self.rosters = Rosters(reactor, fetch or http_fetcher(http),
                               config.roster_timeout_seconds, on_change=self._rebuild)
        self._catalog = Catalog(config, {})
        self.inflight = InFlight(reactor)
        self.forwarder = Forwarder(reactor, http, lambda: self.config.header_timeout_seconds)
        self.site = ProxySite(Root(self), config.max_body_bytes, reactor)
        self.listener = Listener(reactor, config.listen, self.site)
        self.startup: Deferred[None] | None = None
        self._refresher = LoopingCall(self._refresh)
        self._refresher.clock = reactor

    # -- what the web layer reads -------------------------------------------
    @property
    def catalog(self) -> Catalog:
        return self._catalog

    @property
    def ready(self) -> bool:
        return self._ready

    def status(self) -> dict[str, Any]:
        return status_doc(config=self.config, rosters=self.rosters.by_host,
                          inflight=self.inflight, now=self._reactor.seconds(),
                          started=self._started, ready=self._ready,
                          listening=self._listening())

    def _listening(self) -> str | None:
        try:
            host, port = self.listener.bound_address()
        except AssertionError:
            return None
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _rebuild(self) -> None:
        self._catalog = Catalog(self.config, self.rosters.by_host)

    # -- life ----------------------------------------------------------------
    def privilegedStartService(self) -> None:
        # Bound before the reactor runs: a busy port stops twistd with a clear
        # message, and early connections wait in the kernel's queue.
        try:
            self.listener.bind()
        except ListenError as e:
            raise SystemExit(f"llmproxy: {e}") from None
        super().privilegedStartService()

    def startService(self) -> None:
        super().startService()
        self.startup = Deferred.fromCoroutine(self._start())

    async def _start(self) -> None:
        hosts = self.config.hosts
        self.log.info("reading the rosters of {n} host(s)", n=len(hosts))
        await self.rosters.read_all(hosts)
        if not self.running:
            return
        self.listener.start_accepting()
        self._ready = True
        failed = [h.name for h in hosts if self.rosters.by_host.get(h.name) is None
                  or self.rosters.by_host[h.name].generation == 0]
        self.log.info(
            "ready: listening on http://{address}, {models} model name(s) from {ok} of {n} "
            "host(s){failed}", address=self._listening(), models=len(self._catalog.routes()),
            ok=len(hosts) - len(failed), n=len(hosts),
            failed=f" (no roster from {', '.join(failed)})" if failed else "")
        # Start-up has just read them: the first refresh is one period away.
        self._refresher.start(self.config.refresh_seconds, now=False)

    def _refresh(self) -> Deferred[None]:
        return self.rosters.read_all(self.config.hosts)

    def stopService(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        self._ready = False
        if self._refresher.running:
            self._refresher.stop()
        await self.listener.stop_accepting()
        if self.startup is not None and not self.startup.called:
            self.startup.cancel()
        await super().stopService()
        if self._pool is not None:
            await self._pool.closeCachedConnections()


def _quiet_pool_class() -> Any:
    from twisted.web.client import HTTPConnectionPool, _HTTP11ClientFactory

    class QuietFactory(_HTTP11ClientFactory):
        noisy = False  # no "Starting factory" line per upstream connection

    class QuietPool(HTTPConnectionPool):
        _factory = QuietFactory

    return QuietPool


def build_service(config: Config, reactor: Any, extra: list[IService] | None = None
                  ) -> LLMProxyService:
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
    service = LLMProxyService(config, reactor, TreqClient(agent, cookiejar=no_cookies), pool=pool)
    for child in extra or []:
        child.setServiceParent(service)
    return service
