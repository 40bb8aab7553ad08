"""The cpu phase in four passes, the targets' order mirrored in every second one.

The cpu phase measures one target after the other, each for a few seconds, and the
budget is a ratio of two of them (llmproxy's CPU per event over nginx's). When the
machine speeds up or slows down between their turns, the ratio moves with it: one run
here measured llmproxy's events at 37.2 ms of CPU per 1,000 and nginx's at 17.3
(32 to 35 and 19 to 22 in most runs), 2.15x, where the paced phase of the same run had
1.62x. The latency phases already interleave their targets request by request for this
reason. The cpu phase runs in the order A B C, C B A, A B C, C B A instead (a quick
run: A B C, C B A), so a drift over the phase falls on every target alike, and each
target's figures are pooled over its passes: its CPU over all its steady windows per
event of all. Two passes were not enough: over 72 runs here (two passes each, the code
of several rounds) one target's two passes differed by 7 % at the median, the ratio of
a single pass had a standard deviation of 0.15 and the ratio pooled over two 0.11,
about a tenth of the budget's limit.
"""

from __future__ import annotations

from typing import Any

MIRRORED = frozenset({"cpu"})

# Per-event figures pooled over the passes, each weighted by its count of events.
_STEADY = ("steady_cpu_ms_per_1k", "steady_events")
_WHOLE = ("cpu_ms_per_1k", "engine_cpu_ms_per_1k", "client_cpu_ms_per_1k")
# The worse pass's.
_WORST = ("lag_p50_ms", "lag_p99_ms", "lag_max_ms", "steady_lag_p99_ms", "most_in_flight",
          "seconds", "steal_pct")
# Counted over both.
_SUMMED = ("events", "steady_events", "incomplete", "runqueue_wait_ms")


def _pooled(passes: list[dict[str, Any]], key: str, weight: str) -> float | None:
    pairs = [(p.get(key), p.get(weight) or 0) for p in passes]
    if any(value is None for value, _ in pairs):
        return None
    events = sum(w for _, w in pairs)
    return round(sum(v * w for v, w in pairs) / events, 2) if events else None


def _worst(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _summed(values: list[Any]) -> Any:
    return None if any(v is None for v in values) else round(sum(values), 3)


def pooled(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's phase figures from its passes (each as `_paced_phase` gives
    them), with the passes themselves under "passes"."""
    out = dict(passes[0])
    out["steady_cpu_ms_per_1k"] = _pooled(passes, *_STEADY)
    for key in _WHOLE:
        out[key] = _pooled(passes, key, "events")
    for key in _WORST:
        out[key] = _worst([p.get(key) for p in passes])
    for key in _SUMMED:
        out[key] = _summed([p.get(key) for p in passes])
    out["kept_up"] = all(p.get("kept_up", True) for p in passes)
    out["passes"] = passes
    return out


def turns(phase: str, names: list[str], rounds: int) -> list[str]:
    """The order the targets take a phase in: once each, or for a mirrored phase
    `rounds` times forwards and backwards."""
    return (names + names[::-1]) * rounds if phase in MIRRORED else names
