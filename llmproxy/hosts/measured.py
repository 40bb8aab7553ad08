"""The GPU memory each managed engine was measured to hold, per (host, engine): what the
agent's ``engine_memory`` events say (agent/protocol.py's `Memory`), kept so that placement
(hosts/budget.py, hosts/residency.py) counts the measured figure where there is one, else the
declared `memory_gb`, else (an engine that declares none, not yet measured) the whole host
budget.

The figures outlive a SIGHUP (the store is the fleet's, kept across a reload) and an upgrade or
restart: `memory.json` in the runtime directory, written atomically (temp file, fsync, rename)
whenever a figure changes (significantly, see below), read at start-up. A file that cannot
be read, and each entry whose engine is no longer configured or was started with another
command than the config's (stale), is ignored with one log line, never an error.

A new measurement replaces the kept figure only when it differs from it by more than
`CHANGE_MIB` and more than `CHANGE_RATIO` of it (`significant`): an engine's memory moves by a
few MiB as it serves (its KV cache, the CUDA context), and each replacement rewrites the file
and may warn again.

A measurement is far above the declared figure when it is more than `ABOVE_RATIO` times it and
more than `ABOVE_GIB` over it: then `EngineMemoryAbove` is published, once per (host, engine,
measured figure).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmproxy.config import Config, HostConfig
from llmproxy.core.capacity import EngineMemoryAbove
from llmproxy.core.hub import Publish

FILE_NAME = "memory.json"
GIB = 2 ** 30
ABOVE_RATIO = 1.25   # far above: more than this times the declared figure ...
ABOVE_GIB = 1.0      # ... and more than this many GiB over it
CHANGE_MIB = 256     # a new figure replaces the kept one when it differs by more than this ...
CHANGE_RATIO = 0.02  # ... and by more than this share of the kept one


def significant(kept: int | None, figure: int) -> bool:
    """Whether a new measurement (bytes) replaces the kept one (see the module docstring)."""
    return kept is None or abs(figure - kept) > max(CHANGE_MIB * 2 ** 20, CHANGE_RATIO * kept)


def far_above(declared_gb: float | None, measured_gb: float) -> bool:
    """Whether a measurement is far above the declared figure (see the module docstring)."""
    return declared_gb is not None and measured_gb > declared_gb * ABOVE_RATIO and \
        measured_gb - declared_gb > ABOVE_GIB


class MeasuredMemory:
    """The measured figures of a config's managed engines (see the module docstring);
    `directory(create)` is the runtime directory."""

    log = Logger()

    def __init__(self, config: Config, directory: Callable[[bool], str], clock: IReactorTime,
                 publish: Publish) -> None:
        self._directory = directory
        self._clock = clock
        self._publish = publish
        self._bytes: dict[tuple[str, str], int] = {}
        self._warned: set[tuple[str, str, int]] = set()
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Take a (reloaded) config: figures of engines it no longer names, or names with
        another command, are dropped."""
        self._commands = {(h.name, name): list(e.command) for h in config.hosts if h.managed
                          for name, e in h.engines.items()}
        self._declared = {(h.name, name): e.memory_gb for h in config.hosts if h.managed
                          for name, e in h.engines.items()}
        self._bytes = {k: v for k, v in self._bytes.items() if k in self._commands}

    # -- what placement and /status read ---------------------------------------------------
    def gb(self, host: str, engine: str) -> float | None:
        """The engine's measured GiB, or None: not measured."""
        figure = self._bytes.get((host, engine))
        return None if figure is None else figure / GIB

    def measured_bytes(self, host: str, engine: str) -> int | None:
        return self._bytes.get((host, engine))

    def of_host(self, host: str) -> Callable[[str], float | None]:
        """`gb` of one host, as its placement asks."""
        return lambda engine: self.gb(host, engine)

    # -- what the watches say --------------------------------------------------------------
    def measured(self, host: str, engine: str, figure: int) -> bool:
        """The agent measured `figure` bytes for `engine` on `host`; whether that changed
        the figure kept (only a `significant` change does)."""
        key = (host, engine)
        if key not in self._commands or not significant(self._bytes.get(key), figure):
            return False
        self._bytes[key] = figure
        declared, gb = self._declared[key], figure / GIB
        if far_above(declared, gb) and (host, engine, figure) not in self._warned:
            self._warned.add((host, engine, figure))
            self._publish(EngineMemoryAbove(self._clock.seconds(), host, engine,
                                            float(declared or 0.0), round(gb, 3)))
        try:
            self._save()
        except OSError as e:
            self.log.warn("cannot write the measured engine memory to {path}: {why}",
                          path=self._path(False), why=str(e))
        return True

    # -- the file --------------------------------------------------------------------------
    def _path(self, create: bool) -> str:
        return os.path.join(self._directory(create), FILE_NAME)

    def load(self) -> None:
        """Read the figures on file (see the module docstring: never raises)."""
        try:
            path = self._path(False)
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            self.log.warn("ignoring the measured engine memory on file: {why}", why=str(e))
            return
        entries = doc.get("engines") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            self.log.warn("ignoring the measured engine memory in {path}: not "
                          '{{"engines": [...]}}', path=path)
            return
        stale = []
        for entry in entries:
            key = _key(entry)
            if key is None or self._commands.get(key) != entry.get("command"):
                stale.append(entry.get("engine") if isinstance(entry, dict) else None)
            else:
                self._bytes[key] = entry["memory_bytes"]
        if stale:
            self.log.warn("ignoring {n} stale or malformed entries of {path}",
                          n=len(stale), path=path)

    def _save(self) -> None:
        path = self._path(True)
        doc = {"engines": [{"host": h, "engine": e, "command": self._commands[(h, e)],
                            "memory_bytes": b} for (h, e), b in sorted(self._bytes.items())]}
        temp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(temp, "w", encoding="utf-8") as f:
                f.write(json.dumps(doc, indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise


def memory_fields(host: HostConfig, engine: str, measured: float | None,
                  counted: float) -> dict[str, float | None]:
    """An engine's memory for /status: what placement counts (`memory_gb`), the declared
    figure and the measured one (None: none)."""
    preset = host.engines.get(engine)
    return {"memory_gb": round(counted, 3),
            "declared_memory_gb": preset.memory_gb if preset is not None else None,
            "measured_memory_gb": None if measured is None else round(measured, 3)}


def _key(entry: object) -> tuple[str, str] | None:
    if not isinstance(entry, dict):
        return None
    host, engine, figure = entry.get("host"), entry.get("engine"), entry.get("memory_bytes")
    if isinstance(host, str) and isinstance(engine, str) and type(figure) is int and figure >= 0:
        return host, engine
    return None
