"""llmproxy-agent: start, stop and report the one LLM engine of a GPU host.

Run as ``ssh -n TARGET llmproxy-agent status`` or with one JSON order on stdin
(``{"op": "start" | "status" | "stop", ...}``); it writes one JSON answer line on stdout and exits
0 when it answered (even ``"ok": false``), 2 for unusable input. Every call holds an exclusive
flock on ``<state_dir>/agent.lock``, so calls on one host run one at a time. Plain stdlib on
purpose: the GPU host needs no Twisted.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import http.client
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn, TextIO

JSONDict = dict[str, Any]

POLL = 0.2  # health poll interval while a start waits
TICK = 0.05  # process poll interval while a stop waits
KILL_WAIT = 60.0  # how long a SIGKILLed group may take to vanish (GPU drivers can be slow)
STALE_GRACE = 2.0  # grace for leftovers of an engine whose main process died
LOG_TAIL_LINES = 20
LOG_ROTATE_BYTES = 50 * 1024 * 1024
STATE = "engine.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HAVE_PROC = os.path.exists("/proc/self/stat")
# Health checks go straight to the engine, never through an http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_signalled: list[int] = []


class BadInput(Exception):
    """An order the agent cannot act on; answered with exit status 2."""


def state_dir(option: str | None, environ: Mapping[str, str] = os.environ) -> Path:
    """The state directory: ``--state-dir``, ``$LLMPROXY_AGENT_DIR``, the runtime dir, ~/.cache."""
    if option:
        return Path(option)
    if environ.get("LLMPROXY_AGENT_DIR"):
        return Path(environ["LLMPROXY_AGENT_DIR"])
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "llmproxy-agent"
    return Path.home() / ".cache" / "llmproxy-agent"


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


def leader_alive(state: JSONDict) -> bool:
    """Whether the recorded pid is alive and is the very process we started (not a reused pid)."""
    stat = _live_stat(state["pid"])
    return stat is not None and stat[2] == state.get("starttime")


def _ours(state: JSONDict) -> bool:
    """Whether signalling the recorded process group can only reach what we started."""
    stat = _live_stat(state["pid"])
    if stat is not None:
        return stat[2] == state.get("starttime")
    # The leader is gone; its group id cannot be reused while members of the group live.
    return group_alive(state["pid"])


def _wait_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pgid, os.WNOHANG)  # reap it when it is our own child
        if not group_alive(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(TICK)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def terminate(pgid: int, grace: float) -> bool:
    """SIGTERM a process group, SIGKILL it after ``grace`` s; True if SIGKILL was needed."""
    _killpg(pgid, signal.SIGTERM)
    if _wait_gone(pgid, grace):
        return False
    _killpg(pgid, signal.SIGKILL)
    if not _wait_gone(pgid, KILL_WAIT):
        raise OSError(f"process group {pgid} still alive {KILL_WAIT:g} s after SIGKILL")
    return True


def healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers HTTP 200 to a GET within ``timeout`` seconds."""
    try:
        with _OPENER.open(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (OSError, http.client.HTTPException, ValueError):
        return False


def load_state(sd: Path) -> JSONDict | None:
    """The recorded engine, or None; an unreadable record is removed."""
    try:
        state = json.loads((sd / STATE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        state = None
    if (isinstance(state, dict) and type(state.get("pid")) is int and state["pid"] > 1
            and isinstance(state.get("engine"), str)):
        return state
    clear_state(sd)
    return None


def save_state(sd: Path, state: JSONDict) -> None:
    """Record ``state`` atomically (a temporary file renamed over the old one)."""
    tmp = sd / f".{STATE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, sd / STATE)


def clear_state(sd: Path) -> None:
    """Forget the recorded engine."""
    (sd / STATE).unlink(missing_ok=True)


@contextlib.contextmanager
def locked(sd: Path) -> Iterator[None]:
    """Hold the host's agent lock (waiting for it) for the duration of the block."""
    fd = os.open(sd / "agent.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _number(order: JSONDict, key: str, default: float, minimum: float = 0.0) -> float:
    value = order.get(key, default)
    if type(value) not in (int, float) or not minimum <= value < float("inf"):
        raise BadInput(f"{key} must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def _stop(sd: Path, state: JSONDict | None, grace: float) -> JSONDict:
    if state is None:
        return {"ok": True, "stopped": None, "pid": None, "killed": False}
    ours = _ours(state)
    killed = terminate(state["pid"], grace) if ours else False
    clear_state(sd)
    return {"ok": True, "stopped": state["engine"] if ours else None,
            "pid": state["pid"] if ours else None, "killed": killed}


def op_stop(sd: Path, order: JSONDict) -> JSONDict:
    """Stop the recorded engine's process group (TERM, KILL after grace) and forget it."""
    grace = _number(order, "grace", 10.0)
    with locked(sd):
        return _stop(sd, load_state(sd), grace)


def op_status(sd: Path, order: JSONDict) -> JSONDict:
    """The recorded engine, whether it runs and whether its health URL answers 200."""
    with locked(sd):
        state = load_state(sd)
        if state is not None and not leader_alive(state):
            _stop(sd, state, STALE_GRACE)  # leftovers of a dead engine would be orphans
            state = None
        if state is None:
            return {"ok": True, "engine": None, "pid": None, "healthy": False, "command": None,
                    "started_at": None}
        return {"ok": True, "engine": state["engine"], "pid": state["pid"],
                "healthy": healthy(state["health_url"]), "command": state.get("command"),
                "started_at": state.get("started_at")}


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def _exit_text(status: int) -> str:
    if status >= 0:
        return f"exited with status {status}"
    try:
        return f"exited on signal {signal.Signals(-status).name}"
    except ValueError:
        return f"exited on signal {-status}"


def _await_health(proc: subprocess.Popen[bytes], url: str, timeout: float) -> str | None:
    """None once ``url`` answers 200, else why the engine will not become healthy."""
    deadline = time.monotonic() + timeout
    while True:
        status = proc.poll()
        if status is not None:
            return _exit_text(status)
        if _signalled:
            return f"interrupted by signal {signal.Signals(_signalled[0]).name}"
        left = deadline - time.monotonic()
        if left <= 0:
            return f"not healthy within {timeout:g} s"
        if healthy(url, min(2.0, max(left, 0.1))) and proc.poll() is None:
            return None
        time.sleep(max(0.0, min(POLL, deadline - time.monotonic())))


def _start_order(order: JSONDict) -> tuple[str, list[str], str]:
    engine, command, url = order.get("engine"), order.get("command"), order.get("health_url")
    if not isinstance(engine, str) or not _NAME.fullmatch(engine):
        raise BadInput(f"engine must be a name matching {_NAME.pattern}, got {engine!r}")
    if (not isinstance(command, list) or not command
            or not all(isinstance(a, str) for a in command)):
        raise BadInput(f"command must be a non-empty list of strings, got {command!r}")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise BadInput(f"health_url must be an http(s) URL, got {url!r}")
    return engine, command, url


def op_start(sd: Path, order: JSONDict) -> JSONDict:
    """Stop the previous engine, start this one detached, wait until it is healthy."""
    engine, command, url = _start_order(order)
    timeout = _number(order, "timeout", 120.0, minimum=0.001)
    grace = _number(order, "grace", 10.0)
    log = sd / f"engine-{engine}.log"
    with locked(sd):
        state = load_state(sd)
        if (state is not None and state["engine"] == engine and state.get("command") == command
                and leader_alive(state) and healthy(url)):
            return {"ok": True, "engine": engine, "pid": state["pid"], "healthy": True,
                    "elapsed": 0.0, "already_running": True}
        _stop(sd, state, grace)
        if healthy(url, 1.0):
            return {"ok": False, "error": f"{url} answers before {engine} was started: another "
                    "process holds its port", "log_tail": _tail(log)}
        with contextlib.suppress(OSError):
            if log.stat().st_size > LOG_ROTATE_BYTES:
                log.replace(log.with_name(log.name + ".1"))
        started = time.monotonic()
        with open(log, "ab") as out:
            out.write(f"--- llmproxy-agent {time.strftime('%Y-%m-%d %H:%M:%S')}: starting "
                      f"{engine}: {shlex.join(command)}\n".encode())
            out.flush()
            try:
                proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                return {"ok": False, "error": f"cannot run {command[0]!r}: {e.strerror or e}",
                        "log_tail": _tail(log)}
        stat = proc_stat(proc.pid)  # our unreaped child: present even if it already exited
        state = {"engine": engine, "pid": proc.pid, "starttime": stat[2] if stat else None,
                 "command": command, "health_url": url, "started_at": time.time()}
        try:
            save_state(sd, state)  # before waiting: a later call can stop it if we die meanwhile
        except OSError:
            terminate(proc.pid, grace)  # unrecorded, it would be an orphan
            raise
        error = _await_health(proc, url, timeout)
        if error is None:
            return {"ok": True, "engine": engine, "pid": proc.pid, "healthy": True,
                    "elapsed": round(time.monotonic() - started, 3), "already_running": False}
        if proc.poll() is None or group_alive(proc.pid):  # unreaped, or its group: still ours
            terminate(proc.pid, grace)
        clear_state(sd)
        return {"ok": False, "error": f"{engine} {error}", "pid": proc.pid,
                "log_tail": _tail(log)}


OPS = {"start": op_start, "status": op_status, "stop": op_stop}


def run(order: JSONDict, sd: Path) -> JSONDict:
    """Carry out one order in state directory ``sd`` (created 0700) and return the answer."""
    op = order.get("op")
    if op is None:
        raise BadInput("no op given: expected start, status or stop")
    if op not in OPS:
        raise BadInput(f"unknown op {op!r}: expected start, status or stop")
    sd.mkdir(mode=0o700, parents=True, exist_ok=True)
    return OPS[op](sd, order)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise BadInput(message)


def read_order(argv_op: str | None, stdin: TextIO | None) -> JSONDict:
    """The order: ``{"op": argv_op}`` updated by the JSON object on stdin, if any."""
    text = "" if stdin is None or stdin.isatty() else stdin.read()
    order: JSONDict = {} if argv_op is None else {"op": argv_op}
    if text.strip():
        try:
            given = json.loads(text)
        except ValueError as e:
            raise BadInput(f"stdin is not JSON: {e}") from None
        if not isinstance(given, dict):
            raise BadInput(f"stdin must hold one JSON object, got {type(given).__name__}")
        order.update(given)
    return order


def _on_signal(signum: int, frame: object) -> None:
    _signalled.append(signum)  # a start gives up and cleans up; a stop finishes first


def main(argv: list[str] | None = None, stdin: TextIO | None = None,
         stdout: TextIO | None = None) -> int:
    """Console script ``llmproxy-agent``: answer one order as one JSON line on stdout."""
    parser = _Parser(prog="llmproxy-agent", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("op", nargs="?", help="start, status or stop (else from the JSON)")
    parser.add_argument("--state-dir", help="where the engine record, lock and logs live")
    status = 0
    handlers: dict[int, Any] = {}
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        order = read_order(args.op, sys.stdin if stdin is None else stdin)
        _signalled.clear()
        with contextlib.suppress(ValueError):  # only the main thread may set handlers
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                handlers[sig] = signal.signal(sig, _on_signal)
        answer = run(order, state_dir(args.state_dir))
    except BadInput as e:
        answer, status = {"ok": False, "error": str(e)}, 2
    except OSError as e:
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    out = sys.stdout if stdout is None else stdout
    with contextlib.suppress(OSError):  # the caller may have gone away
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
