"""Public model names: one config snapshot joined with the rosters.

A Catalog is immutable. The service builds a new one whenever the config or a
roster changes, and every request reads the current one once, at its start: no
request ever sees half of an old catalog and half of a new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmproxy.config import Config, HostConfig
from llmproxy.hosts.roster import HostRoster


@dataclass(frozen=True)
class Route:
    """Where one public model name goes."""

    name: str                # the public name as listed (naming applied)
    host: HostConfig
    upstream: str            # the name the engine knows the model by
    engine: str | None
    ctx: int | None
    alias_of: str | None = None
    catalogued: bool = True  # False: served only because the host's roster lists it
    available: bool = False  # the host's last good roster lists `upstream`

    def describe(self) -> dict[str, Any]:
        """The OpenAI-style /v1/models entry of this name."""
        entry: dict[str, Any] = {
            "id": self.name,
            "object": "model",
            "created": 0,
            "owned_by": self.host.name,
        }
        if self.ctx is not None:
            entry["context_length"] = self.ctx
        extra: dict[str, Any] = {
            "host": self.host.name,
            "upstream": self.upstream,
            "available": self.available,
        }
        if self.engine is not None:
            extra["engine"] = self.engine
        if self.alias_of is not None:
            extra["alias_of"] = self.alias_of
        entry["llmproxy"] = extra
        return entry


class Catalog:
    """Resolves requested model names and lists them for /v1/models."""

    def __init__(self, config: Config, rosters: Mapping[str, HostRoster]) -> None:
        self.config = config
        self._routes: dict[str, Route] = {}     # public name -> route, in listing order
        self._lookup: dict[str, Route] = {}     # every accepted spelling -> route
        hosts = {h.name: h for h in config.hosts}

        def public(host: str, model: str) -> str:
            return f"{host}/{model}" if config.naming == "host" else model

        catalogued: dict[str, Route] = {}
        for name, model in config.models.items():
            host = hosts[model.host]
            entries = {e.id: e for e in rosters.get(host.name, HostRoster()).models}
            reported = entries.get(model.upstream)
            route = Route(
                name=public(host.name, name), host=host, upstream=model.upstream,
                engine=model.engine,
                ctx=model.ctx if model.ctx is not None else (reported.ctx if reported else None),
                available=reported is not None,
            )
            catalogued[name] = route
            self._add(route, name, f"{host.name}/{name}")

        for alias, target in config.aliases.items():
            t = catalogued[target]
            self._add(Route(name=alias, host=t.host, upstream=t.upstream, engine=t.engine,
                            ctx=t.ctx, alias_of=t.name, available=t.available), alias)

        # Models a roster lists that the catalog does not name are served under their
        # own names; a catalogued name or an alias always wins a clash.
        covered = {(m.host, m.upstream) for m in config.models.values()}
        for host in config.hosts:
            for entry in rosters.get(host.name, HostRoster()).models:
                if (host.name, entry.id) in covered:
                    continue
                route = Route(name=public(host.name, entry.id), host=host, upstream=entry.id,
                              engine=None, ctx=entry.ctx, catalogued=False, available=True)
                self._add(route, entry.id, f"{host.name}/{entry.id}")

    def _add(self, route: Route, *spellings: str) -> None:
        if route.name in self._routes:
            return
        self._routes[route.name] = route
        for spelling in (route.name, *spellings):
            self._lookup.setdefault(spelling, route)

    def resolve(self, name: str) -> Route | None:
        """The route of a requested model name (plain, host/model, or alias)."""
        return self._lookup.get(name)

    def routes(self) -> list[Route]:
        """Every listed name, catalogue first, then aliases, then roster-only models."""
        return list(self._routes.values())

    def model_list(self) -> dict[str, Any]:
        """The body of GET /v1/models."""
        return {"object": "list", "data": [r.describe() for r in self._routes.values()]}
