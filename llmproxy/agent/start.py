"""The agent's ``start`` order: start one engine detached in its own session, under its
reaper (`reaper`, the session's leader, which records how the engine ends), and wait until its
health URL answers 200. The record says ``starting`` until then, ``running`` after.

An ``exclusive`` start stops every other engine first (a host that runs one at a time); any
start leaves the others running otherwise. Starting an engine that runs healthy with the same
command answers at once; one that runs otherwise is restarted. A start refuses when its port
is taken: by another engine of this agent (named), or by a process the agent did not start.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

from llmproxy.agent import exits, kvcache
from llmproxy.agent.logs import LOG_ROTATE_BYTES, rotate, tail
from llmproxy.agent.orders import (
    BadInput,
    JSONDict,
    engine_name,
    healthy,
    living,
    number,
    stop_records,
)
from llmproxy.agent.processes import group_alive, leader_alive, proc_stat, terminate
from llmproxy.agent.protocol import KV_CACHE, SAVE_KV, exit_text, returncode_exit
from llmproxy.agent.state import (
    RUNNING,
    STARTING,
    forget,
    load,
    log_path,
    records,
    save,
    state_of,
)

POLL = 0.2  # health poll interval while a start waits
REAPER = Path(__file__).with_name("reaper.py")  # run as a file: it needs no sys.path
REPORT_TIMEOUT = 30.0  # how long the reaper may take to say it started the engine
# Signals received during this call (the agent's handlers add them): a start gives up and
# cleans up; a stop finishes first.
interrupted: list[int] = []


def _fields(order: JSONDict) -> tuple[str, list[str], str, bool, kvcache.Keep | None]:
    engine, command, url = order.get("engine"), order.get("command"), order.get("health_url")
    engine = engine_name(engine)
    if (not isinstance(command, list) or not command
            or not all(isinstance(a, str) for a in command)):
        raise BadInput(f"command must be a non-empty list of strings, got {command!r}")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise BadInput(f"health_url must be an http(s) URL, got {url!r}")
    exclusive = order.get("exclusive", False)
    if not isinstance(exclusive, bool):
        raise BadInput(f"exclusive must be true or false, got {exclusive!r}")
    try:
        keep = kvcache.of_order(order)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if keep is not None and kvcache.slot_dir(command) is None:
        raise BadInput(f"{KV_CACHE} needs {kvcache.SLOT_FLAG} DIR in the command")
    return engine, command, url, exclusive, keep


def _await_health(sd: Path, engine: str, proc: subprocess.Popen[bytes], url: str,
                  timeout: float) -> str | None:
    """None once ``url`` answers 200, else why the engine will not become healthy."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            return _ended(sd, engine, proc)
        if interrupted:
            return f"interrupted by signal {signal.Signals(interrupted[0]).name}"
        left = deadline - time.monotonic()
        if left <= 0:
            return f"not healthy within {timeout:g} s (no 200 from {url})"
        if healthy(url, min(2.0, max(left, 0.1))) and proc.poll() is None:
            return None
        time.sleep(max(0.0, min(POLL, deadline - time.monotonic())))


def _port_taken(sd: Path, engine: str, url: str) -> str | None:
    """Why ``engine`` cannot listen where ``url`` points, or None."""
    where = urlsplit(url).netloc
    for other in living(sd):
        if other["engine"] != engine and urlsplit(str(other.get("health_url"))).netloc == where:
            return (f"{url} is the port of engine {other['engine']} (pid {other['pid']}), "
                    f"which this agent runs: stop it first or give {engine} a port of its own")
    if healthy(url, 1.0):
        return f"{url} answers before {engine} was started: another process holds its port"
    return None


def op_start(sd: Path, order: JSONDict) -> JSONDict:
    """Start the order's engine (after stopping every other one when ``exclusive``) and wait
    until it is healthy; the answer lists the engines stopped on the way (``stopped``). The
    others' kept prompt caches are saved first when the order says ``save_kv``; a kept
    engine's own are restored once it is healthy (`kvcache`)."""
    engine, command, url, exclusive, keep = _fields(order)
    timeout = number(order, "timeout", 120.0, minimum=0.001)
    grace = number(order, "grace", 10.0)
    current = load(sd, engine)
    reuse = (current is not None and current.get("command") == command
             and leader_alive(current) and healthy(url))
    doomed = [r for r in records(sd)
              if (r["engine"] == engine and not reuse) or (r["engine"] != engine and exclusive)]
    others = frozenset(r["engine"] for r in doomed
                       if r["engine"] != engine and order.get(SAVE_KV) is True)
    stopped = stop_records(sd, doomed, grace, others)
    if reuse:
        assert current is not None
        kept = {KV_CACHE: kvcache.keep_field(keep, command, current)} if keep is not None else {}
        if state_of(current) != RUNNING or current.get(KV_CACHE) != kept.get(KV_CACHE):
            # its own start died before it saw it healthy, or it is kept now and was not
            save(sd, {**{k: v for k, v in current.items() if k != KV_CACHE}, **kept,
                      "state": RUNNING})
        return {"ok": True, "engine": engine, "pid": current["pid"],
                "engine_pid": current.get("engine_pid", current["pid"]), "healthy": True,
                "elapsed": 0.0, "already_running": True, "stopped": stopped}
    log = log_path(sd, engine)
    taken = _port_taken(sd, engine, url)
    if taken is not None:
        return {"ok": False, "error": taken, "log_tail": tail(log), "stopped": stopped}
    return {**_launch(sd, engine, command, url, timeout, grace, keep), "stopped": stopped}


def _spawn(sd: Path, engine: str, command: list[str],
           out: BinaryIO) -> tuple[subprocess.Popen[bytes], int] | str:
    """Start ``command`` under its reaper (the leader of a new session, writing to ``out``):
    the reaper and the engine's pid, or why the command cannot run."""
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(REAPER), "--report-fd", str(write_end),
             str(exits.exit_path(sd, engine)), "--", *command],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, pass_fds=(write_end,))
    except OSError as e:
        os.close(read_end)
        return f"cannot run {sys.executable!r}: {e.strerror or e}"
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as report:
        ready, _, _ = select.select([report], [], [], REPORT_TIMEOUT)
        line = report.readline() if ready else b""
    try:
        said = json.loads(line)
    except ValueError:
        said = {}
    if isinstance(said, dict) and type(said.get("engine_pid")) is int:
        return proc, said["engine_pid"]
    if proc.poll() is None:
        terminate([proc.pid], 0)
    proc.wait()
    error = said.get("error") if isinstance(said, dict) else None
    return (f"cannot run {command[0]!r}: {error}" if isinstance(error, str)
            else f"its reaper did not start it ({exit_text(*returncode_exit(proc.returncode))})")


def _ended(sd: Path, engine: str, proc: subprocess.Popen[bytes]) -> str:
    """How the engine of the reaper ``proc`` (which has exited) ended."""
    doc = exits.of(sd, {"engine": engine, "pid": proc.pid})
    if doc is None or (doc.get("exit_status") is None and doc.get("signal") is None):
        return f"exited ({exit_text(*returncode_exit(proc.returncode))})"
    if doc.get("signal") is not None:
        return f"exited ({exit_text(None, int(doc['signal']))})"
    return f"exited ({exit_text(int(doc['exit_status']), None)})"


def _launch(sd: Path, engine: str, command: list[str], url: str, timeout: float,
            grace: float, keep: kvcache.Keep | None = None) -> JSONDict:
    """Run ``command`` detached, record it, wait for its health (then restore its kept prompt
    cache, if any); stop and forget it on failure."""
    log = log_path(sd, engine)
    rotate(log, LOG_ROTATE_BYTES)
    started = time.monotonic()
    with open(log, "ab") as out:
        out.write(f"--- llmproxy-agent {time.strftime('%Y-%m-%d %H:%M:%S')}: starting "
                  f"{engine}: {shlex.join(command)}\n".encode())
        out.flush()
        spawned = _spawn(sd, engine, command, out)
    if isinstance(spawned, str):
        return {"ok": False, "error": spawned, "log_tail": tail(log)}
    proc, engine_pid = spawned
    stat = proc_stat(proc.pid)  # our unreaped child: present even if it already exited
    record = {"engine": engine, "pid": proc.pid, "engine_pid": engine_pid,
              "starttime": stat[2] if stat else None, "command": command, "health_url": url,
              "started_at": time.time(), "state": STARTING,
              **({KV_CACHE: kvcache.keep_field(keep, command)} if keep is not None else {})}
    try:
        save(sd, record)  # before waiting: a later call can stop it if we die meanwhile
    except OSError:
        terminate([proc.pid], grace)  # unrecorded, it would be an orphan
        raise
    error = _await_health(sd, engine, proc, url, timeout)
    if error is None:
        restored = kvcache.restore(record)
        save(sd, {**record, "state": RUNNING})
        return {"ok": True, "engine": engine, "pid": proc.pid, "engine_pid": engine_pid,
                "healthy": True, "elapsed": round(time.monotonic() - started, 3),
                "already_running": False,
                **({KV_CACHE: restored} if restored is not None else {})}
    if proc.poll() is None or group_alive(proc.pid):  # unreaped, or its group: still ours
        terminate([proc.pid], grace)
    exits.discard(sd, record)
    forget(sd, engine)
    return {"ok": False, "error": f"{engine} {error}", "pid": proc.pid, "log_tail": tail(log)}
