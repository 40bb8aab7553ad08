"""The capacity keys of hosts.json, validated like the rest (`parse`): a host's
slots, queue, residency and preloaded engine, an engine's own slots and idle
stop. Every
error names its field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from llmproxy.config.values import EngineConfig

HOST_KEYS = ("max_concurrent", "max_queue", "queue_timeout_seconds", "min_engine_seconds",
             "preload", "memory_gb", "schedule", "max_wait_seconds")
SCHEDULES = ("arrival", "batch")   # hosts/batching.py
ENGINE_KEYS = ("max_concurrent", "idle_stop_seconds", "memory_gb")


class Checks(Protocol):
    """What these checks use of the config parser."""

    def error(self, path: str, message: str) -> None: ...

    def seconds(self, value: object, path: str, positive: bool = True) -> float: ...

    def positive_int(self, value: object, path: str) -> int | None: ...


def host_capacity(p: Checks, d: dict[str, Any], path: str, url: str | None,
                  engines: Mapping[str, EngineConfig]) -> dict[str, Any]:
    """The HostConfig fields of a host's capacity keys that are given."""
    out: dict[str, Any] = {}
    for key in ("max_concurrent", "max_queue"):
        if key in d:
            out[key] = p.positive_int(d[key], f"{path}.{key}")
    if "queue_timeout_seconds" in d:
        out["queue_timeout_seconds"] = p.seconds(d["queue_timeout_seconds"],
                                                 f"{path}.queue_timeout_seconds")
    if "min_engine_seconds" in d:
        out["min_engine_seconds"] = p.seconds(d["min_engine_seconds"],
                                              f"{path}.min_engine_seconds", positive=False)
    if "max_wait_seconds" in d:
        out["max_wait_seconds"] = p.seconds(d["max_wait_seconds"],
                                            f"{path}.max_wait_seconds", positive=False)
    if "schedule" in d:
        if d["schedule"] not in SCHEDULES:
            p.error(f"{path}.schedule", f"must be one of {', '.join(SCHEDULES)}")
        else:
            out["schedule"] = d["schedule"]
    budget = None
    if "memory_gb" in d:
        budget = out["memory_gb"] = p.seconds(d["memory_gb"], f"{path}.memory_gb")
        if not engines:
            p.error(f"{path}.memory_gb", "needs engines: only a managed host has a budget")
    _check_memory(p, path, url, budget, engines)
    if "preload" in d:
        out["preload"] = _preload(p, d["preload"], path, budget, engines)
    return out


def _check_memory(p: Checks, path: str, url: str | None, budget: float | None,
                  engines: Mapping[str, EngineConfig]) -> None:
    """On a budgeted host every engine fits the budget (one that states no memory_gb
    counts for all of it until measured: hosts/measured.py) and listens on its own url;
    elsewhere an engine's memory_gb means nothing."""
    seen: dict[str, str] = {}
    for name, engine in engines.items():
        where = f"{path}.engines.{name}.memory_gb"
        if budget is None:
            if engine.memory_gb is not None:
                p.error(where, "needs the host's memory_gb (without it the host runs one "
                               "engine at a time)")
            continue
        if engine.memory_gb is not None and engine.memory_gb > budget:
            p.error(where, f"{engine.memory_gb:g} is more than the host's memory_gb "
                           f"({budget:g})")
        listens = engine.url or url or ""
        if listens in seen:
            p.error(f"{path}.engines.{name}.url", f"the same as engine {seen[listens]}'s "
                    f"({listens}): engines that run together need their own url")
        seen.setdefault(listens, name)


def _preload(p: Checks, value: object, path: str, budget: float | None,
             engines: Mapping[str, EngineConfig]) -> tuple[str, ...]:
    """`preload`: one engine's name, or a list of them (several: a budgeted host)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or \
            not all(isinstance(n, str) and n for n in names):
        p.error(f"{path}.preload", "must name an engine, or be a non-empty list of engines")
        return ()
    if not engines:
        p.error(f"{path}.preload", "needs engines: only a managed host preloads")
        return ()
    for name in names:
        if name not in engines:
            p.error(f"{path}.preload", f"no engine {name!r} on this host")
    if len(set(names)) != len(names):
        p.error(f"{path}.preload", "names an engine twice")
    elif len(names) > 1 and budget is None:
        p.error(f"{path}.preload", "several engines need the host's memory_gb (without it "
                                   "the host runs one engine at a time)")
    elif budget is not None and all(n in engines for n in names):
        need = sum(budget if engines[n].memory_gb is None else engines[n].memory_gb or 0.0
                   for n in names)
        if need > budget:
            p.error(f"{path}.preload", f"{', '.join(names)} need {need:g} GB together, "
                                       f"more than the host's memory_gb ({budget:g})")
    return tuple(names)


def engine_capacity(p: Checks, d: dict[str, Any], path: str) -> dict[str, Any]:
    """The EngineConfig fields of an engine's capacity keys that are given."""
    out: dict[str, Any] = {}
    if "max_concurrent" in d:
        out["max_concurrent"] = p.positive_int(d["max_concurrent"], f"{path}.max_concurrent")
    if "idle_stop_seconds" in d:
        out["idle_stop_seconds"] = p.seconds(d["idle_stop_seconds"],
                                             f"{path}.idle_stop_seconds")
    if "memory_gb" in d:
        out["memory_gb"] = p.seconds(d["memory_gb"], f"{path}.memory_gb")
    return out
