"""What the process says about its fast paths and compatibility shims: which
are on, which are off and why, in the start-up log and in `/metrics`.

It takes the reports as plain documents (`{"enabled": bool, "active": [names],
"off": {name: reason}}`, the shape `/status` shows), so observe never imports
the packages that make them (llmproxy.speedups, llmproxy.compat).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.logger import Logger

log = Logger()

Report = Mapping[str, Any]


def log_report(kind: str, report: Report) -> None:
    """One line for what is on, and a warning per entry that is off (with why):
    nothing falls back to a slower or plainer path without saying so."""
    active = ", ".join(report.get("active", ())) or "none"
    if "enabled" in report and not report["enabled"]:
        log.warn("{kind}: off (LLMPROXY_SPEEDUPS=0): the reference path alone", kind=kind)
        return
    log.info("{kind}: on: {active}", kind=kind, active=active)
    for name, why in sorted(report.get("off", {}).items()):
        log.warn("{kind}: {name} is off: {why}", kind=kind, name=name, why=why)


class FastPathMetrics(Collector):
    """`llmproxy_speedup_active{speedup}` and `llmproxy_compat_active{entry}`:
    1 for each one on, 0 for each one off."""

    def __init__(self, speedups: Report, compat: Report) -> None:
        self._speedups, self._compat = speedups, compat

    def collect(self) -> Iterable[GaugeMetricFamily]:
        yield _family("llmproxy_speedup_active", "Fast paths on (1) or off (0), by speedup",
                      "speedup", self._speedups)
        yield _family("llmproxy_compat_active", "Compatibility shims on (1) or off (0)",
                      "entry", self._compat)


def _family(name: str, doc: str, label: str, report: Report) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for entry in report.get("active", ()):
        family.add_metric([entry], 1)
    for entry in sorted(report.get("off", {})):
        family.add_metric([entry], 0)
    return family
