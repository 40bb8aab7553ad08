"""The agent's ``status`` and ``stop`` orders, and what every order shares: reading its
fields, health checks, and stopping recorded engines (the ``start`` order is `start`).

Each order runs under the host's lock (`state.locked`) and returns its answer as a dict.
"""

from __future__ import annotations

import http.client
import urllib.request
from pathlib import Path
from typing import Any

from llmproxy.agent.processes import group_alive, leader_alive, ours, terminate
from llmproxy.agent.state import NAME, Record, forget, load, records

JSONDict = dict[str, Any]

STALE_GRACE = 2.0  # grace for leftovers of an engine whose main process died
# Health checks go straight to the engine, never through an http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class BadInput(Exception):
    """An order the agent cannot act on; answered with exit status 2."""


def healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers HTTP 200 to a GET within ``timeout`` seconds."""
    try:
        with _OPENER.open(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (OSError, http.client.HTTPException, ValueError):
        return False


def number(order: JSONDict, key: str, default: float, minimum: float = 0.0) -> float:
    """The order's number ``key`` (``default`` when absent), at least ``minimum``."""
    value = order.get(key, default)
    if type(value) not in (int, float) or not minimum <= value < float("inf"):
        raise BadInput(f"{key} must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def engine_name(value: object) -> str:
    """An engine's name as an order gives it (it names the engine's record and log files)."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise BadInput(f"engine must be a name matching {NAME.pattern}, got {value!r}")
    return value


def stop_records(sd: Path, doomed: list[Record], grace: float) -> list[JSONDict]:
    """Stop the engines of ``doomed`` all at once (SIGTERM, SIGKILL after ``grace``) and forget
    them; what was stopped, as ``{"engine", "pid", "killed"}``. A record whose process group is
    no longer ours (a reused pid) is forgotten and never signalled. When a group outlives its
    SIGKILL, its record is kept and the OSError raised."""
    mine = [r for r in doomed if ours(r)]
    try:
        killed = terminate([r["pid"] for r in mine], grace)
    except OSError:
        for r in doomed:
            if r not in mine or not group_alive(r["pid"]):
                forget(sd, r["engine"])
        raise
    for r in doomed:
        forget(sd, r["engine"])
    return [{"engine": r["engine"], "pid": r["pid"], "killed": r["pid"] in killed} for r in mine]


def living(sd: Path) -> list[Record]:
    """Every recorded engine whose main process lives, oldest start first; what is left of
    the others is stopped (it would be an orphan) and their records forgotten."""
    found = records(sd)
    dead = [r for r in found if not leader_alive(r)]
    if dead:
        stop_records(sd, dead, STALE_GRACE)
    return [r for r in found if r not in dead]


def op_status(sd: Path, order: JSONDict) -> JSONDict:
    """Every engine that runs, each with whether its health URL answers 200."""
    return {"ok": True, "engines": [
        {"engine": r["engine"], "pid": r["pid"], "command": r.get("command"),
         "health_url": r.get("health_url"),
         "healthy": isinstance(r.get("health_url"), str) and healthy(r["health_url"]),
         "started_at": r.get("started_at")}
        for r in living(sd)]}


def op_stop(sd: Path, order: JSONDict) -> JSONDict:
    """Stop the engine the order names, or every engine when it names none; a named engine that
    does not run is no error (``"stopped": []``)."""
    grace = number(order, "grace", 10.0)
    if order.get("engine") is None:
        doomed = records(sd)
    else:
        record = load(sd, engine_name(order["engine"]))
        doomed = [] if record is None else [record]
    return {"ok": True, "stopped": stop_records(sd, doomed, grace)}
