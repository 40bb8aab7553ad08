"""One managed host's engines supervised: an engine that died without the
proxy stopping it (its agent's watch says so) is forgotten at once, started
again after a backoff, and after a crash loop marked `failed` (the rules are
`supervise`'s). A restart that fails to start counts as one more crash.

Its watch's events arrive here (through the fleet): `exit` (a crash), `health`
(a failing check starts the hung-engine rule's count; the engine is sampled
every CHECK_EVERY, and once hung it is stopped at once, its stuck requests
notwithstanding, and started again as after a crash), and `hello` (a reopened
watch lists what runs: an engine the proxy had that it lacks died unwatched,
an exit of unknown status).

The manager asks `refusal(engine)` before queueing a request (a failed engine
is a SwitchFailed naming its exit and last log line: a 424) and `held(engine)`
before starting one (not before its backoff is over). An operator's start
`clear`s the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from llmproxy.agent.protocol import Exit, exit_text
from llmproxy.config import HostConfig
from llmproxy.core.events import EngineExit, EngineUnhealthy
from llmproxy.core.hub import Publish
from llmproxy.core.redact import quote_log
from llmproxy.hosts.supervise import (
    CRASH_WINDOW,
    EngineRecord,
    Silence,
    Verdict,
    after_exit,
    cleared,
    engine_lines,
)


class Supervised(Protocol):
    """What the supervisor needs of its host's manager."""

    host: HostConfig

    @property
    def closing(self) -> bool: ...

    @property
    def busy(self) -> bool: ...

    def runs(self, engine: str | None) -> bool: ...

    def running_engines(self) -> tuple[str, ...]: ...

    def stop_hung(self, engine: str) -> Deferred[bool]: ...

    def forget(self, engine: str) -> None: ...

    def acquire(self, engine: str | None = None, request_id: str | None = None, *,
                bounded: bool = True) -> Deferred[Any]: ...

    def reconsider(self) -> None: ...


CHECK_EVERY = 1.0     # an unhealthy engine's responses sampled (at most; a tenth of its limit)


class Supervisor:
    """The crash history and restarts of one host's engines, and the hung-engine
    rule. Two hooks (constructor arguments): `sending(engine)`, the bytes each
    response in flight on `engine` has sent, by request id (default: none);
    `watching()`, whether the host's watch is connected (no engine counts as
    hung while it is not: its health is not known; default: always)."""

    log = Logger()

    def __init__(self, manager: Supervised, clock: IReactorTime, publish: Publish, *,
                 sending: Callable[[str], Mapping[str, int]] | None = None,
                 watching: Callable[[], bool] | None = None) -> None:
        self._manager = manager
        self._clock = clock
        self._publish = publish
        self.records: dict[str, EngineRecord] = {}
        self.sending: Callable[[str], Mapping[str, int]] = sending or (lambda engine: {})
        self.watching: Callable[[], bool] = watching or (lambda: True)
        self._held: dict[str, float] = {}
        self._timers: dict[str, IDelayedCall] = {}
        self._silent: dict[str, Silence] = {}
        self._checks: dict[str, IDelayedCall] = {}

    def record(self, engine: str) -> EngineRecord:
        return self.records.setdefault(engine, EngineRecord())

    def refusal(self, engine: str) -> str | None:
        """Why a request for `engine` is refused at once (it failed), or None."""
        record = self.records.get(engine)
        if record is None or not record.failed:
            return None
        line = (f"; its log's last line: {quote_log(record.last_line)}" if record.last_line
                else "")
        return (f"{engine} failed: it died {len(record.crashes)} times within 10 minutes, "
                f"last with {record.last_exit}{line} (llmproxy engine "
                f"{self._manager.host.name} start {engine} tries again)")

    def failed(self, engine: str) -> bool:
        """Whether `engine` is `failed` (a crash loop; an operator's start clears it)."""
        record = self.records.get(engine)
        return record is not None and record.failed

    def held(self, engine: str) -> float | None:
        """Until when a start of `engine` waits for its backoff, or None."""
        until = self._held.get(engine)
        return until if until is not None and until > self._clock.seconds() else None

    def clear(self, engine: str) -> None:
        """An operator's start: the failed state and crash history are forgotten."""
        cleared(self.record(engine))
        self._held.pop(engine, None)

    def exited(self, engine: str, event: Exit | None = None) -> None:
        """The agent's watch reports `engine` dead (`event`: its exit event, None when
        the exit is not known); a crash if the proxy still had it."""
        if not self._manager.runs(engine):
            return      # stopped by the proxy (or never adopted): not a crash
        self._manager.forget(engine)
        self._healthy(engine)
        tail = engine_lines(event.log_tail if event is not None else ())[-20:]
        how = event.how if event is not None else exit_text(None, None)
        verdict = self._crashed(engine, how, tail)
        self._publish(EngineExit(self._clock.seconds(), self._manager.host.name, engine, how,
                                 tuple(tail), verdict.restart_in, verdict.failed,
                                 verdict.crashes))

    def hello(self, listed: Iterable[str]) -> None:
        """A (re)opened watch lists the engines running on the host: one the proxy
        has that it does not list died while nobody watched (an exit of unknown
        status). Not while an agent call is under way: the proxy's own stop may
        be in it, and the call ends with the host's state known."""
        if self._manager.busy:
            return
        names = set(listed)
        for engine in self._manager.running_engines():
            if engine not in names:
                self.exited(engine)

    def health(self, engine: str, healthy: bool) -> None:
        """The watch says whether `engine`'s health check passes (said when it
        changes, and on each hello). A failing one on an engine the proxy has
        starts the hung-engine rule's count."""
        if healthy:
            if self._healthy(engine):
                self.log.info("engine {engine} on {host} passes its health check again",
                              engine=engine, host=self._manager.host.name)
            return
        if engine in self._silent or not self._manager.runs(engine):
            return
        now = self._clock.seconds()
        self._silent[engine] = Silence(now, now, dict(self.sending(engine)))
        self.log.warn("engine {engine} on {host} fails its health check: it is replaced "
                      "after {seconds:g}s unless it recovers or its responses keep flowing",
                      engine=engine, host=self._manager.host.name,
                      seconds=self._limit(engine))
        self._check_later(engine)

    def _limit(self, engine: str) -> float:
        preset = self._manager.host.engines.get(engine)
        return preset.unhealthy_seconds if preset is not None else 30.0

    def _healthy(self, engine: str) -> bool:
        """The hung-engine count of `engine` ends; whether it was counting."""
        check = self._checks.pop(engine, None)
        if check is not None and check.active():
            check.cancel()
        return self._silent.pop(engine, None) is not None

    def _check_later(self, engine: str) -> None:
        every = min(CHECK_EVERY, self._limit(engine) / 10)
        self._checks[engine] = self._clock.callLater(every, self._check, engine)

    def _check(self, engine: str) -> None:
        """Sample an unhealthy engine's responses; replace it once it is hung
        (while no agent call is under way and the watch is connected)."""
        self._checks.pop(engine, None)
        silence = self._silent.get(engine)
        if silence is None:
            return
        if self._manager.closing or not self._manager.runs(engine):
            self._healthy(engine)       # stopped, or forgotten: nothing to replace
            return
        now = self._clock.seconds()
        silence.sample(now, self.sending(engine))
        if silence.hung(now, self._limit(engine)) and self.watching() and \
                not self._manager.busy:
            self._replace(engine, now - silence.since)
            return
        self._check_later(engine)

    def _replace(self, engine: str, unhealthy_for: float) -> None:
        """Stop a hung engine now (its stuck requests end cut) and start it again
        as after a crash."""
        self._healthy(engine)
        how = f"a hang (its health check failed for {unhealthy_for:.0f}s)"
        verdict = self._crashed(engine, how, [])
        self._publish(EngineUnhealthy(self._clock.seconds(), self._manager.host.name, engine,
                                      round(unhealthy_for, 1), verdict.restart_in,
                                      verdict.failed, verdict.crashes))
        self._manager.stop_hung(engine).addErrback(
            lambda f: self.log.failure("stopping the hung {engine} on {host}", f,
                                       engine=engine, host=self._manager.host.name))

    def _crashed(self, engine: str, how: str, tail: list[str]) -> Verdict:
        """Count a crash of `engine` and schedule what follows; the verdict."""
        preset = self._manager.host.engines.get(engine)
        record = self.record(engine)
        record.last_exit, record.last_line = how, (tail[-1][:300] if tail else record.last_line)
        verdict = after_exit(record, self._clock.seconds(), stopped_by_proxy=False,
                             restart=preset.restart if preset is not None else "on-failure")
        if verdict.restart_in is not None and not self._manager.closing:
            self._held[engine] = self._clock.seconds() + verdict.restart_in
            old = self._timers.pop(engine, None)
            if old is not None and old.active():
                old.cancel()
            self._timers[engine] = self._clock.callLater(verdict.restart_in, self._restart,
                                                         engine)
        return verdict

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
            how = getattr(error, "reason", str(error))
            verdict = self._crashed(engine, how, [])
            self._publish(EngineExit(self._clock.seconds(), self._manager.host.name, engine,
                                     how, (), verdict.restart_in, verdict.failed,
                                     verdict.crashes))

    def stop(self) -> None:
        """The proxy stops: no restart from now on."""
        for timer in [*self._timers.values(), *self._checks.values()]:
            if timer.active():
                timer.cancel()
        self._timers.clear()
        self._checks.clear()
        self._silent.clear()

    def snapshot(self) -> dict[str, Any]:
        """Per engine with a history or a failing health check, for /status: its
        state (`failed`; `restarting` in its backoff; `unhealthy`, its health
        check failing; `ok` running again; `exited`, not running and not to be
        restarted by the supervisor: `restart: never`, or not asked for since)
        and its crashes within the crash-loop window."""
        now = self._clock.seconds()
        empty = EngineRecord()
        return {engine: {"state": "failed" if r.failed else
                         "restarting" if engine in self._held else
                         "unhealthy" if engine in self._silent else
                         "ok" if self._manager.runs(engine) else "exited",
                         "crashes": sum(1 for t in r.crashes if now - t < CRASH_WINDOW),
                         "last_exit": r.last_exit,
                         "last_line": r.last_line,
                         "restart_in_seconds": round(self._held[engine] - now, 1)
                         if engine in self._held else None,
                         "unhealthy_seconds": round(now - self._silent[engine].since, 1)
                         if engine in self._silent else None}
                for engine in sorted({*self.records, *self._silent})
                for r in [self.records.get(engine, empty)]
                if r.crashes or r.failed or engine in self._silent}
