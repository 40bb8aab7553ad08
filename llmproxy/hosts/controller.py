"""The engine controller of one managed host: every agent call (adoption,
starts, stops, status re-reads), one at a time, and what they learned: which
engines run, which were found there and not adopted (`foreign`), which are
being stopped or started. It decides nothing: its placement policy says what
to start or evict and when (hosts/placement.py, hosts/budget.py), hears how
each call went (`failed`) and moves the queue on after it. Switches and stops
are published as events (`EngineSwitch`, `IdleStop`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmproxy.config import HostConfig
from llmproxy.core.events import EngineSwitch, IdleStop
from llmproxy.core.hub import Publish
from llmproxy.hosts.adoption import Found, Passed, adopt_one, adopt_within
from llmproxy.hosts.agentcalls import AgentCalls
from llmproxy.hosts.agentclient import IAgentTransport

Failed = Callable[[str], None]   # hears the reason a call failed with


class EngineController:
    """One managed host's agent calls and the engine state they learned."""

    log = Logger()

    def __init__(self, host: HostConfig, transport: IAgentTransport, clock: IReactorTime,
                 publish: Publish, stop_grace: float = 10.0,
                 measured: Callable[[str], float | None] = lambda engine: None) -> None:
        self.host = host
        self.agent = AgentCalls(host, transport, stop_grace, clock, publish)
        self.running: str | None = None         # the engine started last
        self.loaded: dict[str, float] = {}     # engines together: each -> since when
        self.foreign: tuple[str, ...] = ()     # found running, not adopted
        self.stopping: set[str] = set()
        self.target: str | None = None          # the engine being started
        self.operation: str | None = None       # the agent call under way
        self.last_switch: dict[str, Any] | None = None
        self.resident_until: float | None = None   # one engine at a time: its residency
        self.until: dict[str, float] = {}       # engines together: each one's residency
        self._clock, self._publish, self._measured = clock, publish, measured  # measured GiB
        self._observers: list[Deferred[None]] = []

    # -- what others read -----------------------------------------------------------------
    def assume(self, engine: str | None) -> None:
        """Take `engine` as the one running (a test's set-up)."""
        self.running = engine

    def running_engines(self) -> tuple[str, ...]:
        """Every engine that serves requests here."""
        if self.host.budgeted:
            return tuple(self.loaded)
        return (self.running,) if self.running is not None else ()

    def occupant(self) -> str | None:
        """The engine on the host (running, or found there and not adopted)."""
        return self.running or (self.foreign[0] if self.foreign else None)

    def operations(self) -> list[Deferred[Any]]:
        """Deferreds that fire when the agent call in progress (switch, stop...) is done."""
        if self.operation is None:
            return []
        d: Deferred[None] = Deferred()
        self._observers.append(d)
        return [d]

    def drop(self, engine: str) -> None:
        """`engine` no longer runs here (its leases, if any, stay counted until released)."""
        self.loaded.pop(engine, None)
        self.until.pop(engine, None)
        if self.running == engine:
            self.running = next(reversed(self.loaded), None)
            self.resident_until = None

    def _end(self) -> None:   # the operation is over: whoever waits for it hears so
        self.operation = None
        observers, self._observers = self._observers, []
        for d in observers:
            d.callback(None)

    def _take_state(self, engines: list[Found]) -> Passed:
        """Adopt what the host's rule adopts of a status answer; the others are foreign."""
        adopted, passed = adopt_within(self.host, engines, self._measured) \
            if self.host.budgeted else adopt_one(self.host, engines)
        if self.host.budgeted:
            now = self._clock.seconds()
            self.until, self.loaded = {}, {name: now for name in adopted}
        self.running = adopted[-1] if adopted else None
        self.foreign = tuple(name for name, _ in passed)
        return passed

    async def read_status(self, after: str) -> None:
        """Learn what runs on the host from the agent (never guessed)."""
        self.operation = "status"
        engines, reason = await self.agent.status()
        if reason is not None:
            self.running, self.foreign = None, ()
            self.log.warn("state of {host} unknown after {after}: {reason}",
                          host=self.host.name, after=after, reason=reason)
            return
        passed = self._take_state(engines)
        why = "; ".join(f"{name} found, not used: {why}" for name, why in passed)
        self.log.info("state of {host} after {after}: running {engine}{why}",
                      host=self.host.name, after=after, engine=self.running,
                      why=f" ({why})" if why else "")

    async def adopt(self) -> None:
        """At start-up: adopt the healthy configured engines the agent reports running
        (no restart), as the host's rule says. Errors are logged, never raised."""
        if self.operation is not None:
            self.log.warn("adopt on {host} skipped: {op} in progress", host=self.host.name,
                          op=self.operation)
            return
        self.operation = "adopt"
        try:
            engines, reason = await self.agent.status()
            if reason is not None:
                self.running, self.foreign = None, ()
                self.log.warn("cannot read what runs on {host}: {reason}",
                              host=self.host.name, reason=reason)
                return
            passed = self._take_state(engines)
            for name in self.running_engines():
                pid = next(e.get("pid") for e in engines if e.get("engine") == name)
                self.log.info("adopted engine {engine} on {host} (pid {pid}), no restart",
                              engine=name, host=self.host.name, pid=pid)
            for name, why in passed:
                self.log.warn("engine {engine} on {host} not adopted: {why}",
                              engine=name, host=self.host.name, why=why)
            if not engines:
                self.log.info("no engine runs on {host}", host=self.host.name)
        finally:
            self._end()

    def _switched(self, engine: str, previous: str | None, started: float,
                  reason: str | None) -> None:
        now = self._clock.seconds()
        self.last_switch = {"at": now, "engine": engine,
                            "outcome": "ok" if reason is None else "failed",
                            "reason": reason, "elapsed": round(now - started, 3)}
        self._publish(EngineSwitch(now, self.host.name, "done" if reason is None else "failed",
                                   engine, previous, reason=reason, elapsed=now - started))

    async def switch(self, engine: str, failed: Failed) -> bool:
        """One engine at a time: start `engine`, the agent stopping every other one;
        whether it runs. `failed(reason)` hears a failure before the state is re-read."""
        old, started = self.occupant(), self._clock.seconds()
        self.operation, self.target, self.running = "switch", engine, None
        self._publish(EngineSwitch(started, self.host.name, "begun", engine, old))
        try:
            reason = await self.agent.start(engine, exclusive=True)
            self.target = None
            self._switched(engine, old, started, reason)
            if reason is None:
                self.running, self.foreign = engine, ()
                residency = self.host.min_engine_seconds
                self.resident_until = self._clock.seconds() + residency if residency else None
                return True
            failed(reason)
            await self.read_status(f"the failed switch to {engine}")
            return False
        finally:
            self.target = None
            self._end()

    async def start(self, engine: str, evict: tuple[str, ...], in_use: Callable[[str], bool],
                    failed: Failed) -> bool:
        """Engines together: stop `evict` (each unless `in_use` again, then nothing is
        done: the start is planned anew), then start `engine` beside the engines that
        stay, as one operation; whether it runs."""
        self.operation, self.target = "switch", engine
        started, previous = self._clock.seconds(), ", ".join(evict) or None
        self._publish(EngineSwitch(started, self.host.name, "begun", engine, previous))
        try:
            for victim in evict:
                if in_use(victim) or victim not in self.loaded:
                    # Taken again since the plan (never cut a stream): plan anew.
                    self._publish(EngineSwitch(self._clock.seconds(), self.host.name,
                                               "waiting", engine, victim, reason="memory"))
                    return False
                reason = await self.stop_call(victim, f"evicted for {engine}")
                if reason is not None:
                    reason = f"evicting {victim} failed: {reason}"
                    break
            else:
                reason = await self.agent.start(engine, exclusive=False)
            if reason is not None:
                self._switched(engine, previous, started, reason)
                failed(reason)
                self.target = None
                await self.read_status(f"the failed start of {engine}")
                return False
            now = self._clock.seconds()
            self.loaded[engine] = now
            self.running = engine
            if self.host.min_engine_seconds:
                self.until[engine] = now + self.host.min_engine_seconds
            self._switched(engine, previous, started, None)
            return True
        finally:
            self.target = None
            self._end()

    async def stop_call(self, engine: str, why: str) -> str | None:
        """Stop one engine of several: None once stopped, else why not (an IdleStop)."""
        self.drop(engine)
        started = self._clock.seconds()
        self.stopping.add(engine)
        self._publish(IdleStop(started, self.host.name, "begun", engine, why=why))
        try:
            reason = await self.agent.stop(engine)
        finally:
            self.stopping.discard(engine)
        self._publish(IdleStop(self._clock.seconds(), self.host.name,
                               "done" if reason is None else "failed", engine, reason=reason,
                               elapsed=self._clock.seconds() - started, why=why))
        return reason

    async def stop_beside(self, engine: str, why: str,
                          stopped: Callable[[str | None], None] | None = None) -> bool:
        """Stop one engine of several (`why`: idle, ttl, operator); `stopped(reason)`
        hears how it went before a failed stop re-reads the state."""
        self.operation = "stop"
        try:
            reason = await self.stop_call(engine, why)
            if stopped is not None:
                stopped(reason)
            if reason is not None:
                await self.read_status(f"the failed stop of {engine}")
            return reason is None
        finally:
            self._end()

    async def stop(self, engine: str, idle: bool, failed: Failed) -> bool:
        """One engine at a time: stop `engine`, an idle stop (published as such) or an
        operator's (`failed(reason)` hears a failure before the state is re-read)."""
        self.operation = "stop"
        try:
            started = self._clock.seconds()
            if idle:
                self._publish(IdleStop(started, self.host.name, "begun", engine))
            reason = await self.agent.stop(engine)
            elapsed = self._clock.seconds() - started
            if idle:
                self._publish(IdleStop(self._clock.seconds(), self.host.name,
                                       "done" if reason is None else "failed", engine,
                                       reason=reason, elapsed=elapsed))
            if reason is None:
                if self.running == engine:
                    self.running = self.resident_until = None
                # Another engine found there is the next occupant an operator's stop stops.
                self.foreign = tuple(e for e in self.foreign if e != engine)
                return True
            failed(reason)
            await self.read_status(f"the failed stop of {engine}")
            return False
        finally:
            self._end()

    async def stop_all(self, failed: Callable[[str, str], None]) -> None:
        """Engines together: an operator's bare stop of every engine, in one agent call."""
        self.operation = "stop"
        try:
            engines = list(self.loaded) + list(self.foreign)
            self.stopping.update(engines)
            self.loaded, self.running = {}, None
            reason = await self.agent.stop(None)
            self.stopping.clear()
            if reason is None:
                self.foreign, self.until = (), {}
                return
            failed(", ".join(engines), reason)
            await self.read_status("the failed stop")
        finally:
            self._end()

    async def stop_hung(self, engine: str) -> bool:
        """Stop a hung `engine` at once, its leases notwithstanding (their streams are
        stuck; they end cut as it dies); whether the agent stopped it."""
        self.operation = "stop"
        self.drop(engine)
        try:
            reason = await self.agent.stop(engine, save=False)
            if reason is None:
                self.foreign = tuple(e for e in self.foreign if e != engine)
                self.log.info("stopped the hung engine {engine} on {host}", engine=engine,
                              host=self.host.name)
                return True
            self.log.warn("stopping the hung engine {engine} on {host} failed: {reason}",
                          engine=engine, host=self.host.name, reason=reason)
            await self.read_status(f"the failed stop of the hung {engine}")
            return False
        finally:
            self._end()
