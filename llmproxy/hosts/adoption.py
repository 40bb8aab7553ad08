"""Which of the engines an agent reports running a managed host adopts (pure):
on a host that runs one engine at a time, the latest started of those healthy
and configured as they run; on a host with a memory budget, each of those while
they fit. The others are foreign: found there, not used, each with why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmproxy.config import HostConfig

Found = dict[str, Any]           # one engine of a status answer
Passed = list[tuple[str, str]]   # (engine, why it was not adopted)


def why_not(host: HostConfig, found: Found) -> str | None:
    """Why an engine the agent reports cannot be adopted, or None."""
    config = host.engines.get(found["engine"])
    if config is None:
        return "not one of this host's engines"
    if found.get("command") != list(config.command):
        return "started with another command than the config's"
    if found.get("healthy") is not True:
        return f"not healthy (no 200 from {found.get('health_url')})"
    return None


def memory_of(host: HostConfig, engine: str) -> float:
    """An engine's declared `memory_gb`: on a budgeted host, an engine that declares none
    counts for the whole budget (until it is measured: hosts/measured.py); 0 when it is not
    the host's, or the host has no budget."""
    preset = host.engines.get(engine)
    if preset is None:
        return 0.0
    return preset.memory_gb if preset.memory_gb is not None else (host.memory_gb or 0.0)


def adopt_one(host: HostConfig, engines: list[Found]) -> tuple[list[str], Passed]:
    """The engine adopted (the latest started that fits; at most one) and the others."""
    found = [e for e in engines if isinstance(e.get("engine"), str)]
    why = {id(e): why_not(host, e) for e in found}
    fit = [e for e in found if why[id(e)] is None]
    chosen = max(fit, key=_started_at, default=None)
    running = chosen["engine"] if chosen is not None else None
    passed = [(e["engine"], why[id(e)] or f"{running} was adopted: this host runs "
               "one engine at a time") for e in found if e is not chosen]
    return ([running] if running is not None else []), passed


def adopt_within(host: HostConfig, engines: list[Found],
                 measured: Callable[[str], float | None] = lambda engine: None,
                 ) -> tuple[list[str], Passed]:
    """The engines adopted (oldest first, while they fit the budget: each counts for its
    `measured` GiB, else its declared memory_gb, see `memory_of`) and the others."""

    def gb(name: str) -> float:
        figure = measured(name)
        return memory_of(host, name) if figure is None else figure

    found = sorted((e for e in engines if isinstance(e.get("engine"), str)),
                   key=lambda e: e.get("started_at") or 0)
    budget = host.memory_gb or 0.0
    adopted: list[str] = []
    passed: Passed = []
    for e in found:
        name, why = e["engine"], why_not(host, e)
        if why is None and sum(gb(a) for a in adopted) + gb(name) > budget:
            why = "over the host's memory_gb with the engines adopted before it"
        if why is None:
            adopted.append(name)
        else:
            passed.append((name, why))
    return adopted, passed


def _started_at(found: Found) -> float:
    value = found.get("started_at")
    return float(value) if isinstance(value, int | float) else 0.0
