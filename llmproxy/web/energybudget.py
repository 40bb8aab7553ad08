"""Per-key energy budgets: a key's `wh_per_day` (config/keys.py), watt-hours of GPU energy
per UTC day, counted from the energy its requests used (observe/energy.py, the
`energy_joules` of each request's end).

A request is admitted while its key's use today is below the budget; the request that
takes it past the budget runs to its end (its energy is known only then), and the next one
is refused: a 429 whose error code is `energy_budget_exceeded` (type `energy`), with
Retry-After: the seconds until the next UTC midnight, when the count starts again. A
request whose energy was not measured (a host without nvidia-smi) counts nothing.

The count lives in this process: a restart or an upgrade starts the day afresh."""

from __future__ import annotations

import math
from typing import Any

from twisted.internet.interfaces import IReactorTime

from llmproxy.config.keys import ApiKey
from llmproxy.core.capacity import RateLimited
from llmproxy.core.events import Event, RequestEnded
from llmproxy.core.hub import Publish

DAY = 86400.0
JOULES_PER_WH = 3600.0
ENERGY = "energy"          # the refusal's error type and RateLimited's limit
CODE = "energy_budget_exceeded"


class EnergyBudgets:
    """Each key's joules today; a hub subscriber that counts each request's as it ends."""

    def __init__(self, clock: IReactorTime, publish: Publish) -> None:
        self._clock = clock
        self._publish = publish
        self._day = math.floor(clock.seconds() / DAY)
        self._used: dict[str, float] = {}

    def _today(self) -> float:
        """Now; the count starts again on a new UTC day."""
        now = self._clock.seconds()
        day = math.floor(now / DAY)
        if day != self._day:
            self._day, self._used = day, {}
        return now

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestEnded) and event.key is not None and \
                event.energy_joules is not None:
            self._today()
            self._used[event.key] = self._used.get(event.key, 0.0) + event.energy_joules

    def refuse(self, key: ApiKey, request_id: str | None = None) -> int | None:
        """Seconds until `key`'s budget is renewed when it is spent (the request is
        refused); None: admitted (or the key has no budget)."""
        if key.wh_per_day is None:
            return None
        now = self._today()
        if self._used.get(key.name, 0.0) < key.wh_per_day * JOULES_PER_WH:
            return None
        wait = (self._day + 1) * DAY - now
        self._publish(RateLimited(now, key.name, request_id, ENERGY, wait))
        return max(1, math.ceil(wait))

    def snapshot(self, key: ApiKey) -> dict[str, Any] | None:
        """For /status: `key`'s budget and its use today in watt-hours (None: no budget)."""
        if key.wh_per_day is None:
            return None
        self._today()
        used = self._used.get(key.name, 0.0) / JOULES_PER_WH
        return {"wh_per_day": key.wh_per_day, "used_wh": round(used, 4),
                "remaining_wh": round(max(0.0, key.wh_per_day - used), 4)}
