"""What the agent's answers say of kept prompt caches (llmproxy/agent/kvcache.py), published
as events (core/kvcache.py): a start's restore, each stopped engine's save."""

from __future__ import annotations

from typing import Any

from twisted.internet.interfaces import IReactorTime

from llmproxy.agent.protocol import KV_CACHE, KV_ERROR, KV_RESTORED, KV_SAVED
from llmproxy.core.hub import Publish
from llmproxy.core.kvcache import KvFailed, KvRestored, KvSaved


def _ints(value: object) -> tuple[int, ...]:
    return tuple(v for v in value if isinstance(v, int)) if isinstance(value, list) else ()


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class KvReport:
    """Publishes the kept-cache outcomes of one host's agent answers."""

    def __init__(self, host: str, clock: IReactorTime, publish: Publish) -> None:
        self._host, self._clock, self._publish = host, clock, publish

    def started(self, engine: str, answer: dict[str, Any]) -> None:
        """A start's answer: its restore, and the saves of the engines it stopped."""
        said = answer.get(KV_CACHE)
        if isinstance(said, dict):
            now = self._clock.seconds()
            if isinstance(said.get(KV_ERROR), str):
                self._publish(KvFailed(now, self._host, engine, "restore", said[KV_ERROR]))
            else:
                self._publish(KvRestored(now, self._host, engine, _ints(said.get(KV_RESTORED)),
                                         _int(said.get("tokens")), _int(said.get("discarded"))))
        self.stopped(answer)

    def stopped(self, answer: dict[str, Any]) -> None:
        """A stop's (or an exclusive start's) answer: each stopped engine's save."""
        entries = answer.get("stopped")
        for entry in entries if isinstance(entries, list) else ():
            said = entry.get(KV_CACHE) if isinstance(entry, dict) else None
            engine = entry.get("engine") if isinstance(entry, dict) else None
            if not isinstance(said, dict) or not isinstance(engine, str):
                continue
            now = self._clock.seconds()
            if isinstance(said.get(KV_ERROR), str):
                self._publish(KvFailed(now, self._host, engine, "save", said[KV_ERROR]))
            else:
                pruned = said.get("pruned")
                self._publish(KvSaved(now, self._host, engine, _ints(said.get(KV_SAVED)),
                                      _int(said.get("tokens")), _int(said.get("bytes")),
                                      len(pruned) if isinstance(pruned, list) else 0))
