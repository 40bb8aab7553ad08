"""The events of the trace exporter (`observe.tracing`): a collector that
stopped taking spans, and one that takes them again. Published once per change
(never once per batch), so a collector that is down costs one warning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmproxy.core.events import INFO, WARN, Event


@dataclass(frozen=True)
class TraceExport(Event):
    """The OTLP collector at `endpoint` took no spans (`ok` False: they are
    dropped) or takes them again (`ok` True)."""

    type: ClassVar[str] = "tracing.export"
    endpoint: str
    ok: bool

    def line(self) -> tuple[str, str]:
        if self.ok:
            return INFO, f"tracing: the collector at {self.endpoint} takes spans again"
        return WARN, (f"tracing: the collector at {self.endpoint} took no spans: they are "
                      "dropped until it answers (requests are not affected)")
