"""One managed host's engines supervised: an engine that died without the
proxy stopping it (its agent's watch says so) is forgotten at once, started
again after a backoff, and after a crash loop marked `failed` (the rules are
`supervise`'s). A restart that fails to start counts as one more crash.

The manager asks `refusal(engine)` before queueing a request (a failed engine
is a SwitchFailed naming its exit and last log line: a 424) and `held(engine)`
before starting one (not before its backoff is over). An operator's start
`clear`s the engine.
"""

from __future__ import annotations

from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from llmproxy.config import HostConfig
from llmproxy.core.events import EngineExit
from llmproxy.core.hub import Publish
from llmproxy.hosts.supervise import (
    EngineRecord,
    after_exit,
    cleared,
    engine_lines,
    exit_text,
)


class Supervised(Protocol):
    """What the supervisor needs of its host's manager."""

    host: HostConfig
    closing: bool

    def runs(self, engine: str | None) -> bool: ...

    def forget(self, engine: str) -> None: ...

    def acquire(self, engine: str | None = None, request_id: str | None = None, *,
                bounded: bool = True) -> Deferred[Any]: ...

    def reconsider(self) -> None: ...


class Supervisor:
    """The crash history and restarts of one host's engines."""

    log = Logger()

    def __init__(self, manager: Supervised, clock: IReactorTime, publish: Publish) -> None:
        self._manager = manager
        self._clock = clock
        self._publish = publish
        self.records: dict[str, EngineRecord] = {}
        self._held: dict[str, float] = {}
        self._timers: dict[str, IDelayedCall] = {}

    def record(self, engine: str) -> EngineRecord:
        return self.records.setdefault(engine, EngineRecord())

    def refusal(self, engine: str) -> str | None:
        """Why a request for `engine` is refused at once (it failed), or None."""
        record = self.records.get(engine)
        if record is None or not record.failed:
            return None
        line = f"; its log's last line: {record.last_line}" if record.last_line else ""
        return (f"{engine} failed: it died {len(record.crashes)} times within 10 minutes, "
                f"last with {record.last_exit}{line} (llmproxy engine "
                f"{self._manager.host.name} start {engine} tries again)")

    def held(self, engine: str) -> float | None:
        """Until when a start of `engine` waits for its backoff, or None."""
        until = self._held.get(engine)
        return until if until is not None and until > self._clock.seconds() else None

    def clear(self, engine: str) -> None:
        """An operator's start: the failed state and crash history are forgotten."""
        cleared(self.record(engine))
        self._held.pop(engine, None)

    def exited(self, engine: str, event: dict[str, Any]) -> None:
        """The agent's watch reports `engine` dead; a crash if the proxy still had it."""
        if not self._manager.runs(engine):
            return      # stopped by the proxy (or never adopted): not a crash
        self._manager.forget(engine)
        said = event.get("log_tail")
        tail = engine_lines(said if isinstance(said, list) else [])[-20:]
        how = exit_text(_int(event.get("exit_status")), _int(event.get("signal")))
        self._crashed(engine, how, tail)

    def _crashed(self, engine: str, how: str, tail: list[str]) -> None:
        preset = self._manager.host.engines.get(engine)
        record = self.record(engine)
        record.last_exit, record.last_line = how, (tail[-1][:300] if tail else record.last_line)
        verdict = after_exit(record, self._clock.seconds(), stopped_by_proxy=False,
                             restart=getattr(preset, "restart", "on-failure"))
        self._publish(EngineExit(self._clock.seconds(), self._manager.host.name, engine, how,
                                 tuple(tail), verdict.restart_in, verdict.failed,
                                 verdict.crashes))
        if verdict.restart_in is not None and not self._manager.closing:
            self._held[engine] = self._clock.seconds() + verdict.restart_in
            old = self._timers.pop(engine, None)
            if old is not None and old.active():
                old.cancel()
            self._timers[engine] = self._clock.callLater(verdict.restart_in, self._restart,
                                                         engine)

    def _restart(self, engine: str) -> None:
        self._timers.pop(engine, None)
        self._held.pop(engine, None)
        if self._manager.closing or self.record(engine).failed or self._manager.runs(engine):
            self._manager.reconsider()
            return
        d = self._manager.acquire(engine, bounded=False)
        d.addCallbacks(lambda lease: lease.release(),
                       lambda f: self._restart_failed(engine, f.value))

    def _restart_failed(self, engine: str, error: BaseException) -> None:
        """A restart that did not start: one more crash (unless the proxy stops)."""
        if not self._manager.closing and not self.record(engine).failed:
            self._crashed(engine, getattr(error, "reason", str(error)), [])

    def stop(self) -> None:
        """The proxy stops: no restart from now on."""
        for timer in self._timers.values():
            if timer.active():
                timer.cancel()
        self._timers.clear()

    def snapshot(self) -> dict[str, Any]:
        """Per engine with a history, for /status."""
        now = self._clock.seconds()
        return {engine: {"state": "failed" if r.failed else
                         "restarting" if engine in self._held else "ok",
                         "crashes": len(r.crashes), "last_exit": r.last_exit,
                         "last_line": r.last_line,
                         "restart_in_seconds": round(self._held[engine] - now, 1)
                         if engine in self._held else None}
                for engine, r in self.records.items() if r.crashes or r.failed}


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None

