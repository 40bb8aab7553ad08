"""A managed host with a memory budget (`memory_gb`): several engines resident
at once, each on its own url, started and evicted through the host's queue.

- A request for a resident engine is served when a slot is free (the engine's
  own `max_concurrent` counts its requests, the host's all of them), in
  arrival order among the requests for that engine.
- The first request for an engine that is not resident starts it: at once when
  it fits, else after stopping idle engines least recently used first
  (`residency.plan_start`); when that is not enough, the start waits, and
  requests that keep one of those busy overtake it at most `fairness` times.
- One agent call at a time (evictions and a start are one operation), while
  the other resident engines keep serving.
- An engine with a request in flight or queued is never stopped. Every stop
  says why (`evicted for E`, `idle`, `ttl`, `operator`).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall

from llmproxy.core.events import EngineSwitch, IdleStop
from llmproxy.hosts.manager import START_SLACK, STOP_SLACK, HostManager, StopFailed
from llmproxy.hosts.queue import OFF, SwitchFailed
from llmproxy.hosts.residency import Plan, Resident, plan_start, used_gb


class ResidentHostManager(HostManager):
    """The engines of one budgeted host (see the module docstring). `running`
    is the engine started last, for what reads one name; `loaded` holds them
    all, with the time each became resident."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loaded: dict[str, float] = {}      # engine -> since when it serves
        self.stopping: set[str] = set()
        self._until: dict[str, float] = {}      # residency ends (min_engine_seconds)
        self._wake: IDelayedCall | None = None

    # -- what others read ----------------------------------------------------------
    def running_engines(self) -> tuple[str, ...]:
        return tuple(self.loaded)

    @property
    def switching_to(self) -> str | None:
        """The engine being started, else the first one a request waits to start."""
        return self._switch_target or next((w.engine for w in self._queue if w.engine and
                                            not w.stop and w.engine not in self.loaded), None)

    def memory_used(self) -> float:
        """The memory the engines on the host hold (those being stopped included)."""
        return used_gb(self._residents(self._clock.seconds()))

    def residents(self, now: float) -> list[dict[str, Any]]:
        """Each engine on the host, for /status: state, memory, since, in flight."""
        others = [(e, "stopping") for e in sorted(self.stopping)] + (
            [(self._switch_target, "loading")] if self._switch_target is not None else [])
        return [{"engine": e, "state": "loaded", "memory_gb": self._gb(e),
                 "since_seconds": round(now - since, 1), "in_flight": self.in_flight(e)}
                for e, since in self.loaded.items()] + [
            {"engine": e, "state": state, "memory_gb": self._gb(e), "since_seconds": None,
             "in_flight": 0} for e, state in others]

    def state_of(self, engine: str) -> str:
        """`loaded`, `loading`, `unloaded` or `failed` (a crash loop), for /v1/models."""
        if engine in self.loaded:
            return "loaded"
        if engine == self._switch_target:
            return "loading"
        return "failed" if self.supervisor.failed(engine) else "unloaded"

    def snapshot(self, now: float) -> dict[str, Any]:
        doc = super().snapshot(now)
        doc["resident"] = self.residents(now)
        doc["memory_gb"] = {"used": self.memory_used(), "budget": self.host.memory_gb}
        return doc

    def stop_one(self, engine: str) -> Deferred[None]:
        """An operator's stop of `engine` alone, through the queue: its requests
        in flight finish first, later ones wait behind the stop (and start it
        again after). Fires once it is stopped; StopFailed if the agent failed."""
        return self._enqueue(engine, None, bounded=False, stop=True)

    def idle_candidates(self) -> list[tuple[str, float]]:
        """(engine, idle since) for each resident engine an idle stop may take:
        nothing in flight, queued or protected, and no agent call under way."""
        if self._operation is not None or self._closing:
            return []
        wanted = {w.engine for w in self._queue}
        return [(e, max(since, self.engine_used.get(e, since)))
                for e, since in self.loaded.items()
                if not self.in_flight(e) and e not in wanted and not self.protected(e)]

    def stop_engine(self, engine: str | None = None, why: str = "idle") -> Deferred[bool]:
        """An idle (or ttl) stop of `engine`, if it is still a candidate."""
        if engine is None or engine not in dict(self.idle_candidates()):
            return succeed(False)
        return Deferred.fromCoroutine(self._stop_resident(engine, why))

    # -- the rule ------------------------------------------------------------------
    def _runs(self, engine: str | None) -> bool:
        if engine == OFF:
            return not self.loaded and not self._foreign
        return engine in self.loaded if engine is not None else bool(self.loaded)

    def _engine_of(self, asked: str | None) -> str | None:
        return asked if asked is not None else self.running

    def _slot_free(self, engine: str | None) -> bool:
        preset = self.host.engines.get(engine) if engine else None
        if preset is not None and preset.max_concurrent is not None \
                and self.in_flight(engine) >= preset.max_concurrent:
            return False
        limit = self.host.max_concurrent
        return limit is None or self.in_flight() < limit

    def _starting(self, engine: str | None) -> bool:
        return self._operation == "switch" and engine == self._switch_target

    def _pump_once(self) -> None:
        if self._closing:
            self._pump_closing()
            return
        for waiter in [w for w in self._queue if w.overdue]:
            self._time_out(waiter)
        held: set[str | None] = set()      # engines whose later requests wait in line
        start: tuple[str, Plan | None] | None = None   # the first start asked for
        for waiter in list(self._queue):
            if waiter not in self._queue:
                continue
            if waiter.engine == OFF:
                if self._stop_all_waiter(waiter):
                    continue
                break               # whoever comes after a stop of every engine waits
            start = self._step(waiter, held, start)
        if not self._queue:
            self._jumped = 0
            self._settled()
        elif start is not None and start[1] is not None:
            self._consider_start(start[0], start[1])

    def _stop_all_waiter(self, waiter: Any) -> bool:
        """An operator's bare stop at the head: done (True) once nothing runs, begun
        once nothing is in flight."""
        if waiter is not self._queue[0] or self._operation is not None:
            return False
        if self._runs(OFF):
            self._queue.remove(waiter)
            self._grant(waiter)
            return True
        if not self.in_flight():
            self._begin_switch(OFF)
        return False

    def _step(self, waiter: Any, held: set[str | None],
              start: tuple[str, Plan | None] | None) -> tuple[str, Plan | None] | None:
        """One waiter in a pass over the queue; the first start asked for so far."""
        engine = waiter.engine
        if waiter.stop or engine in held:
            self._stop_waiter(waiter, held)
        elif self._runs(engine):
            if self._slot_free(engine) and self._may_overtake(engine, start):
                self._queue.remove(waiter)
                self._grant(waiter)
            else:
                held.add(engine)
        else:
            held.add(engine)
            if start is None and engine is not None:
                plan = None if self._operation is not None else self._plan(engine)
                return engine, plan
        return start

    def _stop_waiter(self, waiter: Any, held: set[str | None]) -> None:
        """An operator's stop of one engine: begun once nothing of it is in flight
        and no agent call is under way; done at once when it is not resident."""
        engine = waiter.engine
        if waiter.stop and engine not in held:
            if engine not in self.loaded and engine not in self.stopping and \
                    not self._starting(engine):
                self._queue.remove(waiter)
                self._grant(waiter)          # nothing to stop
                return
            if engine in self.loaded and not self.in_flight(engine) and \
                    self._operation is None:
                Deferred.fromCoroutine(self._operator_stop(waiter))
        held.add(engine)

    def _may_overtake(self, engine: str | None, start: tuple[str, Plan | None] | None) -> bool:
        """Whether a request for a resident `engine` may pass the start waiting
        ahead of it: never when the start is about to evict that engine, freely
        unless the start waits for that engine to fall idle past its residency,
        and then at most `fairness` times."""
        plan = start[1] if start is not None else None
        if plan is None:
            return True
        if plan.ready:
            return engine not in plan.evict
        if engine not in plan.busy or self._until.get(engine, 0.0) > self._clock.seconds():
            return True          # (a resident engine cannot be evicted: passing costs nothing)
        if self._jumped >= self.fairness:
            return False
        self._jumped += 1
        return True

    def _residents(self, now: float, target: str | None = None) -> list[Resident]:
        """The engines on the host for the eviction rule. For the start of
        `target`, only requests ahead of its first one keep an engine wanted:
        those behind it wait for it (the fairness bound put them there)."""
        wanted: dict[str | None, int] = {}
        for w in self._queue:
            if target is not None and w.engine == target:
                break
            if not w.stop:
                wanted[w.engine] = wanted.get(w.engine, 0) + 1
        out = [Resident(e, self._gb(e), self.engine_used.get(e, since), self._until.get(e),
                        self.in_flight(e), wanted.get(e, 0), self.protected(e))
               for e, since in self.loaded.items()]
        out += [Resident(e, self._gb(e), 0.0, stopping=True) for e in self.stopping]
        if self._switch_target is not None:
            out.append(Resident(self._switch_target, self._gb(self._switch_target), now,
                                in_flight=1))
        return out

    def _plan(self, engine: str) -> Plan:
        now = self._clock.seconds()
        return plan_start(self._gb(engine), self.host.memory_gb or 0.0,
                          self._residents(now, engine), now)

    def _gb(self, engine: str) -> float:
        preset = self.host.engines.get(engine)
        return (preset.memory_gb or 0.0) if preset is not None else 0.0

    def _consider_start(self, target: str, plan: Plan) -> None:
        if self._held_back(target):
            return
        if plan.ready:
            self._begin_start(target, plan.evict)
            return
        self._switch_waits(target, ", ".join(plan.busy) or None, "memory",
                           sum(self.in_flight(e) for e in plan.busy))
        ends = [t for t in self._until.values() if t > self._clock.seconds()]
        if ends and (self._wake is None or not self._wake.active()):
            self._wake = self._clock.callLater(min(ends) - self._clock.seconds(), self._pump)

    def _begin_switch(self, target: str) -> None:
        if target == OFF:
            Deferred.fromCoroutine(self._stop_all()).addErrback(
                lambda f: self.log.failure("stop on {host}", f, host=self.host.name))
        else:
            self._begin_start(target, ())

    def _begin_start(self, target: str, evict: tuple[str, ...]) -> None:
        Deferred.fromCoroutine(self._start(target, evict)).addErrback(
            lambda f: self.log.failure("start on {host}", f, host=self.host.name))

    # -- the agent calls -----------------------------------------------------------
    async def _start(self, engine: str, evict: tuple[str, ...]) -> None:
        """Stop `evict` (idle, least recently used first), then start `engine`
        beside the engines that stay: one operation."""
        config = self.host.engines[engine]
        self._operation, self._switch_target = "switch", engine
        self._jumped, self._announced = 0, None
        started = self._clock.seconds()
        previous = ", ".join(evict) or None
        self._publish(EngineSwitch(started, self.host.name, "begun", engine, previous))
        try:
            for victim in evict:
                if self.in_flight(victim) or victim not in self.loaded:
                    # Taken again since the plan (never cut a stream): plan anew.
                    self._publish(EngineSwitch(self._clock.seconds(), self.host.name,
                                               "waiting", engine, victim, reason="memory"))
                    return None
                reason = await self._stop_call(victim, f"evicted for {engine}")
                if reason is not None:
                    return await self._start_failed(engine, previous, started,
                                                    f"evicting {victim} failed: {reason}")
            order = {"op": "start", "engine": engine, "command": list(config.command),
                     "health_url": self.host.engine_url(engine) + config.health,
                     "timeout": config.start_timeout_seconds, "grace": self.stop_grace}
            _, reason = await self._call(order, config.start_timeout_seconds
                                         + self.stop_grace + START_SLACK)
            if reason is not None:
                return await self._start_failed(engine, previous, started, reason)
            now = self._clock.seconds()
            self.loaded[engine] = now
            self.running = engine
            if self.host.min_engine_seconds:
                self._until[engine] = now + self.host.min_engine_seconds
            self.last_switch = {"at": now, "engine": engine, "outcome": "ok", "reason": None,
                                "elapsed": round(now - started, 3)}
            self._publish(EngineSwitch(now, self.host.name, "done", engine, previous,
                                       elapsed=now - started))
        finally:
            self._switch_target = None
            self._end()

    async def _start_failed(self, engine: str, previous: str | None, started: float,
                            reason: str) -> None:
        now = self._clock.seconds()
        self.last_switch = {"at": now, "engine": engine, "outcome": "failed", "reason": reason,
                            "elapsed": round(now - started, 3)}
        self._publish(EngineSwitch(now, self.host.name, "failed", engine, previous,
                                   reason=reason, elapsed=now - started))
        self._fail_waiters(engine, SwitchFailed(self.host.name, engine, reason))
        self._switch_target, self._operation = None, "status"
        await self._read_status(f"the failed start of {engine}")

    def _drop(self, engine: str) -> None:
        self.loaded.pop(engine, None)
        self._until.pop(engine, None)
        if self.running == engine:
            self.running = next(reversed(self.loaded), None)

    async def _stop_call(self, engine: str, why: str) -> str | None:
        """Stop one resident engine (it takes no request from now on); None once
        stopped, else the agent's reason. Published as an IdleStop with `why`."""
        self._drop(engine)
        self.stopping.add(engine)
        started = self._clock.seconds()
        self._publish(IdleStop(started, self.host.name, "begun", engine, why=why))
        try:
            _, reason = await self._call({"op": "stop", "engine": engine,
                                          "grace": self.stop_grace},
                                         self.stop_grace + STOP_SLACK)
        finally:
            self.stopping.discard(engine)
        self._publish(IdleStop(self._clock.seconds(), self.host.name,
                               "done" if reason is None else "failed", engine, reason=reason,
                               elapsed=self._clock.seconds() - started, why=why))
        return reason

    async def _stop_resident(self, engine: str, why: str) -> bool:
        self._operation = "stop"
        try:
            reason = await self._stop_call(engine, why)
            if reason is not None:
                self._operation = "status"
                await self._read_status(f"the failed stop of {engine}")
            return reason is None
        finally:
            self._end()

    async def _operator_stop(self, waiter: Any) -> None:
        self._operation = "stop"
        try:
            reason = await self._stop_call(waiter.engine, "operator")
            if waiter in self._queue:
                self._queue.remove(waiter)
                if reason is None:
                    self._grant(waiter)
                else:
                    self._disarm(waiter)
                    waiter.deferred.errback(StopFailed(self.host.name, waiter.engine, reason))
            if reason is not None:
                self._operation = "status"
                await self._read_status(f"the failed stop of {waiter.engine}")
        finally:
            self._end()

    async def _stop_all(self) -> None:
        """An operator's bare stop: every engine on the host, in one agent call."""
        self._operation = "stop"
        try:
            engines = list(self.loaded) + list(self._foreign)
            self.stopping.update(engines)
            self.loaded, self.running = {}, None
            _, reason = await self._call({"op": "stop", "grace": self.stop_grace},
                                         self.stop_grace + STOP_SLACK)
            self.stopping.clear()
            if reason is None:
                self._foreign, self._until = (), {}
                return
            self._fail_waiters(OFF, StopFailed(self.host.name, ", ".join(engines), reason))
            self._operation = "status"
            await self._read_status("the failed stop")
        finally:
            self._end()

    def _take_state(self, engines: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """Adopt every engine a status answer lists that is healthy and configured
        as it runs, while they fit the budget; the others are foreign."""
        found = sorted((e for e in engines if isinstance(e.get("engine"), str)),
                       key=lambda e: e.get("started_at") or 0)
        now, budget = self._clock.seconds(), self.host.memory_gb or 0.0
        self.loaded, self._until, passed = {}, {}, []
        for e in found:
            name, why = e["engine"], self._why_not(e)
            if why is None and sum(map(self._gb, self.loaded)) + self._gb(name) > budget:
                why = "over the host's memory_gb with the engines adopted before it"
            if why is None:
                self.loaded[name] = now
            else:
                passed.append((name, why))
        self.running = next(reversed(self.loaded), None)
        self._foreign = tuple(name for name, _ in passed)
        return passed
