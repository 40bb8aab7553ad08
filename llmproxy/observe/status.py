"""The `GET /status` document: what an operator needs to see at a glance."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from llmproxy import __version__
from llmproxy.config import Config
from llmproxy.hosts.roster import HostRoster
from llmproxy.observe.eventstream import EventLog
from llmproxy.observe.inflight import InFlight


@dataclass(frozen=True)
class StatusView:
    """What `/status` shows, gathered by the root service at one instant (`now`):
    its state, the event log, the config in force and each host's roster, the
    requests in flight, when it started, whether it is ready and where it
    listens, each host's engine and capacity, the models' placement, the
    config's generation and last reload, whether it is stopping, and the
    upgrade's fields."""

    state: str
    events: EventLog
    config: Config
    rosters: dict[str, HostRoster]
    inflight: InFlight
    now: float
    started: float
    ready: bool
    listening: str | None
    engines: dict[str, dict[str, Any]]
    config_state: dict[str, Any]
    stopping: bool
    upgrade: dict[str, Any]
    capacity: dict[str, dict[str, Any]] | None = None
    models: list[dict[str, Any]] | None = None
    queues: dict[str, list[dict[str, Any]]] | None = None   # observe/queueview.py


def status_doc(view: StatusView) -> dict[str, Any]:
    """Version, pid, uptime, each host's roster, engine and trouble, the requests in
    flight, the config's generation and last reload, and the upgrade's state."""
    now = view.now

    def ago(t: float | None) -> float | None:
        return None if t is None else round(now - t, 3)

    hosts = []
    for host in view.config.hosts:
        roster = view.rosters.get(host.name, HostRoster())
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
            "engine": view.engines.get(host.name),
            "capacity": (view.capacity or {}).get(host.name),
            "queue": (view.queues or {}).get(host.name, []),
        })
    return {
        "version": __version__,
        "time": now,
        "pid": os.getpid(),
        "uptime_seconds": round(now - view.started, 3),
        "ready": view.ready,
        "state": view.state,
        "last_event_id": view.events.last_id,
        "event_streams": view.events.streams,
        "listening": view.listening,
        "hosts": hosts,
        "in_flight": view.inflight.snapshot(),
        "models": view.models or [],
        "config": view.config_state,
        "stopping": view.stopping,
        **view.upgrade,
    }
