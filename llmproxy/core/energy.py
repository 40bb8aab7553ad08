"""The events of energy (observe/energy.py): what an engine's start cost. Published once
where the fact is known (see `core.hub`), like the events of `core.events`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmproxy.core.events import INFO, Event


@dataclass(frozen=True)
class EngineLoadEnergy(Event):
    """An engine's start on `host` ended (`outcome` done or failed): the energy its GPUs drew
    meanwhile with no request in flight, `joules` over `seconds` (`measured` False: the
    host's power was never sampled, the joules are 0)."""

    type: ClassVar[str] = "engine.load_energy"
    host: str
    engine: str
    joules: float
    seconds: float
    outcome: str
    measured: bool = True

    def line(self) -> tuple[str, str] | None:
        if not self.measured:
            return None
        return INFO, (f"start of {self.engine} on {self.host} ({self.outcome}): "
                      f"{self.joules:.1f} J over {self.seconds:.1f}s")
