"""Which engines of a host may run together, and which to stop to start one
more: the eviction rule of a host with a memory budget (`memory_gb`).

A host without a budget runs one engine at a time (its switch stops the one
that runs). A host with one runs engines together while the sum of their
`memory_gb` fits. To start an engine that does not fit, `plan_start` picks the
idle engines to stop, least recently used first, and only those that are:

- idle: no request in flight on them, none queued for them;
- not protected (a predecessor's streams still use them during an upgrade);
- past their residency (`min_engine_seconds` after they started).

When stopping all of those would still not make room, nothing is stopped: the
start waits until engines fall idle (the queue's fairness bound makes them).
Pure functions of the state given: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    """One engine on the host as the rule sees it."""

    engine: str
    memory_gb: float
    last_used: float            # when a request last took or gave back a lease on it
    resident_until: float | None = None   # its residency ends (None: no residency)
    in_flight: int = 0
    queued: int = 0             # requests waiting for it
    protected: bool = False
    stopping: bool = False      # a stop is under way: its memory is not free yet

    def evictable(self, now: float) -> bool:
        """Idle, unprotected, past its residency and not already being stopped."""
        return (not self.in_flight and not self.queued and not self.protected
                and not self.stopping
                and (self.resident_until is None or now >= self.resident_until))


@dataclass(frozen=True)
class Plan:
    """What starting an engine takes: `evict` (in this order) then start, when
    `ready`; else why it waits (`busy`: the engines that would have to fall idle)."""

    ready: bool
    evict: tuple[str, ...] = ()
    busy: tuple[str, ...] = ()
    reason: str = ""


def used_gb(residents: Sequence[Resident]) -> float:
    """The memory the engines on the host hold (those being stopped included)."""
    return sum(r.memory_gb for r in residents)


def plan_start(target_gb: float, budget_gb: float, residents: Sequence[Resident],
               now: float) -> Plan:
    """How to start an engine of `target_gb` on a host of `budget_gb` running
    `residents` (the target itself not among them)."""
    if target_gb > budget_gb:
        return Plan(False, reason=f"needs {target_gb:g} GB, the host's budget is {budget_gb:g} GB")
    free = budget_gb - used_gb(residents)
    if target_gb <= free:
        return Plan(True)
    evict: list[str] = []
    for resident in sorted(residents, key=lambda r: r.last_used):
        if free >= target_gb:
            break
        if resident.evictable(now):
            evict.append(resident.engine)
            free += resident.memory_gb
    if free >= target_gb:
        return Plan(True, tuple(evict))
    busy = tuple(r.engine for r in residents if not r.evictable(now) and not r.stopping)
    return Plan(False, busy=busy, reason="waiting for " + ", ".join(busy) + " to fall idle"
                if busy else "waiting for a stop to finish")
