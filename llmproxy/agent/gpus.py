"""The GPUs' figures for the watch's ``gpu`` events, read from ``nvidia-smi`` (where it is on
PATH): memory used and total in bytes, utilization as a ratio from 0 to 1, temperature in
degrees Celsius, power in watts; a figure the driver does not give (``[N/A]``) is null.

Trouble (nvidia-smi failing, hanging, or printing what cannot be read) is a `Problem` with a
`key` that names the kind of trouble, so the watch warns once per kind, not once per sample.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Callable
from typing import Any

QUERY = ["--query-gpu=index,name,memory.used,memory.total,utilization.gpu,temperature.gpu,"
         "power.draw", "--format=csv,noheader,nounits"]
APPS_QUERY = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
TIMEOUT = 10.0  # nvidia-smi can be slow while the driver is busy, never this slow
MIB = 1024 * 1024
_FIGURES = (  # (column, event field, factor, whole number)
    ("memory.used", "memory_used_bytes", MIB, True),
    ("memory.total", "memory_total_bytes", MIB, True),
    ("utilization.gpu", "utilization_ratio", 0.01, False),
    ("temperature.gpu", "temperature_celsius", 1, False),
    ("power.draw", "power_watts", 1, False),
)


class Problem(Exception):
    """nvidia-smi gave no figures: ``key`` names the kind of trouble, str() says it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class AppsProblem(Problem):
    """The per-process query (APPS_QUERY) gave no figures."""


def _figure(text: str, column: str, line: str) -> float | None:
    if text.startswith("[") or text in ("N/A", ""):  # [N/A], [Not Supported], [Unknown Error]
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise Problem(f"value:{column}", f"nvidia-smi gave {column} as {text!r} in "
                                         f"{line[:200]!r}: not a number")
    return value


def parse(text: str) -> list[dict[str, Any]]:
    """The GPUs of nvidia-smi's CSV answer to QUERY; a Problem when a line cannot be read."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 2 + len(_FIGURES) or not fields[0].isdigit():
            raise Problem("fields", f"nvidia-smi printed {line[:200]!r}: expected an index, "
                                    "a name and 5 figures, comma-separated")
        gpu: dict[str, Any] = {"index": int(fields[0]),
                               "name": ", ".join(fields[1:-len(_FIGURES)])}
        for text_value, (column, key, factor, whole) in zip(
                fields[-len(_FIGURES):], _FIGURES):
            value = _figure(text_value, column, line)
            gpu[key] = None if value is None else (
                int(value * factor) if whole else round(value * factor, 4))
        gpus.append(gpu)
    return gpus


def parse_apps(text: str) -> dict[int, int]:
    """pid -> GPU memory used in bytes, from nvidia-smi's answer to APPS_QUERY (a process on
    several GPUs: summed). A line that is not ``PID, MIB`` is a Problem; a figure the driver
    does not give (``[N/A]``) leaves its process out."""
    used: dict[int, int] = {}
    for line in text.splitlines():
        if not line.strip() or line.strip().startswith("No running"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2 or not fields[0].isdigit():
            raise Problem("apps", f"nvidia-smi printed {line[:200]!r}: expected a pid and "
                                  "its used memory, comma-separated")
        value = _figure(fields[1], "used_memory", line)
        if value is not None and value >= 0:
            pid = int(fields[0])
            used[pid] = used.get(pid, 0) + int(value * MIB)
    return used


def by_group(used: dict[int, int], group_of: Callable[[int], int | None],
             groups: dict[int, str]) -> dict[str, int]:
    """engine -> bytes: the processes of ``used`` whose process group (``group_of``) is an
    engine's (``groups``: pgid -> engine), summed; an engine none belongs to is left out."""
    out: dict[str, int] = {}
    for pid, figure in used.items():
        engine = groups.get(group_of(pid) or -1)
        if engine is not None:
            out[engine] = out.get(engine, 0) + figure
    return out


def sample_apps(executable: str, timeout: float = TIMEOUT) -> dict[int, int]:
    """Run nvidia-smi's per-process query once: pid -> bytes, or an AppsProblem."""
    try:
        return parse_apps(_run(executable, APPS_QUERY, timeout))
    except Problem as problem:
        raise AppsProblem(problem.key, str(problem)) from None


def sample(executable: str, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
    """Run nvidia-smi once: the GPUs' figures, or a Problem."""
    return parse(_run(executable, QUERY, timeout))


def _run(executable: str, query: list[str], timeout: float) -> str:
    try:
        done = subprocess.run([executable, *query], capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise Problem("timeout", f"nvidia-smi gave no answer within {timeout:g} s") from None
    except OSError as e:
        raise Problem("run", f"cannot run {executable}: {e.strerror or e}") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()[:1]
        raise Problem(f"exit:{done.returncode}", f"nvidia-smi exited with status "
                      f"{done.returncode}" + (f": {said[0][:200]}" if said else ""))
    return done.stdout
