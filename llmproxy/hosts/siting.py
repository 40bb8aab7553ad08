"""Where an engine that runs nowhere is started, among the hosts a model names
(`"hosts": [...]` with one `engine`, each host defining it): the placement rule
(`place`, pure) and the room it reserves (`Reservations`).

The rule, over the hosts that may take the request (not cordoned, not held by
another proxy, the engine not failed there, the host not unreachable or asleep):

1. a host where the engine is resident (running, starting, or placed there a
   moment ago) wins;
2. else a host where it fits without evicting, most headroom first;
3. else a host where requests already wait for the engine (a host that
   switched away from it with requests for it still queued: its start there is
   due), most waiters first: placed anywhere else it would evict an engine
   there or wait for room, and be loaded on two hosts for one set of requests;
4. else the host whose eviction costs least: fewest idle engines stopped, the
   least recently used first (an engine with a request in flight or queued is
   never one of them: `Host.idle_candidates`);
5. else (no room anywhere now) the host with the most room once its engines
   fall idle; its queue waits there.

Hosts that may not take it come last (the request fails over to them only when
every other host said nothing was sent), in the order given.

Two placements racing for the last room of a host: each choice reserves the
engine's memory on its host (`Reservations.reserve`), counted against that
host's headroom until the host's own budget counts the engine (it runs or is
being started there) or the start fails (`release`); all of it runs on the
reactor's one thread, so no two choices see the same room.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from llmproxy.hosts.adoption import memory_of
from llmproxy.hosts.host import Host

RESERVE_SECONDS = 600.0   # a reservation the host never took up is forgotten after this


@dataclass(frozen=True)
class Site:
    """One host as the rule sees it for one engine."""

    host: str
    usable: bool = True
    resident: bool = False
    free_gb: float = 0.0                  # headroom without evicting (reservations taken)
    need_gb: float = 0.0
    evict: tuple[str, ...] | None = None  # idle engines to stop to make room (None: cannot)
    evict_last_used: float = 0.0          # the most recent use among those
    waiting: int = 0                      # requests queued there for the engine


@dataclass(frozen=True)
class Placement:
    """The hosts to try, best first; why the first; each host's headroom (GB free)."""

    order: tuple[str, ...]
    why: str
    headroom: tuple[tuple[str, float | None], ...]


def _gb(value: float) -> str:
    return f"{value:g}" if math.isfinite(value) else "all"


def place(sites: Sequence[Site]) -> Placement:
    """The placement rule (see the module docstring)."""
    usable = [s for s in sites if s.usable]
    rest = tuple(s.host for s in sites if not s.usable)
    headroom = tuple((s.host, round(s.free_gb, 3) if math.isfinite(s.free_gb) else None)
                     for s in sites)
    if not usable:
        return Placement(rest, "no host may take it", headroom)
    resident = [s for s in usable if s.resident]
    fits = sorted((s for s in usable if not s.resident and s.free_gb >= s.need_gb),
                  key=lambda s: -s.free_gb)
    due = sorted((s for s in usable if s not in resident and s not in fits and s.waiting),
                 key=lambda s: -s.waiting)
    others = [s for s in usable if s not in resident and s not in fits and s not in due]
    evicts = sorted((s for s in others if s.evict is not None),
                    key=lambda s: (len(s.evict or ()), s.evict_last_used))
    waits = sorted((s for s in others if s.evict is None), key=lambda s: -s.free_gb)
    best = [*resident, *fits, *due, *evicts, *waits]
    first = best[0]
    if resident:
        why = "engine resident"
    elif fits:
        why = f"fits without evicting: {_gb(first.free_gb)} GB free"
    elif due:
        why = f"its start is due there: {first.waiting} request(s) wait for it"
    elif evicts:
        why = f"least eviction: stops {', '.join(first.evict or ())}"
    else:
        why = "no room on any host: waits for engines to fall idle"
    return Placement(tuple(s.host for s in best) + rest, why, headroom)


class Reservations:
    """The memory placements reserved and the hosts have not counted yet."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], tuple[float, float]] = {}   # -> (gb, since)

    def reserve(self, host: str, engine: str, gb: float, now: float) -> None:
        self._held[(host, engine)] = (gb, now)

    def release(self, host: str, engine: str) -> None:
        self._held.pop((host, engine), None)

    def held(self, host: str, engine: str) -> bool:
        return (host, engine) in self._held

    def reserved_gb(self, gate: Host, now: float, but: str | None = None) -> float:
        """The room reserved on `gate` for engines it does not count yet (`but`
        left out); reservations it now counts, or too old, are dropped."""
        name, total = gate.host.name, 0.0
        for (host, engine), (gb, since) in list(self._held.items()):
            if host != name:
                continue
            if gate.runs(engine) or gate.switching_to == engine or \
                    now - since > RESERVE_SECONDS:
                del self._held[(host, engine)]
            elif engine != but:
                total += gb
        return total


def site_of(gate: Host, engine: str, usable: bool, reservations: Reservations,
            now: float) -> Site:
    """How the rule sees `gate` for `engine` now (through the host's public reads)."""
    name, config = gate.host.name, gate.host
    need = memory_of(config, engine)
    reserved = reservations.reserved_gb(gate, now, but=engine)
    resident = gate.runs(engine) or gate.switching_to == engine or \
        reservations.held(name, engine)
    idle = sorted(gate.idle_candidates(), key=lambda pair: pair[1])
    waiting = 0 if resident else gate.waiting_for(engine)
    if config.memory_gb is None:     # one engine at a time: room only when none runs
        running = gate.running_engines()
        empty = not running and not gate.busy and not reserved
        free = math.inf if empty else 0.0
        names = [e for e, _ in idle]
        can = not reserved and not gate.busy and set(running) <= set(names)
        evict = tuple(running) if can else None
        last = max((t for e, t in idle), default=0.0)
        return Site(name, usable, resident, free, 0.0 if empty else 1.0, evict, last, waiting)
    free = config.memory_gb - gate.memory_used() - reserved
    stop: list[str] = []
    room, last = free, 0.0
    for other, since in idle:
        if room >= need:
            break
        stop.append(other)
        room += memory_of(config, other)
        last = max(last, since)
    return Site(name, usable, resident, free, need,
                tuple(stop) if room >= need else None, last, waiting)
