"""The events of hosts that sleep and wake (hosts/sleepwake.py): a host put to
sleep, and each stage of a wake (its magic packet sent, the host answering, or
the wake given up). Published once where the fact is known, like the events of
`core.events`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmproxy.core.events import INFO, WARN, Event


@dataclass(frozen=True)
class HostSlept(Event):
    """A host's agent was told to sleep: `why` idle (after `idle` seconds without
    work) or operator (`llmproxy sleep HOST`); `refused`: why it did not (the agent
    refused or could not be told; the host stays awake), None once it runs the command."""

    type: ClassVar[str] = "host.sleep"
    host: str
    why: str
    idle: float
    refused: str | None = None

    def line(self) -> tuple[str, str]:
        if self.refused is not None:
            return WARN, f"host {self.host} not sent to sleep: {self.refused}"
        if self.why == "idle":
            return INFO, f"host {self.host} sent to sleep: idle for {self.idle:.0f}s"
        return INFO, f"host {self.host} sent to sleep by an operator"


@dataclass(frozen=True)
class HostWoke(Event):
    """A wake of a host: `stage` begun (its magic packet sent to `mac`), done (its
    agent answers, `elapsed` seconds after the packet) or failed (`reason`: it did
    not answer within its timeout; it is not woken again before `backoff` seconds)."""

    type: ClassVar[str] = "host.wake"
    host: str
    stage: str
    why: str
    mac: str = ""
    elapsed: float | None = None
    reason: str | None = None
    backoff: float | None = None

    def line(self) -> tuple[str, str]:
        if self.stage == "begun":
            return INFO, f"waking host {self.host} ({self.why}): magic packet sent to {self.mac}"
        if self.stage == "done":
            return INFO, f"host {self.host} woke in {self.elapsed or 0:.1f}s"
        return WARN, (f"host {self.host} did not wake: {self.reason}; no new wake for "
                      f"{self.backoff or 0:.0f}s")
