"""The placement policy of a host with a memory budget (`memory_gb`): several
engines resident at once, each on its own url, started and evicted through the
host's queue (hosts/scheduler.py asks it; hosts/residency.py is its rule).

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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from llmproxy.core.events import EngineSwitch
from llmproxy.hosts.adoption import memory_of
from llmproxy.hosts.batching import idle_hold
from llmproxy.hosts.measured import memory_fields
from llmproxy.hosts.placement import Timer
from llmproxy.hosts.queueerrors import StopFailed, SwitchFailed
from llmproxy.hosts.residency import Plan, Resident, plan_start, used_gb
from llmproxy.hosts.waiter import OFF, Waiter

if TYPE_CHECKING:
    from llmproxy.hosts.controller import EngineController
    from llmproxy.hosts.scheduler import Scheduler

Start = tuple[str, Plan | None]   # the first start a pass asked for, and its plan


class MemoryBudget:
    """The engines of one budgeted host (see the module docstring); `held` and
    `protected` as for OneEngine (hosts/placement.py)."""

    log = Logger()

    def __init__(self, scheduler: Scheduler, controller: EngineController,
                 held: Callable[[str], float | None],
                 protected: Callable[[str], bool],
                 measured: Callable[[str], float | None] = lambda engine: None) -> None:
        self._q = scheduler
        self._measured = measured
        self._ctl = controller
        self._held = held
        self._protected = protected
        self._announced: tuple[str, str] | None = None
        self._held_timer = Timer(scheduler)
        self._wake = Timer(scheduler)

    # -- what the scheduler asks --------------------------------------------------------
    def current(self) -> str | None:
        return self._ctl.running

    def runs(self, engine: str | None) -> bool:
        loaded = self._ctl.loaded
        if engine == OFF:
            return not loaded and not self._ctl.foreign
        return engine in loaded if engine is not None else bool(loaded)

    def busy(self) -> bool:
        return self._ctl.operation is not None

    def starting(self, engine: str | None) -> bool:
        return self._ctl.operation == "switch" and engine == self._ctl.target

    def settled(self) -> None:
        self._announced = None

    def closed(self) -> None:
        """Nothing to cancel: a pass of a closing host starts nothing."""

    def place(self) -> None:
        q = self._q
        if q.closing:
            q.pump_closing()
            return
        q.time_out_overdue()
        held: set[str | None] = set()      # engines whose later requests wait in line
        start: Start | None = None          # the first start asked for
        for waiter in list(q.waiters):
            if waiter not in q.waiters:
                continue
            if waiter.engine == OFF:
                if self._stop_all_waiter(waiter):
                    continue
                break               # whoever comes after a stop of every engine waits
            start = self._step(waiter, held, start)
        if not q.waiters:
            q.settle()
        elif start is not None and start[1] is not None:
            self._consider_start(start[0], start[1])

    # -- what the host reads -------------------------------------------------------------
    def switching_to(self) -> str | None:
        """The engine being started, else the first one a request waits to start."""
        return self._ctl.target or next((w.engine for w in self._q.waiters if w.engine and
                                         not w.stop and w.engine not in self._ctl.loaded), None)

    def state_of(self, engine: str, failed: bool) -> str:
        """`loaded`, `loading`, `unloaded` or `failed` (a crash loop), for /v1/models."""
        return "loaded" if engine in self._ctl.loaded else "loading" \
            if engine == self._ctl.target else "failed" if failed else "unloaded"

    def memory_used(self) -> float:
        """The memory the engines on the host hold (those being stopped included)."""
        return used_gb(self._residents(self._q.clock.seconds()))

    def residents(self, now: float) -> list[dict[str, Any]]:
        """Each engine on the host, for /status: state, memory, since, in flight."""
        ctl = self._ctl
        others = [(e, "stopping") for e in sorted(ctl.stopping)] + (
            [(ctl.target, "loading")] if ctl.target is not None else [])
        return [{"engine": e, "state": "loaded", **self._memory(e),
                 "since_seconds": round(now - since, 1), "in_flight": self._q.in_flight(e)}
                for e, since in ctl.loaded.items()] + [
            {"engine": e, "state": state, **self._memory(e), "since_seconds": None,
             "in_flight": 0} for e, state in others]

    def _memory(self, engine: str) -> dict[str, float | None]:   # for /status
        return memory_fields(self._q.host, engine, self._measured(engine), self._gb(engine))

    def idle(self) -> list[tuple[str, float]]:
        """(engine, idle since) for each resident engine an idle stop may take:
        nothing in flight, queued or protected, and no agent call under way."""
        q = self._q
        if self.busy() or q.closing:
            return []
        wanted = {w.engine for w in q.waiters}
        return [(e, max(since, q.engine_used.get(e, since)))
                for e, since in self._ctl.loaded.items()
                if not q.in_flight(e) and e not in wanted and not self._protected(e)]

    def stop_idle(self, engine: str | None = None, why: str = "idle") -> Deferred[bool]:
        """An idle (or ttl) stop of `engine`, if it is still a candidate."""
        if engine is None or engine not in dict(self.idle()):
            return succeed(False)
        return Deferred.fromCoroutine(self._stop_resident(engine, why))

    # -- the rule ------------------------------------------------------------------------
    def _stop_all_waiter(self, waiter: Waiter) -> bool:
        """An operator's bare stop at the head: done (True) once nothing runs, begun
        once nothing is in flight."""
        q = self._q
        if waiter is not q.waiters[0] or self.busy():
            return False
        if self.runs(OFF):
            q.grant(waiter)
            return True
        if not q.in_flight():
            Deferred.fromCoroutine(self._stop_all()).addErrback(
                lambda f: self.log.failure("stop on {host}", f, host=q.host.name))
        return False

    def _step(self, waiter: Waiter, held: set[str | None], start: Start | None) -> Start | None:
        """One waiter in a pass over the queue; the first start asked for so far."""
        engine = waiter.engine
        if waiter.stop or engine in held:
            self._stop_waiter(waiter, held)
        elif self.runs(engine):
            if self._q.slot_free(engine) and self._may_overtake(waiter, start):
                self._q.grant(waiter)
            else:
                held.add(engine)
        else:
            held.add(engine)
            if start is None and engine is not None:
                return engine, None if self.busy() else self._plan(engine)
        return start

    def _stop_waiter(self, waiter: Waiter, held: set[str | None]) -> None:
        """An operator's stop of one engine: begun once nothing of it is in flight
        and no agent call is under way; done at once when it is not resident."""
        engine, ctl = waiter.engine, self._ctl
        if waiter.stop and engine not in held:
            if engine not in ctl.loaded and engine not in ctl.stopping and \
                    not self.starting(engine):
                self._q.grant(waiter)          # nothing to stop
                return
            if engine in ctl.loaded and not self._q.in_flight(engine) and not self.busy():
                Deferred.fromCoroutine(self._operator_stop(waiter))
        held.add(engine)

    def _may_overtake(self, waiter: Waiter, start: Start | None) -> bool:
        """Whether a request for a resident `engine` may pass the start waiting
        ahead of it: never when the start is about to evict that engine, freely
        unless the start waits for that engine to fall idle past its residency,
        and then as the host's schedule lets it (hosts/batching.py)."""
        plan, engine = start[1] if start is not None else None, waiter.engine
        if plan is None:
            return True
        if plan.ready:
            return engine not in plan.evict
        if engine not in plan.busy:
            return True          # the start does not wait for it: passing costs nothing
        resident = self._ctl.until.get(engine or "", 0.0) > self._q.clock.seconds()
        return self._q.may_overtake(waiter, resident)

    def _residents(self, now: float, target: str | None = None) -> list[Resident]:
        """The engines on the host for the eviction rule. For the start of
        `target`, only requests ahead of its first one keep an engine wanted:
        those behind it wait for it (the fairness bound put them there)."""
        q, ctl = self._q, self._ctl
        wanted: dict[str | None, int] = {}
        for w in q.waiters:
            if target is not None and w.engine == target:
                break
            if not w.stop:
                wanted[w.engine] = wanted.get(w.engine, 0) + 1
        out = [Resident(e, self._gb(e), q.engine_used.get(e, since), self._until(e),
                        q.in_flight(e), wanted.get(e, 0), self._protected(e))
               for e, since in ctl.loaded.items()]
        out += [Resident(e, self._gb(e), 0.0, stopping=True) for e in ctl.stopping]
        if ctl.target is not None:
            out.append(Resident(ctl.target, self._gb(ctl.target), now, in_flight=1))
        return out

    def _plan(self, engine: str) -> Plan:
        now = self._q.clock.seconds()
        return plan_start(self._gb(engine), self._q.host.memory_gb or 0.0,
                          self._residents(now, engine), now)

    def _until(self, engine: str) -> float | None:   # residency, or batch idle hold if later
        hold = idle_hold(self._q, engine, self.runs, self._ctl.last_switch) or 0.0
        return max(self._ctl.until.get(engine) or 0.0, hold) or None

    def _gb(self, engine: str) -> float:
        """What `engine` counts for: measured, else declared, else the whole budget."""
        measured = self._measured(engine)
        return memory_of(self._q.host, engine) if measured is None else measured

    def _consider_start(self, target: str, plan: Plan) -> None:
        q = self._q
        until = self._held(target)
        if until is not None:
            self._held_timer.at(until)     # the start waits for its restart backoff
            return
        if plan.ready:
            Deferred.fromCoroutine(self._start(target, plan.evict)).addErrback(
                lambda f: self.log.failure("start on {host}", f, host=q.host.name))
            return
        why, busy = "memory", sum(q.in_flight(e) for e in plan.busy)
        if self._announced != (target, why):
            self._announced = (target, why)
            q.publish(EngineSwitch(q.clock.seconds(), q.host.name, "waiting", target,
                                   ", ".join(plan.busy) or None, waiting_for=busy, reason=why))
        ends = [t for e in self._ctl.loaded if (t := self._until(e)) and t > q.clock.seconds()]
        if ends:
            self._wake.at(min(ends))

    # -- the agent calls, and the queue moved on after each --------------------------------
    async def _start(self, target: str, evict: tuple[str, ...]) -> None:
        q, host = self._q, self._q.host.name
        q.settle()
        try:
            if await self._ctl.start(target, evict, lambda e: q.in_flight(e) > 0,
                                     lambda reason: q.fail_waiters(
                                         target, SwitchFailed(host, target, reason))):
                q.first_for(target)    # its waiters first, and its batch begins
        finally:
            q.pump()

    async def _stop_resident(self, engine: str, why: str) -> bool:
        try:
            return await self._ctl.stop_beside(engine, why)
        finally:
            self._q.pump()

    async def _operator_stop(self, waiter: Waiter) -> None:
        q = self._q
        assert waiter.engine is not None

        def stopped(reason: str | None) -> None:
            if waiter in q.waiters:
                if reason is None:
                    q.grant(waiter)
                else:
                    q.fail(waiter, StopFailed(q.host.name, str(waiter.engine), reason))
        try:
            await self._ctl.stop_beside(waiter.engine, "operator", stopped)
        finally:
            q.pump()

    async def _stop_all(self) -> None:
        q = self._q
        try:
            await self._ctl.stop_all(lambda engines, reason: q.fail_waiters(
                OFF, StopFailed(q.host.name, engines, reason)))
        finally:
            q.pump()
