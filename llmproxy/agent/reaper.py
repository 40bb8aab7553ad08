"""The reaper: the leader of an engine's process group, so the engine's end is known even
though the engine outlives the agent call that started it.

The agent runs ``python -I .../llmproxy/agent/reaper.py [--report-fd FD] EXIT_FILE -- CMD...``
in a session of its own (its pid is the engine's process group). The reaper runs CMD in that
group, its output going where the reaper's goes (the engine's log), reports on FD the line
``{"engine_pid": N}`` (or ``{"error": "..."}`` when CMD cannot run, then exits 127), waits for
CMD, writes EXIT_FILE atomically, ``{"pid", "engine_pid", "exit_status", "signal", "at"}``, and
exits with the engine's status (128 + the signal when a signal ended it). It appends one line
saying how the engine ended to the log, for a person reading it.

It imports nothing of llmproxy and is run as a file in isolated mode, so it depends on no
``sys.path``. SIGTERM, SIGINT and SIGHUP only wake it (a handler, not SIG_IGN, so the engine
does not inherit ignoring them): a stop signals the whole group, and the reaper must outlive
the engine to record its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any


def _ignore(signum: int, frame: object) -> None:
    """A stop reaches the engine through its group; the reaper stays to record the end."""


def _report(fd: int | None, message: dict[str, Any]) -> None:
    if fd is None:
        return
    try:
        os.write(fd, (json.dumps(message) + "\n").encode())
        os.close(fd)
    except OSError:
        pass  # the agent went away: the engine still runs, and its end is still recorded


def _write(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _parse(argv: list[str]) -> tuple[int | None, str, list[str]]:
    fd = None
    if argv[:1] == ["--report-fd"] and len(argv) > 1:
        fd, argv = int(argv[1]), argv[2:]
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: reaper.py [--report-fd FD] EXIT_FILE -- COMMAND...")
    return fd, argv[0], argv[2:]


def main(argv: list[str]) -> int:
    """Run the engine, wait for it, record how it ended; the engine's exit status."""
    fd, exit_file, command = _parse(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _ignore)
    try:
        engine = subprocess.Popen(command, stdin=subprocess.DEVNULL, close_fds=True)
    except OSError as e:
        _report(fd, {"error": str(e.strerror or e)})
        return 127
    _report(fd, {"engine_pid": engine.pid})
    status = engine.wait()
    code, signum = (status, None) if status >= 0 else (None, -status)
    doc = {"pid": os.getpid(), "engine_pid": engine.pid, "exit_status": code, "signal": signum,
           "at": time.time()}
    how = f"status {code}" if code is not None else f"signal {signum}"
    with contextlib.suppress(OSError, ValueError):  # before the exit file: its tail has it
        print(f"--- llmproxy-agent {time.strftime('%Y-%m-%d %H:%M:%S')}: the engine (pid "
              f"{engine.pid}) exited with {how}", flush=True)
    try:
        _write(exit_file, doc)
    except OSError as e:
        print(f"llmproxy-agent reaper: cannot write {exit_file}: {e}", file=sys.stderr)
    return code if code is not None else 128 + (signum or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
