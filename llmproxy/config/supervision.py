"""The supervision keys of an engine, validated like the rest (`parse`): what
follows its crash (`restart`) and how long a failing health check with silent
responses makes it hung (`unhealthy_seconds`). Every error names its field."""

from __future__ import annotations

from typing import Any, Protocol

ENGINE_KEYS = ("restart", "unhealthy_seconds")
RESTART = ("on-failure", "never")


class Checks(Protocol):
    """What these checks use of the config parser."""

    def error(self, path: str, message: str) -> None: ...

    def seconds(self, value: object, path: str, positive: bool = True) -> float: ...


def engine_supervision(p: Checks, d: dict[str, Any], path: str) -> dict[str, Any]:
    """The EngineConfig fields of an engine's supervision keys that are given."""
    out: dict[str, Any] = {}
    if "restart" in d:
        if d["restart"] in RESTART:
            out["restart"] = d["restart"]
        else:
            p.error(f"{path}.restart", 'must be "on-failure" or "never"')
    if "unhealthy_seconds" in d:
        out["unhealthy_seconds"] = p.seconds(d["unhealthy_seconds"],
                                             f"{path}.unhealthy_seconds")
    return out
