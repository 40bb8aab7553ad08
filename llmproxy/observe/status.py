"""The `GET /status` document: what an operator needs to see at a glance."""

from __future__ import annotations

import os
from typing import Any

from llmproxy import __version__
from llmproxy.config import Config
from llmproxy.hosts.roster import HostRoster
from llmproxy.observe.eventstream import EventLog
from llmproxy.observe.inflight import InFlight


def status_doc(*, state: str, events: EventLog, config: Config, rosters: dict[str, HostRoster],
               inflight: InFlight, now: float, started: float, ready: bool, listening: str | None,
               engines: dict[str, dict[str, Any]], config_state: dict[str, Any],
               stopping: bool, upgrade: dict[str, Any],
               capacity: dict[str, dict[str, Any]] | None = None,
               models: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Version, pid, uptime, each host's roster, engine and trouble, the requests in
    flight, the config's generation and last reload, and the upgrade's state."""

    def ago(t: float | None) -> float | None:
        return None if t is None else round(now - t, 3)

    hosts = []
    for host in config.hosts:
        roster = rosters.get(host.name, HostRoster())
        hosts.append({
            "name": host.name,
            "url": host.url,
            "managed": host.managed,
            "roster": {
                "state": ("never read" if roster.generation == 0
                          else "failed" if roster.last_error_at is not None
                          and roster.last_error_at >= (roster.fetched_at or 0) else "ok"),
                "generation": roster.generation,
                "models": [e.id for e in roster.models],
                "fetched_seconds_ago": ago(roster.fetched_at),
                "last_error": roster.last_error,
                "last_error_seconds_ago": ago(roster.last_error_at),
            },
            "engine": engines.get(host.name),
            "capacity": (capacity or {}).get(host.name),
        })
    return {
        "version": __version__,
        "time": now,
        "pid": os.getpid(),
        "uptime_seconds": round(now - started, 3),
        "ready": ready,
        "state": state,
        "last_event_id": events.last_id,
        "event_streams": events.streams,
        "listening": listening,
        "hosts": hosts,
        "in_flight": inflight.snapshot(),
        "models": models or [],
        "config": config_state,
        "stopping": stopping,
        **upgrade,
    }
