"""The agent's ``status`` and ``stop`` orders, and what every order shares: reading its
fields, health checks, and stopping recorded engines (the ``start`` order is `start`).

Each order runs under the host's lock (`state.locked`) and returns its answer as a dict.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from llmproxy.agent import exits, kvcache
from llmproxy.agent.processes import group_alive, leader_alive, terminate
from llmproxy.agent.protocol import KV_CACHE, SAVE_KV
from llmproxy.agent.state import NAME, STOPPING, Record, forget, load, records, save

JSONDict = dict[str, Any]

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


def stop_records(sd: Path, doomed: list[Record], grace: float,
                 keep_for: frozenset[str] = frozenset()) -> list[JSONDict]:
    """Stop the engines of ``doomed`` all at once (SIGTERM, SIGKILL after ``grace``) and forget
    them; what was stopped, as ``{"engine", "pid", "killed"}``. The kept prompt caches of the
    engines named in ``keep_for`` that still run are saved first (`kvcache.save_all`, bounded),
    each one's result in its entry's ``kv_cache``. Each is marked ``stopping``
    first and its exit record removed before it is forgotten, so the watch never reports a
    stop as an exit. A record whose leader is already dead was not stopped by this order: it
    is buried (`exits.bury`), its exit left for the watch. When a group outlives its SIGKILL,
    its record is kept and the OSError raised."""
    live = [r for r in doomed if leader_alive(r)]
    exits.bury(sd, [r for r in doomed if r not in live])
    kept = kvcache.save_all([r for r in live if r["engine"] in keep_for])
    for r in live:
        with contextlib.suppress(OSError):  # a full disk must not keep an engine running
            save(sd, {**r, "state": STOPPING})
    try:
        killed = terminate([r["pid"] for r in live], grace)
    except OSError:
        for r in live:
            if not group_alive(r["pid"]):
                _forget(sd, r)
        raise
    for r in live:
        _forget(sd, r)
    return [{"engine": r["engine"], "pid": r["pid"], "killed": r["pid"] in killed,
             **({KV_CACHE: kept[r["engine"]]} if r["engine"] in kept else {})} for r in live]


def _forget(sd: Path, record: Record) -> None:
    exits.discard(sd, record)  # first: an exit record without its record is a crash's
    forget(sd, record["engine"])


def living(sd: Path) -> list[Record]:
    """Every recorded engine whose main process lives, oldest start first; the others are
    buried (what is left of them stopped, a crash's exit kept for the watch)."""
    found = records(sd)
    dead = [r for r in found if not leader_alive(r)]
    if dead:
        exits.bury(sd, dead)
    return [r for r in found if r not in dead]


def check_all(urls: list[Any], timeout: float = 2.0) -> list[bool]:
    """Whether each of ``urls`` answers 200 (`healthy`), all checked at once; a check still
    running a second past ``timeout`` counts as unhealthy (its daemon thread is left behind,
    so it never holds up the agent's exit)."""
    results = [False] * len(urls)

    def check(i: int, url: str) -> None:
        results[i] = healthy(url, timeout)

    threads = [threading.Thread(target=check, args=(i, url), daemon=True)
               for i, url in enumerate(urls) if isinstance(url, str)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout + 1.0
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return list(results)


def entries(found: list[Record]) -> list[JSONDict]:
    """The status entries of ``found``, their health checked all at once."""
    health = check_all([r.get("health_url") for r in found])
    return [{"engine": r["engine"], "pid": r["pid"], "engine_pid": r.get("engine_pid", r["pid"]),
             "command": r.get("command"), "health_url": r.get("health_url"), "healthy": ok,
             "started_at": r.get("started_at")} for r, ok in zip(found, health)]


def op_status(sd: Path, order: JSONDict) -> JSONDict:
    """Every engine that runs, each with whether its health URL answers 200, and the lease's
    holder (its record, or None while no proxy holds it)."""
    from llmproxy.agent.lease import current

    return {"ok": True, "engines": entries(living(sd)), "lease": current(sd)}


def op_stop(sd: Path, order: JSONDict) -> JSONDict:
    """Stop the engine the order names, or every engine when it names none; a named engine that
    does not run is no error (``"stopped": []``). With ``save_kv`` the kept prompt caches are
    saved first."""
    grace = number(order, "grace", 10.0)
    if order.get("engine") is None:
        doomed = records(sd)
    else:
        record = load(sd, engine_name(order["engine"]))
        doomed = [] if record is None else [record]
    kept = frozenset(r["engine"] for r in doomed) if order.get(SAVE_KV) is True else frozenset()
    return {"ok": True, "stopped": stop_records(sd, doomed, grace, kept)}
