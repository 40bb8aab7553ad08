"""What the web layer sees of the running proxy (`web.routes.App`): a facade over
the parts and the few questions only the root service answers."""

from __future__ import annotations

from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from llmproxy.hosts.catalog import Catalog
from llmproxy.lifecycle.components import Parts
from llmproxy.web.turns import Turns


class Proxy(Protocol):
    """The root service's answers the web asks for."""

    @property
    def ready(self) -> bool: ...

    def status(self) -> dict[str, Any]: ...

    def reload(self) -> Deferred[Any] | None: ...

    def upgrade_requested(self) -> Deferred[dict[str, Any]]: ...


class WebApp:
    """The web's view of the proxy: the parts it reads, and the root's answers
    (readiness, /status, reload and upgrade) asked through `proxy`."""

    def __init__(self, parts: Parts, clock: IReactorTime, proxy: Proxy) -> None:
        self.inflight = parts.inflight
        self.forwarder = parts.forwarder
        self.fleet = parts.fleet
        self.events = parts.events
        self.metrics = parts.metrics
        self.access = parts.access
        self.captures = parts.captures
        self.clock = clock
        self.turns = parts.turns or Turns(clock)
        self._runtime = parts.runtime
        self._proxy = proxy

    @property
    def catalog(self) -> Catalog:
        """The catalog in force (one read per request: a reload swaps it whole)."""
        return self._runtime.catalog

    @property
    def ready(self) -> bool:
        return self._proxy.ready

    @property
    def standby(self) -> bool:
        """Whether the proxy waits, as a standby, for the hosts' leases."""
        return self.fleet.leases.standby

    def status(self) -> dict[str, Any]:
        return self._proxy.status()

    def reload(self) -> Deferred[Any] | None:
        return self._proxy.reload()

    def upgrade_requested(self) -> Deferred[dict[str, Any]]:
        return self._proxy.upgrade_requested()
