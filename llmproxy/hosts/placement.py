"""Placement policies: what a host's scheduler (hosts/scheduler.py) asks what
to start or evict. `IPlacement` is what it asks; `OneEngine` is the policy of a
host that runs one engine at a time (and of an unmanaged host, whose server
always runs); hosts/budget.py's `MemoryBudget` that of a host with `memory_gb`.

One engine at a time:

- the head of the queue is served when its engine runs and a slot is free;
- while the head waits for a switch to another engine, requests for the
  running engine behind it may overtake it when a slot is free: any number of
  them while the engine is resident, then at most `fairness` of them per
  switch, so a steady flow cannot starve the switch;
- a switch (or an operator's stop) starts once the running engine has nothing
  in flight, is not protected, and its residency is over. An engine is
  resident for `min_engine_seconds` after its switch while requests for it
  keep coming (one within RESIDENCY_IDLE seconds): however many requests for
  other engines wait, so one client alternating between models switches the
  host at most once per residency while others use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from llmproxy.core.events import EngineSwitch
from llmproxy.hosts.batching import idle_hold
from llmproxy.hosts.queueerrors import StopFailed, SwitchFailed
from llmproxy.hosts.waiter import OFF

if TYPE_CHECKING:
    from llmproxy.hosts.controller import EngineController
    from llmproxy.hosts.scheduler import Scheduler

RESIDENCY_IDLE = 5.0   # a resident engine holds the host while it had a request this recently


class IPlacement(Protocol):
    """What the scheduler asks a host's placement policy."""

    def runs(self, engine: str | None) -> bool:
        """Whether a request for `engine` (OFF: nothing running) is met by what runs."""

    def current(self) -> str | None:
        """The engine a request for no engine in particular is served by."""

    def busy(self) -> bool:
        """Whether an agent call is under way (nothing is granted past the queue then)."""

    def starting(self, engine: str | None) -> bool:
        """Whether `engine` is being started right now (its waiters do not time out)."""

    def place(self) -> None:
        """One pass over the queue: grant what it may, start or evict what it must."""

    def settled(self) -> None:
        """Nothing waits any more."""

    def closed(self) -> None:
        """The proxy stops (the next pass sees `closing`)."""


class Timer:
    """One re-check of a scheduler's queue at a time: `at(when)` moves the queue on
    then, unless a re-check is pending already."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._q = scheduler
        self._call: IDelayedCall | None = None

    def at(self, when: float) -> None:
        if self._call is None or not self._call.active():
            self._call = self._q.clock.callLater(when - self._q.clock.seconds(), self._q.pump)


class OneEngine:
    """The policy of a host that runs one engine at a time (see the module's
    docstring); `controller` None: an unmanaged host, nothing to switch.
    `held(engine)`: until when a start waits for its restart backoff;
    `protected(engine)`: an upgrade's predecessor still uses it."""

    log = Logger()

    def __init__(self, scheduler: Scheduler, controller: EngineController | None,
                 held: Callable[[str], float | None],
                 protected: Callable[[str], bool]) -> None:
        self._q = scheduler
        self._ctl = controller
        self._held = held
        self._protected = protected
        self._announced: tuple[str, str] | None = None  # (target, why) of the published wait
        self._recheck: IDelayedCall | None = None
        self._held_timer = Timer(scheduler)

    # -- what the scheduler asks --------------------------------------------------------
    def current(self) -> str | None:
        return self._ctl.running if self._ctl is not None else None

    def occupant(self) -> str | None:
        return self._ctl.occupant() if self._ctl is not None else None

    def runs(self, engine: str | None) -> bool:
        if engine == OFF:
            return self.occupant() is None
        return engine is None or engine == self.current()

    def busy(self) -> bool:
        return self._ctl is not None and self._ctl.operation is not None

    def starting(self, engine: str | None) -> bool:
        ctl = self._ctl
        return ctl is not None and ((ctl.operation == "switch" and engine == ctl.target) or (
            ctl.operation == "stop" and engine == OFF))

    def settled(self) -> None:
        self._announced = None

    def closed(self) -> None:
        if self._recheck is not None and self._recheck.active():
            self._recheck.cancel()

    def place(self) -> None:
        q = self._q
        if self.busy():
            return
        if q.closing:
            q.pump_closing()
            return
        while q.waiters and q.servable(q.waiters[0].engine):
            q.grant(q.waiters[0])
        q.time_out_overdue()
        if not q.waiters:
            q.settle()
            return
        if self.runs(q.waiters[0].engine):
            return     # the head waits for a slot, and everyone behind it
        self._overtake()
        self._consider_switch(q.waiters[0].engine)

    # -- what the host reads -------------------------------------------------------------
    def switching_to(self) -> str | None:
        """The engine a switch is running or waiting to go to, if any."""
        if self._ctl is not None and self._ctl.target is not None:
            return self._ctl.target
        head = self._q.waiters[0].engine if self._q.waiters else None
        return head if head and head != self.current() else None

    def state_of(self, engine: str, failed: bool) -> str:
        """`loaded`, `loading`, `unloaded` or `failed` (a crash loop), for /v1/models."""
        if self.runs(engine):
            return "loaded"
        if self.busy() and self.switching_to() == engine:
            return "loading"
        return "failed" if failed else "unloaded"

    def idle(self) -> list[tuple[str, float]]:
        """(engine, idle since) for the engine an idle stop may take, if any."""
        engine = self.current()
        if (engine is None or self._q.in_flight() or self._q.queued() or self.busy()
                or self.switching_to() is not None or self._protected(engine)):
            return []
        return [(engine, self._q.last_used)]

    def stop_idle(self, engine: str | None = None, why: str = "idle") -> Deferred[bool]:
        """Idle stop: stop the running engine if nothing uses, awaits or protects it and
        the proxy is not closing; fires with whether it stopped."""
        engine = self.current()
        q = self._q
        if (engine is None or q.closing or self.busy() or q.waiters
                or q.in_flight() or self._protected(engine)):
            return succeed(False)
        return Deferred.fromCoroutine(self._stop(engine, idle=True))

    # -- the rule ------------------------------------------------------------------------
    def _overtake(self) -> None:
        q = self._q
        resident = self._residency_end() is not None
        for waiter in list(q.waiters[1:]):
            if waiter not in q.waiters or waiter.engine == OFF or not self.runs(waiter.engine):
                continue
            if not q.slot_free(waiter.engine) or not q.may_overtake(waiter, resident):
                return
            q.grant(waiter)

    def _consider_switch(self, target: str | None) -> None:
        assert target is not None
        old = self.occupant()
        busy = self._q.in_flight()
        why = ("busy" if busy else "protected" if old is not None and self._protected(old)
               else "residency" if self._resident(target) else None)
        if why is None:
            self._begin_switch(target)
        elif target != OFF and self._announced != (target, why):
            self._announced = (target, why)
            self._q.publish(EngineSwitch(self._q.clock.seconds(), self._q.host.name,
                                         "waiting", target, old, waiting_for=busy, reason=why))

    def _residency_end(self) -> float | None:
        """When the running engine's residency ends, while it lasts; else None."""
        resident_until = self._ctl.resident_until if self._ctl is not None else None
        if resident_until is None:
            return None
        until = min(resident_until, self._q.last_used + RESIDENCY_IDLE)
        return until if self._q.clock.seconds() < until else None

    def _resident(self, target: str) -> bool:
        """The running engine keeps the host (and a re-check is scheduled)."""
        until = None if target == OFF else self._residency_end() or idle_hold(
            self._q, self.current(), self.runs, self._ctl.last_switch if self._ctl else None)
        if until is None:
            return False
        if self._recheck is not None and self._recheck.active():
            self._recheck.cancel()
        self._recheck = self._q.clock.callLater(until - self._q.clock.seconds(), self._q.pump)
        return True

    def _begin_switch(self, target: str) -> None:
        if self._ctl is None:
            raise AssertionError(f"host {self._q.host.name} has no engines to switch to "
                                 f"{target!r}")
        if target != OFF and self._held_back(target):
            return
        if target == OFF:
            occupant = self.occupant()
            assert occupant is not None
            work: Deferred[Any] = Deferred.fromCoroutine(self._stop(occupant, idle=False))
        else:
            work = Deferred.fromCoroutine(self._switch(target))
        work.addErrback(
            lambda f: self.log.failure("switch on {host}", f, host=self._q.host.name))

    def _held_back(self, engine: str) -> bool:
        """Whether a start of `engine` waits for its restart backoff (a re-check is
        scheduled for its end)."""
        until = self._held(engine)
        if until is None:
            return False
        self._held_timer.at(until)
        return True

    async def _switch(self, target: str) -> None:
        assert self._ctl is not None
        q, host = self._q, self._q.host.name
        q.settle()
        try:
            if await self._ctl.switch(target, lambda reason: q.fail_waiters(
                    target, SwitchFailed(host, target, reason))):
                q.first_for(target)    # everyone waiting for it goes first
        finally:
            q.pump()

    async def _stop(self, engine: str, idle: bool) -> bool:
        assert self._ctl is not None
        q, host = self._q, self._q.host.name
        try:
            return await self._ctl.stop(engine, idle, lambda reason: q.fail_waiters(
                OFF, StopFailed(host, engine, reason)))
        finally:
            q.pump()
