"""A catalog entry of hosts.json (`models.NAME`), validated like the rest
(`parse`): the host or hosts that serve it, its engine on the managed ones,
the upstream name, `ctx`, session `affinity` and its `fallbacks` (checked
across the catalog by `check_fallbacks`: known names, no loop). Every error
names its field."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from llmproxy.config.values import HostConfig, ModelConfig

MODEL_KEYS = ("host", "hosts", "engine", "upstream", "ctx", "affinity", "fallbacks")
_AFFINITY = re.compile(r"header:[!#$%&'*+.^_`|~0-9A-Za-z-]+|body:[A-Za-z0-9_.-]+|prefix")
_AFFINITY_RULE = ('must be "header:NAME", "body:FIELD" or "prefix" '
                  '(e.g. "header:X-Session-Id")')

Known = list[tuple[str, "set[str] | None"]]   # (host, its engines; None: invalid engines)


class Checks(Protocol):
    """What these checks use of the config parser."""

    def error(self, path: str, message: str) -> None: ...

    def string(self, value: object, path: str) -> str | None: ...

    def positive_int(self, value: object, path: str) -> int | None: ...


def model(p: Checks, key: str, d: dict[str, Any], path: str,
          engines_by_host: dict[str, set[str] | None]) -> ModelConfig:
    """One catalog entry (its keys already checked against MODEL_KEYS)."""
    names, known = _hosts(p, d, path, engines_by_host)
    engine = d.get("engine")
    if "engine" in d and (not isinstance(engine, str) or not engine):
        p.error(f"{path}.engine", "must be a non-empty string")
    else:
        _check_engine(p, engine, known, f"{path}.engine")
    upstream = p.string(d["upstream"], f"{path}.upstream") if "upstream" in d else None
    ctx = p.positive_int(d["ctx"], f"{path}.ctx") if "ctx" in d else None
    affinity = d.get("affinity")
    if "affinity" in d and not (isinstance(affinity, str) and _AFFINITY.fullmatch(affinity)):
        p.error(f"{path}.affinity", _AFFINITY_RULE)
    first = names[0] if names else str(d.get("host"))
    return ModelConfig(key, first, engine, upstream or key, ctx, hosts=tuple(names or [first]),
                       affinity=affinity if isinstance(affinity, str) else None,
                       fallbacks=_fallbacks(p, d, path) if "fallbacks" in d else ())


def _fallbacks(p: Checks, d: dict[str, Any], path: str) -> tuple[str, ...]:
    """`fallbacks`: a list of model names, none twice (checked against the
    catalog by `check_fallbacks`)."""
    value = d["fallbacks"]
    if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
        p.error(f"{path}.fallbacks", "must be a list of model names")
        return ()
    for i, name in enumerate(value):
        if name in value[:i]:
            p.error(f"{path}.fallbacks[{i}]", f"duplicate of fallbacks[{value.index(name)}]")
    return tuple(dict.fromkeys(value))


def check_fallbacks(p: Checks, models: Mapping[str, ModelConfig],
                    aliases: Mapping[str, str]) -> None:
    """Every fallback names a model or an alias, and no chain leads back to a
    model already in it (an alias counts as the model it names)."""
    def target(name: str) -> str:
        return aliases.get(name, name)

    for key, entry in models.items():
        for i, name in enumerate(entry.fallbacks):
            where = f"models.{key}.fallbacks[{i}]"
            if name not in models and name not in aliases:
                p.error(where, f"no model or alias named {name!r}")
                continue
            way = _way_back(models, target, target(name), key, set())
            if way is not None:
                p.error(where, "a loop: " + " -> ".join([key, *way]))


def _way_back(models: Mapping[str, ModelConfig], target: Callable[[str], str],
              start: str, home: str, seen: set[str]) -> list[str] | None:
    """A chain of fallbacks from `start` that reaches `home` (both included), or None."""
    if start == home:
        return [home]
    if start in seen:
        return None
    seen.add(start)
    entry = models.get(start)
    for name in entry.fallbacks if entry is not None else ():
        way = _way_back(models, target, target(name), home, seen)
        if way is not None:
            return [start, *way]
    return None


def _hosts(p: Checks, d: dict[str, Any], path: str,
           engines_by_host: dict[str, set[str] | None]) -> tuple[list[str], Known]:
    """The host names given, and those that exist with their engines."""
    if "hosts" not in d:
        host = d.get("host")
        if "host" not in d:
            p.error(f"{path}.host", "required")
        elif not isinstance(host, str) or not host:
            p.error(f"{path}.host", "must be a non-empty string")
        elif host not in engines_by_host:
            p.error(f"{path}.host", f"no host named {host!r}")
        else:
            return [host], [(host, engines_by_host[host])]
        return [], []
    if "host" in d:
        p.error(f"{path}.hosts", 'give "host" or "hosts", not both')
    value = d["hosts"]
    if not isinstance(value, list) or not value or not all(
            isinstance(h, str) and h for h in value):
        p.error(f"{path}.hosts", "must be a non-empty list of host names")
        return [], []
    known: Known = []
    first_index: dict[str, int] = {}
    for i, host in enumerate(value):
        if host in first_index:
            p.error(f"{path}.hosts[{i}]", f"duplicate of hosts[{first_index[host]}]")
            continue
        first_index[host] = i
        if host not in engines_by_host:
            p.error(f"{path}.hosts[{i}]", f"no host named {host!r}")
        else:
            known.append((host, engines_by_host[host]))
    return list(first_index), known


def _check_engine(p: Checks, engine: object, known: Known, path: str) -> None:
    """A managed host needs the model's engine; a model on unmanaged hosts only has
    none. Hosts whose engines are invalid are reported elsewhere."""
    if any(engines is None for _, engines in known):
        known = [(h, e) for h, e in known if e is not None]
        if not known:
            return
    managed = [(h, e) for h, e in known if e]
    if engine is None:
        if managed:
            p.error(path, f"required: host {managed[0][0]!r} is managed")
    elif not managed:
        if known:
            p.error(path, f"host {known[0][0]!r} has no engines")
    else:
        for host, engines in managed:
            if engine not in (engines or ()):
                p.error(path, f"host {host!r} has no engine {engine!r}")


def check_engine_overrides(p: Checks, models: Mapping[str, ModelConfig],
                           hosts: list[HostConfig]) -> None:
    """A model's engine on several hosts is one engine: each host's definition may
    give its own command, url, memory_gb and start timeout (a per-host override),
    but the engine answers its health check on the same path everywhere."""
    by_name = {h.name: h for h in hosts}
    for key, entry in models.items():
        if entry.engine is None or len(entry.hosts) < 2:
            continue
        defined = [(h, by_name[h].engines[entry.engine]) for h in entry.hosts
                   if h in by_name and entry.engine in by_name[h].engines]
        for host, engine in defined[1:]:
            first, other = defined[0]
            if engine.health != other.health:
                p.error(f"models.{key}.engine", f"engine {entry.engine!r} checks health at "
                        f"{other.health!r} on {first!r} but {engine.health!r} on {host!r}: "
                        "per-host overrides of one engine must agree on health")
