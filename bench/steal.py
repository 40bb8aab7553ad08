"""The virtual machine's steal time over a phase: how much of the machine's CPU time
the hypervisor gave to someone else (/proc/stat's `cpu` line, its eighth field).

The budgets are ratios of targets measured in the same run, but one target's turn
can still fall on a stretch where the host takes the VM's CPUs away: a run here had
llmproxy at 0.85 ms of CPU per request where the other runs of the same code had
0.28 to 0.55. Each phase's figures carry the share stolen while they were
measured, so such a run says whether the machine was the cause.
"""

from __future__ import annotations

from pathlib import Path

STAT = Path("/proc/stat")


def parse_cpu_line(text: str) -> tuple[int, int] | None:
    """(steal, total) ticks of the whole machine from /proc/stat's text; None when
    it has no `cpu` line with a steal field (not Linux, or a kernel before 2.6.11)."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            try:
                ticks = [int(f) for f in fields[1:]]
            except ValueError:
                return None
            if len(ticks) < 8:
                return None
            # guest and guest_nice (9th, 10th) are already counted in user and nice.
            return ticks[7], sum(ticks[:8])
    return None


def sample(path: Path = STAT) -> tuple[int, int] | None:
    """The machine's (steal, total) ticks now; None when they cannot be read."""
    try:
        return parse_cpu_line(path.read_text())
    except OSError:
        return None


def stolen_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time stolen between two samples, in percent;
    None when either is missing or no time passed."""
    if before is None or after is None:
        return None
    total = after[1] - before[1]
    if total <= 0:
        return None
    return round(100 * (after[0] - before[0]) / total, 2)
