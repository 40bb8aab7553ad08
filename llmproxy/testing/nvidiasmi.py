"""A fake ``nvidia-smi`` for the agent's GPU telemetry: an executable script in a directory
of its own (put first on PATH, `FakeNvidiaSmi.path_env`) that answers what the agent asks from
files a test changes while the agent runs: GPU rows (`gpus`), any text (`prints`, a broken
answer) or a failure (`fails`: a message on stderr and an exit status); the per-process
query's rows (`apps`: pid -> used MiB, none until told). Each call's arguments are appended to
`calls`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_SCRIPT = """#!/bin/sh
d="$(dirname "$0")"
printf '%s\\n' "$*" >> "$d/calls"
if [ -f "$d/fail" ]; then
    cat "$d/fail" >&2
    exit "$(cat "$d/status")"
fi
case "$1" in
    --query-compute-apps=*) cat "$d/apps" 2>/dev/null ;;
    *) cat "$d/out" ;;
esac
"""


@dataclass(frozen=True)
class GPU:
    """One GPU's row as nvidia-smi prints it (figures as text, so ``[N/A]`` can be one)."""

    index: int = 0
    name: str = "NVIDIA GeForce RTX 4090"
    memory_used_mib: str = "1024"
    memory_total_mib: str = "24564"
    utilization_percent: str = "37"
    temperature: str = "45"
    power_watts: str = "123.45"

    def row(self) -> str:
        return ", ".join([str(self.index), self.name, self.memory_used_mib,
                          self.memory_total_mib, self.utilization_percent, self.temperature,
                          self.power_watts])


class FakeNvidiaSmi:
    """``nvidia-smi`` in ``directory`` (created), answering one GPU until told otherwise."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.executable = directory / "nvidia-smi"
        self.executable.write_text(_SCRIPT)
        self.executable.chmod(0o755)
        self.gpus([GPU()])

    def _write(self, name: str, text: str) -> None:
        tmp = self.directory / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.directory / name)  # never half a file to the script

    def gpus(self, gpus: list[GPU]) -> None:
        """Answer these GPUs (and stop failing)."""
        self.prints("".join(g.row() + "\n" for g in gpus))

    def prints(self, text: str) -> None:
        """Answer ``text`` with status 0 (and stop failing)."""
        self._write("out", text)
        (self.directory / "fail").unlink(missing_ok=True)

    def apps(self, used_mib: Mapping[int, int | str]) -> None:
        """Answer the per-process query (``--query-compute-apps``) with these processes and
        their used memory in MiB (text, so ``[N/A]`` or garbage can be one)."""
        self._write("apps", "".join(f"{pid}, {mib}\n" for pid, mib in used_mib.items()))

    def apps_text(self, text: str) -> None:
        """Answer the per-process query with ``text`` as is."""
        self._write("apps", text)

    def fails(self, message: str, status: int = 9) -> None:
        """Print ``message`` on stderr and exit ``status`` from now on."""
        self._write("status", str(status))
        self._write("fail", message + "\n")

    @property
    def calls(self) -> list[str]:
        """The arguments of each call so far, one string per call."""
        try:
            return (self.directory / "calls").read_text().splitlines()
        except FileNotFoundError:
            return []

    def path_env(self, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """``environ`` with this directory first on PATH."""
        path = environ.get("PATH", os.defpath)
        return {**environ, "PATH": f"{self.directory}{os.pathsep}{path}"}
