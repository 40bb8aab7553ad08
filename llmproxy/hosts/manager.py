"""One HostManager per managed host: which engine runs, who uses it, and switching between them.

A request takes a Lease on the engine it needs. When that engine is not the one running, the
request queues; the switch starts once every lease on the running engine is released (a running
stream is never cut), and all requests waiting for the same engine share that one agent call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmproxy.config import HostConfig
from llmproxy.core.events import EngineSwitch, IdleStop
from llmproxy.core.hub import Hub, Publish
from llmproxy.hosts.agentclient import AgentError, IAgentTransport, answer_error

START_SLACK = 30.0  # added to an engine's start_timeout_seconds (+ stop grace) for the ssh call
STOP_SLACK = 30.0  # added to the stop grace for the ssh call of an idle stop
STATUS_TIMEOUT = 30.0


class SwitchFailed(Exception):
    """A request's engine could not be made to run; str() is
    ``switching host H to engine E failed: <reason>``."""

    def __init__(self, host: str, engine: str, reason: str) -> None:
        self.host = host
        self.engine = engine
        self.reason = reason
        super().__init__(f"switching host {host} to engine {engine} failed: {reason}")


class ProxyStopping(Exception):
    """A request waited for a switch that will not come: the proxy stops. Nothing
    of it reached an engine, so it may be answered elsewhere (a successor)."""

    def __init__(self, host: str, engine: str) -> None:
        self.host = host
        self.engine = engine
        super().__init__(f"host {host} will not switch to engine {engine}: the proxy is stopping")


@dataclass
class Lease:
    """One request's hold on the running engine; the engine is not switched or stopped until
    every lease on it is released."""

    engine: str
    _on_release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        """Give the engine back; calling it again does nothing."""
        callback, self._on_release = self._on_release, None
        if callback is not None:
            callback()


@dataclass
class _Waiter:
    engine: str
    deferred: Deferred[Lease]


class HostManager:
    """The engine of one managed host: adoption at start-up, leases, switches and idle stops.

    Fairness: while a switch waits for the running engine's requests to finish, new requests
    for the running engine are still granted at once, but at most `fairness` of them; later
    ones queue behind the switch, so a steady stream of requests cannot starve it.

    `protected(engine)` is a settable hook: while it returns True for the engine on the host
    (during an upgrade, a predecessor process's streams still use it), that engine is neither
    switched away from nor stopped; whoever changes what it says calls `reconsider()`.

    Switches and idle stops are published as events (`EngineSwitch`, `IdleStop`).
    """

    log = Logger()

    def __init__(self, host: HostConfig, transport: IAgentTransport, clock: IReactorTime, *,
                 publish: Publish | None = None, fairness: int = 8,
                 stop_grace: float = 10.0) -> None:
        self.host = host
        self._publish = publish or Hub.logging().publish
        self.fairness = fairness
        self.stop_grace = stop_grace
        self.running: str | None = None
        self.last_used: float = clock.seconds()
        self.last_switch: dict[str, Any] | None = None
        self.protected: Callable[[str], bool] = lambda engine: False
        self._transport = transport
        self._clock = clock
        self._closing = False
        self._leases: Counter[str] = Counter()
        self._queue: list[_Waiter] = []
        self._operation: str | None = None  # "adopt", "switch", "status" or "stop"
        self._switch_target: str | None = None
        self._observers: list[Deferred[None]] = []
        self._jumped = 0  # grants for the running engine while a switch waits
        self._announced: tuple[str, str] | None = None  # (target, why) of the published wait
        self._foreign: str | None = None  # an engine found on the host but not adopted
        self._pumping = False
        self._again = False

    @property
    def closing(self) -> bool:
        """Set once the proxy stops: no switch or stop starts after that."""
        return self._closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self._closing = value
        if value:
            self._pump()  # fail what waits for a switch that will not come

    @property
    def switching_to(self) -> str | None:
        """The engine a switch is running or waiting to go to, if any."""
        if self._switch_target is not None:
            return self._switch_target
        if self._queue and self._queue[0].engine != self.running:
            return self._queue[0].engine
        return None

    @property
    def busy(self) -> bool:
        """Whether an agent call (adopt, switch, status re-read, stop) is in progress."""
        return self._operation is not None

    def in_flight(self, engine: str | None = None) -> int:
        """Leases held, on `engine` or on any engine."""
        return self._leases[engine] if engine is not None else sum(self._leases.values())

    def queued(self) -> int:
        """Requests waiting for a switch."""
        return len(self._queue)

    def operations(self) -> list[Deferred[Any]]:
        """Deferreds that fire when the agent call in progress (switch, stop...) is done."""
        if self._operation is None:
            return []
        d: Deferred[None] = Deferred()
        self._observers.append(d)
        return [d]

    def snapshot(self, now: float) -> dict[str, Any]:
        """This host's engine state for /status."""
        occupant = self.running or self._foreign
        return {
            "running": self.running,
            "switching_to": self.switching_to,
            "operation": self._operation,
            "in_flight": self.in_flight(),
            "queued": len(self._queue),
            "protected": occupant is not None and self.protected(occupant),
            "last_switch": dict(self.last_switch) if self.last_switch else None,
            "last_used_seconds_ago": round(max(0.0, now - self.last_used), 1),
        }

    def acquire(self, engine: str) -> Deferred[Lease]:
        """A Lease on `engine` once it runs; fails with SwitchFailed if it cannot be started.
        Cancelling the Deferred takes the request out of the queue."""
        if engine not in self.host.engines:
            return fail(SwitchFailed(self.host.name, engine, "the host has no such engine"))
        if self._grantable(engine):
            if self._queue:
                self._jumped += 1
            return succeed(self._lease(engine))

        def cancel(d: Deferred[Lease]) -> None:
            if waiter in self._queue:
                self._queue.remove(waiter)
            self._pump()  # the head of the queue may have changed

        waiter = _Waiter(engine, Deferred(cancel))
        self._queue.append(waiter)
        self._pump()
        return waiter.deferred

    def _grantable(self, engine: str) -> bool:
        if self._operation is not None or engine != self.running:
            return False
        return not self._queue or self._closing or self._jumped < self.fairness

    def _lease(self, engine: str) -> Lease:
        self._leases[engine] += 1
        self.last_used = self._clock.seconds()

        def release() -> None:
            self._leases[engine] -= 1
            self.last_used = self._clock.seconds()
            self._pump()

        return Lease(engine, release)

    def _pump(self) -> None:
        """Move the queue on; re-entrant calls (from callbacks it fires) are folded in."""
        if self._pumping:
            self._again = True
            return
        self._pumping = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._pump_once()
        finally:
            self._pumping = False

    def _pump_once(self) -> None:
        if self._operation is not None:
            return
        if self._closing:
            waiters, self._queue = self._queue, []
            for waiter in waiters:
                if waiter.engine == self.running:
                    waiter.deferred.callback(self._lease(waiter.engine))
                else:
                    waiter.deferred.errback(ProxyStopping(self.host.name, waiter.engine))
            return
        while self._queue and self._queue[0].engine == self.running:
            waiter = self._queue.pop(0)
            waiter.deferred.callback(self._lease(waiter.engine))
        if not self._queue:
            self._jumped = 0
            self._announced = None
            return
        target, old = self._queue[0].engine, self.running or self._foreign
        busy = self.in_flight()
        why = "busy" if busy else "protected" if old is not None and self.protected(old) else None
        if why is not None:
            if self._announced != (target, why):
                self._announced = (target, why)
                self._publish(EngineSwitch(self._clock.seconds(), self.host.name, "waiting",
                                           target, old, waiting_for=busy, reason=why))
            return
        Deferred.fromCoroutine(self._switch(target)).addErrback(
            lambda f: self.log.failure("switch on {host}", f, host=self.host.name))

    def reconsider(self) -> None:
        """Something `protected` depends on changed: move the queue on if it can."""
        self._pump()

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
        old = self.running or self._foreign
        self._operation = "switch"
        self._switch_target, self.running = engine, None
        self._jumped, self._announced = 0, None
        started = self._clock.seconds()
        self._publish(EngineSwitch(started, self.host.name, "begun", engine, old))
        order = {"op": "start", "engine": engine, "command": list(config.command),
                 "health_url": self.host.url + config.health,
                 "timeout": config.start_timeout_seconds, "grace": self.stop_grace}
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
                self.running, self._foreign = engine, None
                # Everyone waiting for it goes first (the pump grants the queue's head).
                self._queue.sort(key=lambda w: w.engine != engine)
                return
            failed = [w for w in self._queue if w.engine == engine]
            self._queue = [w for w in self._queue if w.engine != engine]
            for waiter in failed:
                waiter.deferred.errback(SwitchFailed(self.host.name, engine, reason))
            self._operation = "status"
            await self._read_status(f"the failed switch to {engine}")
        finally:
            self._switch_target = None
            self._end()

    async def _read_status(self, after: str) -> None:
        """Set `running` from what the agent says runs on the host (never guessed)."""
        answer, reason = await self._call({"op": "status"}, STATUS_TIMEOUT)
        if reason is not None:
            self.running = self._foreign = None
            self.log.warn("state of {host} unknown after {after}: {reason}",
                          host=self.host.name, after=after, reason=reason)
            return
        why = self._take_state(answer)
        self.log.info("state of {host} after {after}: running {engine}{why}",
                      host=self.host.name, after=after, engine=self.running,
                      why=f" ({answer.get('engine')} found, not used: {why})" if why else "")

    def _take_state(self, answer: dict[str, Any]) -> str | None:
        """Adopt the engine of a status answer if it is healthy and configured as it runs;
        else why not (None when nothing runs)."""
        engine = answer.get("engine")
        self.running = self._foreign = None
        if not isinstance(engine, str):
            return None
        config = self.host.engines.get(engine)
        if config is None:
            why = "not one of this host's engines"
        elif answer.get("command") != list(config.command):
            why = "started with another command than the config's"
        elif answer.get("healthy") is not True:
            why = "not healthy"
        else:
            self.running = engine
            return None
        self._foreign = engine
        return why

    async def adopt(self) -> None:
        """At start-up: adopt a healthy configured engine the agent reports running (no
        restart); otherwise running is None. Errors are logged, never raised."""
        if self._operation is not None:
            self.log.warn("adopt on {host} skipped: {op} in progress", host=self.host.name,
                          op=self._operation)
            return
        self._operation = "adopt"
        try:
            answer, reason = await self._call({"op": "status"}, STATUS_TIMEOUT)
            if reason is not None:
                self.running = self._foreign = None
                self.log.warn("cannot read what runs on {host}: {reason}",
                              host=self.host.name, reason=reason)
                return
            why = self._take_state(answer)
            if self.running is not None:
                self.log.info("adopted engine {engine} on {host} (pid {pid}), no restart",
                              engine=self.running, host=self.host.name, pid=answer.get("pid"))
            elif why is not None:
                self.log.warn("engine {engine} on {host} not adopted: {why}",
                              engine=answer.get("engine"), host=self.host.name, why=why)
            else:
                self.log.info("no engine runs on {host}", host=self.host.name)
        finally:
            self._end()

    def stop_engine(self) -> Deferred[bool]:
        """Idle stop: stop the running engine if nothing uses, awaits or protects it and the
        proxy is not closing; fires with whether it stopped."""
        engine = self.running
        if (engine is None or self._closing or self._operation is not None or self._queue
                or self.in_flight() or self.protected(engine)):
            return succeed(False)
        return Deferred.fromCoroutine(self._stop(engine))

    async def _stop(self, engine: str) -> bool:
        self._operation = "stop"
        try:
            started = self._clock.seconds()
            self._publish(IdleStop(started, self.host.name, "begun", engine))
            _, reason = await self._call({"op": "stop", "grace": self.stop_grace},
                                         self.stop_grace + STOP_SLACK)
            elapsed = self._clock.seconds() - started
            self._publish(IdleStop(self._clock.seconds(), self.host.name,
                                   "done" if reason is None else "failed", engine,
                                   reason=reason, elapsed=elapsed))
            if reason is None:
                self.running = self._foreign = None
                return True
            self._operation = "status"
            await self._read_status(f"the failed stop of {engine}")
            return False
        finally:
            self._end()
