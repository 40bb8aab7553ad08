"""Per-key energy budgets: a key's `wh_per_day` (config/keys.py), watt-hours of GPU energy
per UTC day, counted from the energy its requests used (observe/energy.py, the
`energy_joules` of each request's end).

A request is admitted while its key's use today is below the budget; the request that
takes it past the budget runs to its end (its energy is known only then), and the next one
is refused: a 429 whose error code is `energy_budget_exceeded` (type `energy`), with
Retry-After: the seconds until the next UTC midnight, when the count starts again. A
request whose energy was not measured (a host without nvidia-smi) counts nothing.

The count lives in the process: a restart starts the day afresh; an upgrade hands it to the
successor (`forward_to` and `take`, as `energybudget` lines on the predecessor's pipe,
lifecycle/handover.py), and the energy of requests the old process still finishes follows
as they end."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
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
WORD = b"energybudget"     # its lines on an upgrade's hand-over pipe


class EnergyBudgets:
    """Each key's joules today; a hub subscriber that counts each request's as it ends."""

    def __init__(self, clock: IReactorTime, publish: Publish) -> None:
        self._clock = clock
        self._publish = publish
        self._day = math.floor(clock.seconds() / DAY)
        self._used: dict[str, float] = {}
        self._forward: Callable[[bytes], None] | None = None

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
            if self._forward is not None:
                self._forward(self._line({event.key: event.energy_joules}))

    def _line(self, used: dict[str, float]) -> bytes:
        return WORD + b" " + json.dumps({"day": self._day, "keys": used}).encode() + b"\n"

    def forward_to(self, send: Callable[[bytes], None]) -> None:
        """An upgrade handed over: `send` today's use now, and the energy of each request
        this process still finishes as it ends, for the successor's `take`."""
        self._today()
        self._forward = send
        send(self._line(dict(self._used)))

    def take(self, line: bytes) -> None:
        """A predecessor's `energybudget` line (after the word): its joules of today are
        added (a line of another day, or of another make, adds nothing)."""
        try:
            doc = json.loads(line)
            self._today()
            if doc["day"] != self._day:
                return
            for name, joules in doc["keys"].items():
                if isinstance(joules, (int, float)) and math.isfinite(joules) and joules > 0:
                    self._used[str(name)] = self._used.get(str(name), 0.0) + float(joules)
        except (ValueError, KeyError, TypeError, AttributeError):
            return

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
