"""Fakes for an upgrade's launcher and hand-over, kept apart from `fakes` so that the tests of
hosts/ and the agent import nothing of lifecycle/ (tests/modes.py repeats such tests in the
reference run)."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from llmproxy.lifecycle.handover import READY_FD
from llmproxy.lifecycle.upgrade import Upgrade


class _Candidate:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.lines: list[tuple[int, bytes]] = []

    def writeToChild(self, fd: int, data: bytes) -> None:
        self.lines.append((fd, data))

    def signalProcess(self, signal: str) -> None:
        pass


class ReadyCandidates(Clock):
    """A process reactor for an upgrade's `Launcher` whose every candidate says
    it is ready the moment it is spawned (pids from 4711)."""

    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[_Candidate] = []

    def spawnProcess(self, protocol: Any, executable: str, args: list[str],
                     env: dict[str, str], path: str | None = None,
                     childFDs: dict[int, Any] | None = None) -> _Candidate:
        candidate = _Candidate(4711 + len(self.spawned))
        self.spawned.append(candidate)
        protocol.transport = candidate
        protocol.childDataReceived(READY_FD, f"ready {candidate.pid}\n".encode())
        return candidate


def hand_over_to(upgrade: Upgrade, successor_url: str) -> Deferred[dict[str, Any]]:
    """Run `upgrade` (its launcher on `ReadyCandidates`) through a hand-over to a
    successor serving at `successor_url`; this process's side of leaving is a no-op."""
    async def leave(pid: int) -> None:
        pass

    return upgrade.start(None, listen_fd=-1, successor_url=successor_url, lock_fds={},
                         hand_over=leave)
