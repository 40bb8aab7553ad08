"""The events of a kept prompt cache (an engine's ``"kv_cache": "keep"``): its slots saved
before a stop the proxy chose, restored at its next start, or a save or restore that failed
(a warning: the stop or start went on regardless). Published once where the agent's answer
is read (hosts/kvreport.py), like the events of `core.events`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmproxy.core.events import INFO, WARN, Event


@dataclass(frozen=True)
class KvSaved(Event):
    """An engine's used slots were saved before its stop: `slots` their ids, `tokens`
    the prompt tokens they hold, `size` the bytes written, `pruned` older files removed
    to keep the slot directory within its bounds."""

    type: ClassVar[str] = "engine.kv_saved"
    host: str
    engine: str
    slots: tuple[int, ...]
    tokens: int
    size: int
    pruned: int = 0

    def line(self) -> tuple[str, str]:
        return INFO, (f"kept the prompt cache of {self.engine} on {self.host}: "
                      f"{len(self.slots)} slot(s), {self.tokens} tokens, "
                      f"{self.size / 2**20:.1f} MiB")


@dataclass(frozen=True)
class KvRestored(Event):
    """An engine's saved slots were loaded back before it was marked ready: `slots`
    their ids, `tokens` the prompt tokens; `discarded` files of another command or model
    deleted instead."""

    type: ClassVar[str] = "engine.kv_restored"
    host: str
    engine: str
    slots: tuple[int, ...]
    tokens: int
    discarded: int = 0

    def line(self) -> tuple[str, str] | None:
        if self.discarded:
            return INFO, (f"discarded {self.discarded} kept slot file(s) of {self.engine} on "
                          f"{self.host}: its command or model changed")
        if not self.slots:
            return None
        return INFO, (f"restored the prompt cache of {self.engine} on {self.host}: "
                      f"{len(self.slots)} slot(s), {self.tokens} tokens")


@dataclass(frozen=True)
class KvFailed(Event):
    """A save (`op` save) or restore (`op` restore) of an engine's kept prompt cache
    failed or ran out of time: `reason`. Never fails the stop or the start."""

    type: ClassVar[str] = "engine.kv_failed"
    host: str
    engine: str
    op: str
    reason: str

    def line(self) -> tuple[str, str]:
        return WARN, (f"{self.op} of the prompt cache of {self.engine} on {self.host} "
                      f"failed (the engine goes on without it): {self.reason}")
