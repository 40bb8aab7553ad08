"""One HostManager per managed host: which engine runs, and switching between them.

A request takes a Lease on the engine it needs through the host's queue (the
HostQueue of `queue`, which holds the one rule for slots, switches and fairness).
When that engine is not the one running, the request queues; the switch starts
once every lease on the running engine is released (a running stream is never
cut), and all requests waiting for the same engine share that one agent call.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from llmproxy.config import HostConfig
from llmproxy.core.events import EngineSwitch, IdleStop
from llmproxy.core.hub import Publish
from llmproxy.hosts.agentclient import AgentError, IAgentTransport, answer_error
from llmproxy.hosts.queue import OFF, HostQueue, Lease, ProxyStopping, SwitchFailed
from llmproxy.hosts.supervisor import Supervisor

__all__ = ["HostManager", "Lease", "ProxyStopping", "StopFailed", "SwitchFailed"]

START_SLACK = 30.0  # added to an engine's start_timeout_seconds (+ stop grace) for the ssh call
STOP_SLACK = 30.0  # added to the stop grace for the ssh call of an idle stop
STATUS_TIMEOUT = 30.0


class StopFailed(Exception):
    """An operator's stop of a host's engine failed; str() says why."""

    def __init__(self, host: str, engine: str, reason: str) -> None:
        self.host, self.engine, self.reason = host, engine, reason
        super().__init__(f"stopping engine {engine} on host {host} failed: {reason}")


class HostManager(HostQueue):
    """The engine of one managed host: adoption at start-up, switches, stops.

    Fairness: while a switch waits for the running engine's requests to finish, new requests
    for the running engine are still granted, but at most `fairness` of them; later ones
    queue behind the switch, so a steady stream of requests cannot starve it.

    `protected(engine)` is a settable hook: while it returns True for the engine on the host
    (during an upgrade, a predecessor process's streams still use it), that engine is neither
    switched away from nor stopped; whoever changes what it says calls `reconsider()`.

    Switches and idle stops are published as events (`EngineSwitch`, `IdleStop`).
    """

    log = Logger()

    def __init__(self, host: HostConfig, transport: IAgentTransport, clock: IReactorTime, *,
                 publish: Publish | None = None, fairness: int = 8,
                 stop_grace: float = 10.0) -> None:
        super().__init__(host, clock, publish=publish, fairness=fairness)
        self.supervisor = Supervisor(self, clock, self._publish)
        self._held_timer: IDelayedCall | None = None
        self.stop_grace = stop_grace
        self.last_switch: dict[str, Any] | None = None
        self._transport = transport
        self._switch_target: str | None = None
        self._observers: list[Deferred[None]] = []
        self._announced: tuple[str, str] | None = None  # (target, why) of the published wait
        # Engines found running on the host but not adopted (another command, unhealthy, not
        # configured, or beside the adopted one: this host runs one at a time).
        self._foreign: tuple[str, ...] = ()
        self.held_by: str | None = None    # another proxy holds the host's lease (`lease`)

    @property
    def switching_to(self) -> str | None:
        """The engine a switch is running or waiting to go to, if any."""
        if self._switch_target is not None:
            return self._switch_target
        head = self._queue[0].engine if self._queue else None
        return head if head and head != self.running else None

    @property
    def busy(self) -> bool:
        """Whether an agent call (adopt, switch, status re-read, stop) is in progress."""
        return self._operation is not None

    def operations(self) -> list[Deferred[Any]]:
        """Deferreds that fire when the agent call in progress (switch, stop...) is done."""
        if self._operation is None:
            return []
        d: Deferred[None] = Deferred()
        self._observers.append(d)
        return [d]

    def snapshot(self, now: float) -> dict[str, Any]:
        """This host's engine state for /status."""
        occupant = self._occupant()
        resident = self.resident_until
        return {
            "running": self.running,
            "switching_to": self.switching_to,
            "operation": self._operation,
            "in_flight": self.in_flight(),
            "queued": len(self._queue),
            "protected": occupant is not None and self.protected(occupant),
            "last_switch": dict(self.last_switch) if self.last_switch else None,
            "last_used_seconds_ago": round(max(0.0, now - self.last_used), 1),
            "resident_seconds_left": None if resident is None or resident <= now
            else round(resident - now, 1),
            "stop_requested": any(w.engine == OFF for w in self._queue),
        }

    def acquire(self, engine: str | None = None, request_id: str | None = None, *,
                bounded: bool = True, priority: str | None = None) -> Deferred[Lease]:
        """A Lease on `engine` once it runs (None: whichever runs); fails with
        SwitchFailed if it cannot be started. Cancelling the Deferred takes the
        request out of the queue."""
        if engine is not None and engine not in self.host.engines:
            return fail(SwitchFailed(self.host.name, engine, "the host has no such engine"))
        refusal = self.held_by or (self.supervisor.refusal(engine) if engine else None)
        if refusal is not None:
            return fail(SwitchFailed(self.host.name, engine or "", refusal))
        return super().acquire(engine, request_id, bounded=bounded, priority=priority)

    def forget(self, engine: str) -> None:
        """`engine` died on its own (the supervisor heard it): it no longer runs."""
        self._drop(engine)
        self._pump()

    def _drop(self, engine: str) -> None:
        """`engine` no longer runs here (its leases, if any, stay counted until released)."""
        if self.running == engine:
            self.running = self.resident_until = None

    def stop_hung(self, engine: str) -> Deferred[bool]:
        """The supervisor found `engine` hung: it takes no request from now on and
        is stopped at once, its leases notwithstanding (their streams are stuck;
        they end cut as it dies). An agent call like any other (the queue waits
        for it); fires with whether the agent stopped it (if not, the host's
        state is read again)."""
        return Deferred.fromCoroutine(self._stop_hung(engine))

    async def _stop_hung(self, engine: str) -> bool:
        self._operation = "stop"
        self._drop(engine)
        try:
            _, reason = await self._call({"op": "stop", "engine": engine,
                                          "grace": self.stop_grace},
                                         self.stop_grace + STOP_SLACK)
            if reason is None:
                self._foreign = tuple(e for e in self._foreign if e != engine)
                self.log.info("stopped the hung engine {engine} on {host}", engine=engine,
                              host=self.host.name)
                return True
            self.log.warn("stopping the hung engine {engine} on {host} failed: {reason}",
                          engine=engine, host=self.host.name, reason=reason)
            self._operation = "status"
            await self._read_status(f"the failed stop of the hung {engine}")
            return False
        finally:
            self._end()

    def _held_back(self, engine: str) -> bool:
        """Whether a start of `engine` waits for its restart backoff (a re-check is
        scheduled for its end)."""
        until = self.supervisor.held(engine)
        if until is None:
            return False
        if self._held_timer is None or not self._held_timer.active():
            self._held_timer = self._clock.callLater(until - self._clock.seconds(), self._pump)
        return True

    def stop_now(self) -> Deferred[None]:
        """An operator's stop: it queues like a switch to no engine, so the requests
        on the running engine finish first (never cut); fires once nothing runs, or
        fails with StopFailed (or ProxyStopping). Cancelling it withdraws it."""
        return self._enqueue(OFF, None, bounded=False)

    def state_of(self, engine: str) -> str:
        """`loaded`, `loading`, `unloaded` or `failed` (a crash loop), for /v1/models."""
        if self.runs(engine):
            return "loaded"
        if self.busy and self.switching_to == engine:
            return "loading"
        return "failed" if self.supervisor.failed(engine) else "unloaded"

    def reconsider(self) -> None:
        """Something `protected` depends on changed: move the queue on if it can."""
        self._pump()

    # -- the HostQueue's hooks --------------------------------------------------------
    def _occupant(self) -> str | None:
        return self.running or (self._foreign[0] if self._foreign else None)

    def _starting(self, engine: str | None) -> bool:
        return (self._operation == "switch" and engine == self._switch_target) or (
            self._operation == "stop" and engine == OFF)

    def _begin_switch(self, target: str) -> None:
        if target != OFF and self._held_back(target):
            return
        if target == OFF:
            occupant = self._occupant()
            assert occupant is not None
            work: Deferred[Any] = Deferred.fromCoroutine(self._stop(occupant, idle=False))
        else:
            work = Deferred.fromCoroutine(self._switch(target))
        work.addErrback(
            lambda f: self.log.failure("switch on {host}", f, host=self.host.name))

    def _switch_waits(self, target: str, old: str | None, why: str, busy: int) -> None:
        if target != OFF and self._announced != (target, why):
            self._announced = (target, why)
            self._publish(EngineSwitch(self._clock.seconds(), self.host.name, "waiting",
                                       target, old, waiting_for=busy, reason=why))

    def _settled(self) -> None:
        self._announced = None

    def _end(self) -> None:
        self._operation = None
        observers, self._observers = self._observers, []
        for d in observers:
            d.callback(None)
        self._pump()

    async def _call(self, order: dict[str, Any],
                    timeout: float) -> tuple[dict[str, Any], str | None]:
        """The agent's answer and None, or ({}, why it failed); never raises."""
        try:
            answer = await self._transport.call(self.host, order, timeout)
        except AgentError as e:
            return {}, str(e)
        except Exception as e:
            self.log.failure("agent call {op} on {host}", host=self.host.name, op=order["op"])
            return {}, f"{type(e).__name__}: {e}"
        return answer, answer_error(answer)

    async def _switch(self, engine: str) -> None:
        config = self.host.engines[engine]
        old = self._occupant()
        self._operation = "switch"
        self._switch_target, self.running = engine, None
        self._jumped, self._announced = 0, None
        started = self._clock.seconds()
        self._publish(EngineSwitch(started, self.host.name, "begun", engine, old))
        # exclusive: this host runs one engine at a time, so the agent stops every other one.
        order = {"op": "start", "engine": engine, "command": list(config.command),
                 "health_url": self.host.engine_url(engine) + config.health,
                 "timeout": config.start_timeout_seconds, "grace": self.stop_grace,
                 "exclusive": True}
        timeout = config.start_timeout_seconds + self.stop_grace + START_SLACK
        try:
            _, reason = await self._call(order, timeout)
            elapsed = self._clock.seconds() - started
            self.last_switch = {"at": self._clock.seconds(), "engine": engine,
                                "outcome": "ok" if reason is None else "failed",
                                "reason": reason, "elapsed": round(elapsed, 3)}
            self._switch_target = None
            self._publish(EngineSwitch(self._clock.seconds(), self.host.name,
                                       "done" if reason is None else "failed", engine, old,
                                       reason=reason, elapsed=elapsed))
            if reason is None:
                self.running, self._foreign = engine, ()
                residency = self.host.min_engine_seconds
                self.resident_until = self._clock.seconds() + residency if residency else None
                # Everyone waiting for it goes first (the pump grants the queue's head).
                self._queue.sort(key=lambda w: w.engine != engine)
                return
            self._fail_waiters(engine, SwitchFailed(self.host.name, engine, reason))
            self._operation = "status"
            await self._read_status(f"the failed switch to {engine}")
        finally:
            self._switch_target = None
            self._end()

    async def _status(self) -> tuple[list[dict[str, Any]], str | None]:
        """The engines the agent reports running and None, or ([], why it could not say)."""
        answer, reason = await self._call({"op": "status"}, STATUS_TIMEOUT)
        if reason is not None:
            return [], reason
        engines = answer.get("engines")
        if not (isinstance(engines, list) and all(isinstance(e, dict) for e in engines)):
            return [], f"the agent's status answer has no list of engines: {answer!r:.200}"
        return engines, None

    async def _read_status(self, after: str) -> None:
        """Set `running` from what the agent says runs on the host (never guessed)."""
        engines, reason = await self._status()
        if reason is not None:
            self.running, self._foreign = None, ()
            self.log.warn("state of {host} unknown after {after}: {reason}",
                          host=self.host.name, after=after, reason=reason)
            return
        passed = self._take_state(engines)
        why = "; ".join(f"{name} found, not used: {why}" for name, why in passed)
        self.log.info("state of {host} after {after}: running {engine}{why}",
                      host=self.host.name, after=after, engine=self.running,
                      why=f" ({why})" if why else "")

    def _why_not(self, found: dict[str, Any]) -> str | None:
        """Why an engine the agent reports cannot be adopted, or None."""
        config = self.host.engines.get(found["engine"])
        if config is None:
            return "not one of this host's engines"
        if found.get("command") != list(config.command):
            return "started with another command than the config's"
        if found.get("healthy") is not True:
            return f"not healthy (no 200 from {found.get('health_url')})"
        return None

    def _take_state(self, engines: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """Adopt, of the engines a status answer lists, one that is healthy and configured as
        it runs (the latest started if several: this host runs one at a time); the others
        are foreign: [(engine, why it was not adopted)]."""
        found = [e for e in engines if isinstance(e.get("engine"), str)]
        why = {id(e): self._why_not(e) for e in found}
        fit = [e for e in found if why[id(e)] is None]
        chosen = max(fit, key=_started_at, default=None)
        self.running = chosen["engine"] if chosen is not None else None
        passed = [(e["engine"], why[id(e)] or f"{self.running} was adopted: this host runs "
                   "one engine at a time") for e in found if e is not chosen]
        self._foreign = tuple(name for name, _ in passed)
        return passed

    async def adopt(self) -> None:
        """At start-up: adopt a healthy configured engine the agent reports running (no
        restart); otherwise running is None. Errors are logged, never raised."""
        if self._operation is not None:
            self.log.warn("adopt on {host} skipped: {op} in progress", host=self.host.name,
                          op=self._operation)
            return
        self._operation = "adopt"
        try:
            engines, reason = await self._status()
            if reason is not None:
                self.running, self._foreign = None, ()
                self.log.warn("cannot read what runs on {host}: {reason}",
                              host=self.host.name, reason=reason)
                return
            passed = self._take_state(engines)
            for name in self.running_engines():     # several on a host with memory_gb
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

    def stop_engine(self) -> Deferred[bool]:
        """Idle stop: stop the running engine if nothing uses, awaits or protects it and the
        proxy is not closing; fires with whether it stopped."""
        engine = self.running
        if (engine is None or self._closing or self._operation is not None or self._queue
                or self.held_by
                or self.in_flight() or self.protected(engine)):
            return succeed(False)
        return Deferred.fromCoroutine(self._stop(engine))

    async def _stop(self, engine: str, idle: bool = True) -> bool:
        """Stop the engine on the host: an idle stop (published as such), or an
        operator's (`idle` False: the queue's OFF waiters hear how it went)."""
        self._operation = "stop"
        try:
            started = self._clock.seconds()
            if idle:
                self._publish(IdleStop(started, self.host.name, "begun", engine))
            _, reason = await self._call({"op": "stop", "engine": engine,
                                          "grace": self.stop_grace},
                                         self.stop_grace + STOP_SLACK)
            elapsed = self._clock.seconds() - started
            if idle:
                self._publish(IdleStop(self._clock.seconds(), self.host.name,
                                       "done" if reason is None else "failed", engine,
                                       reason=reason, elapsed=elapsed))
            if reason is None:
                if self.running == engine:
                    self.running = self.resident_until = None
                # Another engine found there is the next occupant an operator's stop stops.
                self._foreign = tuple(e for e in self._foreign if e != engine)
                return True
            self._fail_waiters(OFF, StopFailed(self.host.name, engine, reason))
            self._operation = "status"
            await self._read_status(f"the failed stop of {engine}")
            return False
        finally:
            self._end()


def _started_at(found: dict[str, Any]) -> float:
    value = found.get("started_at")
    return float(value) if isinstance(value, int | float) else 0.0
