"""The engines' process groups: whether one lives, whether it is still ours, and ending
several at once (SIGTERM to each, SIGKILL to those left after the grace).

An engine runs as the leader of its own session, so its pid is its process group. A record
names the pid and the leader's start time: a pid reused by another process is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from typing import Any

TICK = 0.05  # process poll interval while a stop waits
KILL_WAIT = 60.0  # how long a SIGKILLed group may take to vanish (GPU drivers can be slow)
_HAVE_PROC = os.path.exists("/proc/self/stat")


def _ps(*args: str) -> str:
    """Output of ``ps`` (only used where there is no /proc), empty when it cannot run."""
    try:
        return subprocess.run(["ps", *args], capture_output=True, text=True, check=False,
                              timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def proc_stat(pid: int) -> tuple[str, int, str] | None:
    """(state letter, process group, start time) of a process, or None if there is none."""
    if _HAVE_PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read().decode("ascii", "replace")
        except OSError:
            return None
        fields = data[data.rindex(")") + 2:].split()  # the command name may hold spaces
        return fields[0], int(fields[2]), fields[19]
    parts = _ps("-o", "stat=,pgid=,lstart=", "-p", str(pid)).split(None, 2)
    return (parts[0][0], int(parts[1]), parts[2].strip()) if len(parts) == 3 else None


def _live_stat(pid: int) -> tuple[str, int, str] | None:
    stat = proc_stat(pid)
    return stat if stat is not None and stat[0] not in "ZX" else None  # a zombie has exited


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group ``pgid``."""
    if _HAVE_PROC:
        pids = [pgid, *(int(n) for n in os.listdir("/proc") if n.isdigit() and n != str(pgid))]
        return any((s := _live_stat(pid)) is not None and s[1] == pgid for pid in pids)
    rows = (line.split() for line in _ps("-A", "-o", "pgid=,stat=").splitlines())
    return any(len(r) == 2 and r[0] == str(pgid) and r[1][0] not in "ZX" for r in rows)


def leader_alive(record: dict[str, Any]) -> bool:
    """Whether the recorded pid is alive and is the very process we started (not a reused pid)."""
    stat = _live_stat(record["pid"])
    return stat is not None and stat[2] == record.get("starttime")


def ours(record: dict[str, Any]) -> bool:
    """Whether signalling the recorded process group can only reach what we started."""
    stat = _live_stat(record["pid"])
    if stat is not None:
        return stat[2] == record.get("starttime")
    # The leader is gone; its group id cannot be reused while members of the group live.
    return group_alive(record["pid"])


def _reap(pgid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pgid, os.WNOHANG)  # reap it when it is our own child


def _wait_gone(pgids: set[int], deadline: float) -> set[int]:
    """Wait until every group in ``pgids`` is gone or the deadline passes; those left."""
    left = set(pgids)
    while True:
        for pgid in list(left):
            _reap(pgid)
            if not group_alive(pgid):
                left.discard(pgid)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(TICK)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def terminate(pgids: Iterable[int], grace: float) -> set[int]:
    """SIGTERM every process group in ``pgids`` at once, SIGKILL those left after ``grace`` s;
    the groups that needed SIGKILL. Raises OSError naming the groups still alive
    KILL_WAIT s after SIGKILL (the others are gone)."""
    groups = set(pgids)
    for pgid in groups:
        _killpg(pgid, signal.SIGTERM)
    stubborn = _wait_gone(groups, time.monotonic() + grace)
    for pgid in stubborn:
        _killpg(pgid, signal.SIGKILL)
    stuck = _wait_gone(stubborn, time.monotonic() + KILL_WAIT)
    if stuck:
        names = ", ".join(str(pgid) for pgid in sorted(stuck))
        raise OSError(f"process group {names} still alive {KILL_WAIT:g} s after SIGKILL")
    return stubborn
