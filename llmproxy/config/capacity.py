"""The capacity keys of hosts.json, validated like the rest (`parse`): a host's
slots, queue, residency and preloaded engine, an engine's own slots and idle
stop. Every
error names its field."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

HOST_KEYS = ("max_concurrent", "max_queue", "queue_timeout_seconds", "min_engine_seconds",
             "preload")
ENGINE_KEYS = ("max_concurrent", "idle_stop_seconds")


class Checks(Protocol):
    """What these checks use of the config parser."""

    def error(self, path: str, message: str) -> None: ...

    def seconds(self, value: object, path: str, positive: bool = True) -> float: ...

    def positive_int(self, value: object, path: str) -> int | None: ...


def host_capacity(p: Checks, d: dict[str, Any], path: str,
                  engines: Collection[str]) -> dict[str, Any]:
    """The HostConfig fields of a host's capacity keys that are given."""
    out: dict[str, Any] = {}
    for key in ("max_concurrent", "max_queue"):
        if key in d:
            out[key] = p.positive_int(d[key], f"{path}.{key}")
    if "queue_timeout_seconds" in d:
        out["queue_timeout_seconds"] = p.seconds(d["queue_timeout_seconds"],
                                                 f"{path}.queue_timeout_seconds")
    if "min_engine_seconds" in d:
        out["min_engine_seconds"] = p.seconds(d["min_engine_seconds"],
                                              f"{path}.min_engine_seconds", positive=False)
    if "preload" in d:
        preload = d["preload"]
        if not isinstance(preload, str) or not preload:
            p.error(f"{path}.preload", "must be a non-empty string naming an engine")
        elif not engines:
            p.error(f"{path}.preload", "needs engines: only a managed host preloads")
        elif preload not in engines:
            p.error(f"{path}.preload", f"no engine {preload!r} on this host")
        else:
            out["preload"] = preload
    return out


def engine_capacity(p: Checks, d: dict[str, Any], path: str) -> dict[str, Any]:
    """The EngineConfig fields of an engine's capacity keys that are given."""
    out: dict[str, Any] = {}
    if "max_concurrent" in d:
        out["max_concurrent"] = p.positive_int(d["max_concurrent"], f"{path}.max_concurrent")
    if "idle_stop_seconds" in d:
        out["idle_stop_seconds"] = p.seconds(d["idle_stop_seconds"],
                                             f"{path}.idle_stop_seconds")
    return out
