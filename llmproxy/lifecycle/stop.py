"""The graceful stop: one chain of steps under one budget that starts at the signal.

    readiness 503 + STOPPING=1
    -> prestop_seconds, still accepting (for load balancers whose checks lag)
    -> stop admission: no new connection; idle keep-alive ones closed;
       every response from now on says `Connection: close`
    -> drain: wait for the requests in flight, streams included, until
       t0 + prestop + drain_seconds
    -> at that deadline cut what is left; each cut request's handler gets
       CUT_LOG_SECONDS to log its line
    -> wait up to ENGINE_WAIT_SECONDS for an engine operation already running
       (an idle stop or a switch: stopping it half-way would leave a host
       in an unknown state)
    -> stop the remaining services.

No step can extend the whole past t0 + budget: every wait is bounded by its
own cap and by what is left of the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmproxy.core.clockwaits import sleep, within
from llmproxy.core.events import Event, RequestEnded, StopStage
from llmproxy.core.hub import Hub
from llmproxy.observe.inflight import Exchange

CUT_LOG_SECONDS = 2.0
ENGINE_WAIT_SECONDS = 60.0


@dataclass(frozen=True)
class StopBudget:
    """The time each step may take; their sum is the whole stop's budget."""

    prestop: float
    drain: float
    cut_log: float = CUT_LOG_SECONDS
    engine_wait: float = ENGINE_WAIT_SECONDS

    @property
    def total(self) -> float:
        return self.prestop + self.drain + self.cut_log + self.engine_wait

    def describe(self) -> str:
        return (f"{self.total:g}s = prestop {self.prestop:g}s + drain {self.drain:g}s"
                f" + cut logging {self.cut_log:g}s + engine wait {self.engine_wait:g}s")


class Stoppable(Protocol):
    """What the chain drives; the root service provides it."""

    def stop_readiness(self) -> None:
        """/readyz answers 503 from now on; STOPPING=1 where systemd listens."""

    def stop_admission(self) -> Deferred[None]:
        """Accept no new connection; close idle ones; `Connection: close` from now on."""

    def in_flight(self) -> Sequence[Exchange]:
        """The requests still running."""

    def drained(self) -> Deferred[None]:
        """Fires once no request is in flight."""

    def engine_operations(self) -> Sequence[Deferred[Any]]:
        """Idle stops and engine switches in progress."""

    def predecessor_exit(self) -> tuple[int, Deferred[None]] | None:
        """A predecessor still draining after an upgrade: its pid, and a Deferred
        that fires when it has exited. Under KillMode=mixed its streams would be
        SIGKILLed the moment this process exits, so this process waits for it."""

    def drain_progress(self, remaining: int, seconds_left: float) -> None:
        """Told when the drain starts and as each request ends (for STATUS= lines)."""

    def stop_services(self) -> Deferred[None]:
        """Stop everything else."""


@dataclass
class StopResult:
    """How the stop went: what was cut."""

    cut: list[Exchange] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.cut




class StopChain:
    """Runs the stop steps in order under one budget."""

    log = Logger()

    def __init__(self, clock: IReactorTime, budget: StopBudget, target: Stoppable,
                 hub: Hub) -> None:
        self._clock = clock
        self._hub = hub
        self._publish = hub.publish
        self._budget = budget
        self._target = target

    async def run(self, t0: float) -> StopResult:
        """The whole stop, for a signal that arrived at `t0` (clock seconds)."""
        clock, budget, target = self._clock, self._budget, self._target
        end_of_budget = t0 + budget.total

        def left(cap_end: float) -> float:
            return max(0.0, min(cap_end, end_of_budget) - clock.seconds())

        target.stop_readiness()
        self._publish(StopStage(clock.seconds(), "begun", len(target.in_flight()),
                                budget.describe()))
        if budget.prestop > 0:
            await sleep(clock, left(t0 + budget.prestop))
        await within(clock, target.stop_admission(), left(end_of_budget))

        result = StopResult()
        drain_end = t0 + budget.prestop + budget.drain
        # Progress is told when the drain starts and as each request ends
        # (an event, not a timer): STATUS= says how many are left.
        def ended(event: Event) -> None:
            if isinstance(event, RequestEnded):
                target.drain_progress(len(target.in_flight()), left(drain_end))

        if target.in_flight():
            target.drain_progress(len(target.in_flight()), left(drain_end))
        unsubscribe = self._hub.subscribe(ended)
        try:
            drained = await within(clock, target.drained(), left(drain_end))
        finally:
            unsubscribe()
        if drained:
            self._publish(StopStage(clock.seconds(), "drained"))
        else:
            result.cut = list(target.in_flight())
            await self._cut(result.cut, left(drain_end + budget.cut_log))

        operations = list(target.engine_operations())
        if operations:
            seconds = left(clock.seconds() + budget.engine_wait)
            self.log.info("waiting up to {seconds:.0f}s for {n} engine operation(s) in progress",
                          seconds=seconds, n=len(operations))
            done: Deferred[Any] = DeferredList(operations, consumeErrors=True)
            if not await within(clock, done, seconds):
                self.log.warn("engine operation(s) still running after {seconds:.0f}s: "
                              "exiting without them", seconds=seconds)
        predecessor = target.predecessor_exit()
        if predecessor is not None:
            pid, gone = predecessor
            seconds = left(end_of_budget)
            self.log.info("waiting up to {seconds:.0f}s for predecessor pid {pid} to finish "
                          "draining", seconds=seconds, pid=pid)
            if not await within(clock, gone, seconds):
                self.log.warn("predecessor pid {pid} still draining at the end of the budget",
                              pid=pid)
        await within(clock, target.stop_services(), left(end_of_budget))
        return result

    async def _cut(self, cut: list[Exchange], seconds: float) -> None:
        self._publish(StopStage(self._clock.seconds(), "cut", len(cut)))
        for exchange in cut:
            exchange.cut_now()
        # Each cut request's handler logs its own line (outcome=cut) as it unwinds.
        ended: Deferred[Any] = DeferredList([e.ended for e in cut if not e.ended.called])
        await within(self._clock, ended, seconds)
        now = self._clock.seconds()
        for exchange in cut:
            if exchange.outcome is None:
                self.log.warn("cut {id} {method} {path} model={model} host={host} bytes={bytes} "
                              "age={age:.1f}s: its handler did not finish within {s:g}s",
                              id=exchange.id, method=exchange.method, path=exchange.path,
                              model=exchange.model or "-", host=exchange.host or "-",
                              bytes=exchange.bytes_sent, age=now - exchange.started, s=seconds)

