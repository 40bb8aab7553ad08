"""Public model names: one config snapshot joined with the rosters.

A Catalog is immutable. The service builds a new one whenever the config or a
roster changes, and every request reads the current one once, at its start: no
request ever sees half of an old catalog and half of a new one.

A model may be served by several hosts (replicas): the catalog's `hosts`, or
every host whose roster lists a model the catalog does not name. Its route
holds them all; `host/model` spells one of them alone (with `naming: host`,
those are the names listed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmproxy.config import Config, HostConfig
from llmproxy.hosts.roster import HostRoster, RosterEntry


@dataclass(frozen=True)
class Route:
    """Where one public model name goes: one host, or several (replicas)."""

    name: str                # the public name as listed (naming applied)
    hosts: tuple[HostConfig, ...]
    upstream: str            # the name the engines know the model by
    engine: str | None
    ctx: int | None
    alias_of: str | None = None
    catalogued: bool = True  # False: served only because rosters list it
    available_on: tuple[str, ...] = ()   # hosts whose last good roster lists `upstream`
    affinity: str | None = None          # "header:NAME" / "body:FIELD" / "prefix"
    fallbacks: tuple[str, ...] = ()      # names tried in turn when no host can take it

    @property
    def host(self) -> HostConfig:
        """The first host (the only one without replicas)."""
        return self.hosts[0]

    @property
    def available(self) -> bool:
        """Some host's last good roster lists it."""
        return bool(self.available_on)

    def describe(self, state: str | None = None) -> dict[str, Any]:
        """The OpenAI-style /v1/models entry of this name; `state` (loaded,
        loading, unloaded) goes in as `llmproxy.state` when given."""
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
            "hosts": [h.name for h in self.hosts],
            "upstream": self.upstream,
            "available": self.available,
            "available_on": list(self.available_on),
        }
        if self.engine is not None:
            extra["engine"] = self.engine
        if self.alias_of is not None:
            extra["alias_of"] = self.alias_of
        if self.affinity is not None:
            extra["affinity"] = self.affinity
        if self.fallbacks:
            extra["fallbacks"] = list(self.fallbacks)
        if state is not None:
            extra["state"] = state
        entry["llmproxy"] = extra
        return entry


def fallback_chain(catalog: Catalog, route: Route) -> list[Route]:
    """The models a request for `route` may be served by, in the order they are
    tried: `route`, then each of its `fallbacks` followed by that model's own
    (as the config gives them), depth first, none twice. A name `catalog` does
    not resolve (a key's scope leaves it out) is skipped; its own fallbacks are
    still tried."""
    if not route.fallbacks:
        return [route]          # the usual: no chain (and nothing for the collector)
    chain, seen, visited = [route], {_same(route)}, set()
    config = catalog.config
    todo = list(reversed(route.fallbacks))      # a stack, depth first, without recursion
    while todo:
        name = todo.pop()
        found = catalog.resolve(name)
        if found is not None and _same(found) not in seen:
            seen.add(_same(found))
            chain.append(found)
        target = config.aliases.get(name, name)
        if target in config.models and target not in visited:
            visited.add(target)     # the config has no loop; this only bounds the walk
            todo.extend(reversed(config.models[target].fallbacks))
    return chain


def _same(route: Route) -> tuple[Any, ...]:
    """What makes two routes one model to try."""
    return tuple(h.name for h in route.hosts), route.upstream, route.engine


def roster_ok(roster: HostRoster | None) -> bool:
    """The host's last roster read succeeded."""
    return roster is not None and roster.generation > 0 and not (
        roster.last_error_at is not None and roster.last_error_at >= (roster.fetched_at or 0))


class Catalog:
    """Resolves requested model names and lists them for /v1/models."""

    def __init__(self, config: Config, rosters: Mapping[str, HostRoster]) -> None:
        self.config = config
        self.rosters = dict(rosters)
        self._routes: dict[str, Route] = {}     # public name -> route, in listing order
        self._lookup: dict[str, Route] = {}     # every accepted spelling -> route
        hosts = {h.name: h for h in config.hosts}
        entries = {h.name: {e.id: e for e in rosters.get(h.name, HostRoster()).models}
                   for h in config.hosts}

        catalogued: dict[str, Route] = {}
        for name, model in config.models.items():
            group = tuple(hosts[h] for h in model.hosts)
            reported = [entries[h.name][model.upstream] for h in group
                        if model.upstream in entries[h.name]]
            route = Route(
                name=name, hosts=group, upstream=model.upstream, engine=model.engine,
                ctx=model.ctx if model.ctx is not None else next(
                    (e.ctx for e in reported if e.ctx is not None), None),
                available_on=tuple(h.name for h in group if model.upstream in entries[h.name]),
                affinity=model.affinity, fallbacks=model.fallbacks)
            catalogued[name] = self._serve(route)

        for alias, target in config.aliases.items():
            t = catalogued[target]
            self._add(replace(t, name=alias, alias_of=t.name), alias)

        # Models a roster lists that the catalog does not name are served under their
        # own names, by every host that lists them; a catalogued name or an alias
        # always wins a clash.
        covered = {(h, m.upstream) for m in config.models.values() for h in m.hosts}
        listed: dict[str, list[tuple[HostConfig, RosterEntry]]] = {}
        for host in config.hosts:
            for entry in rosters.get(host.name, HostRoster()).models:
                if (host.name, entry.id) not in covered:
                    listed.setdefault(entry.id, []).append((host, entry))
        for model_id, found in listed.items():
            group = tuple(h for h, _ in found)
            self._serve(Route(name=model_id, hosts=group, upstream=model_id, engine=None,
                              ctx=next((e.ctx for _, e in found if e.ctx is not None), None),
                              catalogued=False, available_on=tuple(h.name for h in group)))

    def _serve(self, route: Route) -> Route:
        """List `route` under its naming, with a `host/model` spelling for each host;
        returns the route as listed (the replica set)."""
        name = route.name
        if len(route.hosts) == 1:
            only = route.host.name
            shown = f"{only}/{name}" if self.config.naming == "host" else name
            route = replace(route, name=shown)
            self._add(route, name, f"{only}/{name}")
            return route
        if self.config.naming == "plain":
            self._add(route, name)
        else:
            self._lookup.setdefault(name, route)       # accepted, not listed
        for host in route.hosts:
            one = replace(route, name=f"{host.name}/{name}", hosts=(host,), available_on=tuple(
                h for h in route.available_on if h == host.name))
            if self.config.naming == "host":
                self._add(one)
            else:
                self._lookup.setdefault(one.name, one)
        return route

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

    def roster_ok(self, host: str) -> bool:
        """The host's last roster read (as of this catalog) succeeded."""
        return roster_ok(self.rosters.get(host))

    def placement(self) -> list[dict[str, Any]]:
        """Which hosts serve each listed name, for /status."""
        return [{"name": r.name, "hosts": [h.name for h in r.hosts], "engine": r.engine,
                 "available_on": list(r.available_on), "affinity": r.affinity,
                 "fallbacks": list(r.fallbacks), "alias_of": r.alias_of}
                for r in self._routes.values()]

    def model_list(self, state: Callable[[Route], str] | None = None) -> dict[str, Any]:
        """The body of GET /v1/models (each entry's `llmproxy.state` from `state`)."""
        return {"object": "list", "data": [r.describe(state(r) if state else None)
                                           for r in self._routes.values()]}
