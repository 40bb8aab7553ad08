"""The config in force, every host's roster, and the catalog made of both.

A reload applies a new config here; the periodic refresh (the root's
`roster-refresher` child) re-reads the rosters here, and so does a managed
host's change (`follow`: an engine ready, a watch's hello), so what is served
and shown follows the engines within a second. Each
is one assignment: a request reads `catalog` once, at its start, so it sees
either the old catalog or the new one, never a mix.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime

from llmproxy.config import Config, ConfigError, load_config
from llmproxy.core.events import EngineSwitch, Event
from llmproxy.core.hub import Publish
from llmproxy.hosts.catalog import Catalog
from llmproxy.hosts.fleet import Fleet
from llmproxy.hosts.roster import RosterFetcher, Rosters
from llmproxy.lifecycle.signals import SignalLatch


class Runtime:
    """What the proxy serves now, and how it changes (reload, roster reads)."""

    def __init__(self, config: Config, clock: IReactorTime, fetch: RosterFetcher,
                 publish: Publish, *, path: str | None = None,
                 hangup: SignalLatch | None = None) -> None:
        self.config = config
        self.path = path
        self._hangup = hangup
        self.rosters = Rosters(clock, fetch, config.roster_timeout_seconds,
                               on_change=self._rebuild, publish=publish)
        self.catalog = Catalog(config, {})

    def _rebuild(self) -> None:
        self.catalog = Catalog(self.config, self.rosters.by_host)

    def read_rosters(self) -> Deferred[None]:
        """Read every host's roster now (one numbered read each)."""
        return self.rosters.read_all(self.config.hosts)

    def read_roster(self, name: str) -> Deferred[None]:
        """Read host `name`'s roster now (one numbered read); nothing for a host the config
        in force does not have."""
        for host in self.config.hosts:
            if host.name == name:
                return self.rosters.read_one(host)
        return succeed(None)

    def follow(self, event: Event) -> None:
        """A hub subscriber: an engine that became ready makes its host's roster stale."""
        if isinstance(event, EngineSwitch) and event.stage == "done":
            self.read_roster(event.host)

    def read_config(self) -> Config:
        """The config file as it is now (for a reload); ConfigError if it is bad."""
        if self.path is None:
            raise ConfigError(["no config file to reload (the service was built from a value)"])
        config = load_config(self.path)
        if self._hangup is not None:
            self._hangup.config_read()
        return config

    async def apply(self, new: Config, changes: list[str]) -> None:
        """Serve `new` from now on, then re-read the rosters."""
        self.config = new
        self._rebuild()
        await self.read_rosters()

    def models_on_running_engines(self, fleet: Fleet) -> set[str]:
        """Catalog models whose engine runs now on one of their managed hosts."""
        managers = fleet.managers
        return {name for name, m in self.config.models.items()
                if m.engine is not None and any(
                    h in managers and managers[h].runs(m.engine) for h in m.hosts)}

    def failed_hosts(self) -> list[str]:
        """Hosts whose roster was never read."""
        return [h.name for h in self.config.hosts
                if self.rosters.by_host.get(h.name) is None
                or self.rosters.by_host[h.name].generation == 0]
