"""The benchmark's arithmetic: percentiles, summaries, /proc readings turned into figures."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks.

    The same definition as numpy's default (`method="linear"`): rank `(n - 1) * q / 100`,
    interpolated between its two neighbours. Raises ValueError on no values.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not within 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = math.ceil(rank)
    if lo == hi:
        return ordered[lo]
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summary_ms(seconds: Sequence[float]) -> dict[str, float | int]:
    """n, p50, p99, mean and max of durations given in seconds, in milliseconds."""
    if not seconds:
        return {"n": 0}
    ms = [s * 1000.0 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 4),
        "p99_ms": round(percentile(ms, 99), 4),
        "mean_ms": round(sum(ms) / len(ms), 4),
        "max_ms": round(max(ms), 4),
    }


def per_thousand(cpu_seconds: float, events: int) -> float | None:
    """CPU milliseconds per 1,000 events (None when nothing was relayed)."""
    if events <= 0:
        return None
    return cpu_seconds * 1000.0 / events * 1000.0


def parse_cpu_ticks(stat: str) -> int:
    """utime + stime (clock ticks) from the text of /proc/PID/stat.

    The command name (field 2) is in parentheses and may hold spaces or parentheses,
    so fields are counted from the last `)`: field 3 (state) is the first after it,
    utime is field 14 and stime field 15.
    """
    rest = stat[stat.rindex(")") + 2:].split()
    return int(rest[11]) + int(rest[12])


def parse_status_kib(status: str, key: str) -> int | None:
    """A `Key:   1234 kB` value of /proc/PID/status, in KiB (None when absent)."""
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    return None
