"""The run's table (for people) and its JSON (for tools and for comparing runs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.budgets import DIRECT, TITLES, Check, added
from bench.scenarios import ideal_seconds

Row = tuple[str, Callable[[dict[str, Any], str], str]]


def _fmt(value: Any, digits: int = 3, sign: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | int):
        text = f"{value:+,.{digits}f}" if sign else f"{value:,.{digits}f}"
        return text
    return str(value)


def _figure(phase: str, key: str, digits: int = 3) -> Callable[[dict[str, Any], str], str]:
    def get(results: dict[str, Any], target: str) -> str:
        return _fmt(results.get(target, {}).get(phase, {}).get(key), digits)
    return get


def _added(phase: str, key: str) -> Callable[[dict[str, Any], str], str]:
    def get(results: dict[str, Any], target: str) -> str:
        if target == DIRECT:
            return ""
        return _fmt(added(results, target, phase, key), 3, sign=True)
    return get


def _ratio_to(base: str, phase: str,
              key: str = "cpu_ms_per_1k") -> Callable[[dict[str, Any], str], str]:
    def get(results: dict[str, Any], target: str) -> str:
        mine = results.get(target, {}).get(phase, {}).get(key)
        floor = results.get(base, {}).get(phase, {}).get(key)
        if mine is None or not floor:
            return "-" if target != DIRECT else ""
        return f"{mine / floor:.2f}x"
    return get


def _harness(phase: str) -> Callable[[dict[str, Any], str], str]:
    def get(results: dict[str, Any], target: str) -> str:
        r = results.get(target, {}).get(phase, {})
        parts = [r.get("engine_cpu_ms_per_1k"), r.get("client_cpu_ms_per_1k")]
        return "-" if None in parts else _fmt(sum(parts), 1)
    return get


def _complete(results: dict[str, Any], target: str) -> str:
    r = results.get(target, {}).get("rss", {})
    if "completed" not in r:
        return "-"
    return f"{r['completed']}/{r['streams']}"


def _most_stolen(results: dict[str, Any], target: str) -> str:
    shares = [(figures.get("steal_pct"), phase)
              for phase, figures in results.get(target, {}).items()]
    known = [(share, phase) for share, phase in shares if share is not None]
    if not known:
        return "-"
    share, phase = max(known)
    return f"{share:.1f} {phase}"


def rows(plan: dict[str, Any]) -> list[Row]:
    """The table's rows: a label and how to read each target's cell."""
    p = plan
    on_time = ideal_seconds(p["rss_ramp"], p["rss_events"], p["rss_rate"])
    return [
        (f"latency p50, non-streamed x{p['latency_requests']} (ms)", _figure("latency", "p50_ms")),
        ("latency p99 (ms)", _figure("latency", "p99_ms")),
        ("  added p50 (ms)", _added("latency", "p50_ms")),
        ("  added p99 (ms)", _added("latency", "p99_ms")),
        ("  CPU ms per request", _figure("latency", "cpu_ms_per_request", 2)),
        (f"TTFB p50, streamed x{p['ttfb_requests']} (ms)", _figure("ttfb", "p50_ms")),
        ("TTFB p99 (ms)", _figure("ttfb", "p99_ms")),
        ("  added TTFB p50 (ms)", _added("ttfb", "p50_ms")),
        ("  added TTFB p99 (ms)", _added("ttfb", "p99_ms")),
        (f"events/s, {p['throughput_streams']} streams x {p['throughput_events']}",
         _figure("throughput", "events_per_s", 0)),
        ("  CPU ms per 1k events, unpaced", _figure("throughput", "cpu_ms_per_1k", 1)),
        (f"CPU ms per 1k events, {p['cpu_streams']} streams x {p['cpu_rate']:g}/s",
         _figure("cpu", "steady_cpu_ms_per_1k", 1)),
        ("  CPU per event vs nginx", _ratio_to("nginx", "cpu", "steady_cpu_ms_per_1k")),
        ("  with request set-up", _figure("cpu", "cpu_ms_per_1k", 1)),
        ("  lag p99 (ms)", _figure("cpu", "lag_p99_ms")),
        (f"paced lag p50, {p['paced_streams']} streams x {p['paced_rate']:g}/s (ms)",
         _figure("paced", "lag_p50_ms")),
        ("paced lag p99 (ms)", _figure("paced", "lag_p99_ms")),
        ("  p99 while all streams run (ms)", _figure("paced", "steady_lag_p99_ms")),
        ("  CPU ms per 1k events, paced", _figure("paced", "cpu_ms_per_1k", 1)),
        ("  CPU per event vs nginx", _ratio_to("nginx", "paced")),
        ("  harness CPU ms per 1k (engine+client)", _harness("paced")),
        ("  target waited for a CPU (ms), paced", _figure("paced", "runqueue_wait_ms", 0)),
        (f"burst lag p50, {p['burst_streams']} streams x {p['burst_rate']:g}/s, one batch (ms)",
         _figure("burst", "lag_p50_ms")),
        ("burst lag p99 (ms)", _figure("burst", "lag_p99_ms")),
        ("  p99 vs nginx", _ratio_to("nginx", "burst", "lag_p99_ms")),
        ("  p99 while all streams run (ms)", _figure("burst", "steady_lag_p99_ms")),
        ("  CPU ms per 1k events, burst", _figure("burst", "cpu_ms_per_1k", 1)),
        ("  steady CPU ms per 1k events, burst", _figure("burst", "steady_cpu_ms_per_1k", 1)),
        ("  target waited for a CPU (ms), burst", _figure("burst", "runqueue_wait_ms", 0)),
        (f"{p['rss_streams']} streams x {p['rss_events']} at {p['rss_rate']:g}/s: complete",
         _complete),
        (f"  wall time (s; on time: {on_time:.1f})", _figure("rss", "seconds", 1)),
        ("  peak RSS (MiB)", _figure("rss", "peak_rss_mib", 1)),
        ("VM steal, most in a phase (% of CPU time)", _most_stolen),
    ]


def table(results: dict[str, Any], targets: list[str], plan: dict[str, Any]) -> str:
    """The figures side by side, one column per target."""
    label_width = max(len(label) for label, _ in rows(plan))
    every = [(label, [cell(results, t) for t in targets]) for label, cell in rows(plan)]
    # A phase that was not run has no row; each column is as wide as its widest cell
    # (its name included), so llmproxy-reference's width costs the others none.
    shown = [(label, cells) for label, cells in every if not all(c in ("", "-") for c in cells)]
    widths = [max(10, len(t), *(len(cells[i]) for _, cells in shown))
              for i, t in enumerate(targets)]
    lines = ["figure".ljust(label_width)
             + "".join(t.rjust(w + 2) for t, w in zip(targets, widths, strict=True))]
    for label, cells in shown:
        lines.append(label.ljust(label_width)
                     + "".join(c.rjust(w + 2) for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)


def _check_value(c: Check) -> str:
    if c.value is None:
        return "-"
    if c.unit == "x":
        return f"{c.value:.2f}x"
    if c.unit in ("streams", "events/s"):
        return f"{c.value:,.0f} {c.unit}"
    return f"{c.value:.3f} {c.unit}"


def _check_limit(c: Check) -> str:
    if c.key == "harness_events_per_s":
        return f">= {c.limit:,.0f} {c.unit}"
    # Each set's keys end the same (the reference's have a prefix).
    if c.key.endswith("streams_whole"):
        return f"== {c.limit:,.0f}"
    if c.key.endswith("rss_streams"):
        return f"< {c.limit:g} {c.unit}"
    if c.unit == "x":
        return f"<= {c.limit:g}x nginx"
    return f"<= {c.limit:g} {c.unit}"


def budget_lines(checks: list[Check]) -> str:
    """One line per budget: PASS/FAIL/SKIP, what, measured, limit, note."""
    label_width = max(len(c.label) for c in checks)
    out = []
    for c in checks:
        line = (f"{c.status.upper():4}  {c.label.ljust(label_width)}  "
                f"{_check_value(c):>16}  {_check_limit(c)}")
        if c.note:
            line += f"  ({c.note})"
        out.append(line)
    return "\n".join(out)


def budget_sections(checks: list[Check]) -> str:
    """The budgets under a heading per set (the speedups', the reference path's, the
    harness's), their columns aligned across the sets."""
    lines = budget_lines(checks).splitlines()
    out: list[str] = []
    for i, (c, line) in enumerate(zip(checks, lines, strict=True)):
        if i == 0 or checks[i - 1].target != c.target:
            out.append(f"{TITLES.get(c.target, c.target)}:")
        out.append("  " + line)
    return "\n".join(out)


def modes(speedups: dict[str, dict[str, Any] | None]) -> str:
    """One line per llmproxy target: the mode its /status reported (`speedups`:
    each target's `speedups` field)."""
    out = []
    for name, doc in speedups.items():
        if doc is None:
            continue
        active = ", ".join(doc.get("active") or []) or "none"
        off = ", ".join(f"{k} ({v})" for k, v in (doc.get("off") or {}).items()) or "none"
        state = "on" if doc.get("enabled") else "off"
        out.append(f"{name}: speedups {state}; active: {active}; off: {off}")
    return "\n".join(out)


def added_figures(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Each proxy's figures minus the direct connection's (for the JSON)."""
    out: dict[str, dict[str, float | None]] = {}
    for target in results:
        if target == DIRECT:
            continue
        out[target] = {
            f"{phase}_{key}": (None if (v := added(results, target, phase, key)) is None
                               else round(v, 4))
            for phase in ("latency", "ttfb") for key in ("p50_ms", "p99_ms")
        }
    return out
