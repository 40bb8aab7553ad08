"""Cordons that outlive the process: `cordons.json` in the runtime directory.

A cordoned host takes no new request. The set is written atomically (a temp
file in the same directory, fsync, rename), so a reader sees the old file or
the new one, never half of one; a reload keeps the set (it is not config), and
an upgrade's successor or a restarted proxy reads the same file at start-up.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmproxy.core.capacity import Cordon
from llmproxy.core.hub import Publish

FILE_NAME = "cordons.json"


class CordonFileError(Exception):
    """The cordon file exists but cannot be read or understood; str() says which
    file and why."""


class CordonFile:
    """The file of cordoned hosts: host name -> when it was cordoned (epoch seconds)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, FILE_NAME)

    def load(self) -> dict[str, float]:
        """The cordons on file; none when there is no file."""
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise CordonFileError(f"cannot read cordons from {self.path}: {e}") from None
        hosts = doc.get("cordoned") if isinstance(doc, dict) else None
        if not isinstance(hosts, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) for k, v in hosts.items()):
            raise CordonFileError(f"cannot read cordons from {self.path}: not "
                                  '{"cordoned": {"HOST": SECONDS, ...}}; fix or remove it')
        return {k: float(v) for k, v in hosts.items()}

    def save(self, cordons: Mapping[str, float]) -> None:
        """Write the set atomically (OSError if it cannot be written)."""
        directory = os.path.dirname(self.path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        temp = f"{self.path}.{os.getpid()}.tmp"
        data = json.dumps({"cordoned": dict(sorted(cordons.items()))}, indent=2) + "\n"
        try:
            with open(temp, "w", encoding="utf-8") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)      # the rename itself survives a crash
        finally:
            os.close(dir_fd)


class Cordonable(Protocol):
    """What a cordon changes of a host."""

    def cordon(self, cordoned: bool = True) -> None: ...

    def in_flight(self, engine: str | None = None) -> int: ...

    def queued(self) -> int: ...


class Cordons:
    """The hosts' cordons: on file (`directory(create)`: the runtime directory) and
    on each host (`gates`); each change published as a Cordon event."""

    log = Logger()

    def __init__(self, gates: Mapping[str, Cordonable], directory: Callable[[bool], str],
                 clock: IReactorTime, publish: Publish) -> None:
        self._gates = gates
        self._directory = directory
        self._clock = clock
        self._publish = publish
        self.cordoned: dict[str, float] = {}     # host -> since (epoch seconds)

    def load(self) -> None:
        """Read the cordons on file (runtime_dir/cordons.json): they outlive reloads,
        upgrades and restarts. CordonFileError if the file is unreadable."""
        file = CordonFile(self._directory(False))
        self.cordoned = file.load()
        for name, gate in self._gates.items():
            gate.cordon(name in self.cordoned)
        unknown = sorted(set(self.cordoned) - set(self._gates))
        if self.cordoned:
            self.log.info("cordoned hosts (from {path}): {hosts}", path=file.path,
                          hosts=", ".join(sorted(self.cordoned)) + (
                              f" ({', '.join(unknown)} not in the config)" if unknown else ""))

    def cordon(self, host: str, cordoned: bool = True) -> None:
        """Cordon `host` (it takes no new request) or lift its cordon, on file first:
        OSError if it cannot be written (then nothing changed); KeyError: no such host."""
        gate = self._gates[host]
        file = CordonFile(self._directory(True))
        wanted = dict(self.cordoned)
        if cordoned:
            wanted.setdefault(host, self._clock.seconds())
        else:
            wanted.pop(host, None)
        if wanted != self.cordoned:
            file.save(wanted)
        self.cordoned = wanted
        gate.cordon(cordoned)
        self._publish(Cordon(self._clock.seconds(), host, cordoned, gate.in_flight(),
                             gate.queued()))
