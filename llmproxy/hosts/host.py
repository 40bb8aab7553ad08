"""One host as the rest of the proxy uses it (Host): its scheduler (the queue
and slots), its placement policy (one engine at a time, or the memory budget
of a host with `memory_gb`, chosen by its config), and for a managed host its
engine controller (the agent calls) and supervisor, composed here.

A request takes a Lease through `acquire`; an operator's stop queues like a
request (`stop_now`, `stop_one`), so the requests on an engine finish first.
What others change of a host goes through methods or constructor arguments:
`cordon`, `hold` (another proxy holds its lease), `unreachable`, `close`, and
`protected(engine)` (an upgrade's predecessor still uses it; whoever changes
what it says calls `reconsider`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime

from llmproxy.config import HostConfig
from llmproxy.core.hub import Hub, Publish
from llmproxy.hosts.agentclient import IAgentTransport
from llmproxy.hosts.budget import MemoryBudget
from llmproxy.hosts.controller import EngineController
from llmproxy.hosts.placement import OneEngine
from llmproxy.hosts.queueerrors import SwitchFailed
from llmproxy.hosts.scheduler import Scheduler
from llmproxy.hosts.sleepwake import SleepWake
from llmproxy.hosts.supervisor import Supervisor
from llmproxy.hosts.waiter import OFF, Lease

T = TypeVar("T")


class Host:
    """One host: see the module docstring. `transport`: how its agent is reached
    (a managed host); `sending` and `watching`: the supervisor's view of the
    responses in flight and of the host's watch (hosts/supervisor.py)."""

    def __init__(self, host: HostConfig, clock: IReactorTime, *,
                 transport: IAgentTransport | None = None, publish: Publish | None = None,
                 fairness: int = 8, stop_grace: float = 10.0,
                 protected: Callable[[str], bool] = lambda engine: False,
                 sending: Callable[[str], Mapping[str, int]] | None = None,
                 watching: Callable[[], bool] | None = None,
                 measured: Callable[[str], float | None] = lambda engine: None,
                 sleepwake: SleepWake | None = None) -> None:
        self.host = host
        self.sleepwake = sleepwake   # a host that sleeps and wakes (hosts/sleepwake.py)
        self._protected = protected
        self._measured = measured   # an engine's measured GiB (hosts/measured.py), or None
        self.unreachable_at: float | None = None   # a connection to it failed (see choose)
        self._clock = clock
        self._held_by: str | None = None
        publish = publish or Hub.logging().publish
        self.supervisor = Supervisor(self, clock, publish, sending=sending, watching=watching)
        self.controller = EngineController(host, transport, clock, publish, stop_grace, measured) \
            if host.managed and transport is not None else None
        self.placement: OneEngine | MemoryBudget
        self.scheduler = Scheduler(host, clock, self._place, publish=publish,
                                   fairness=fairness, per_engine_slots=host.budgeted)

    def _place(self, scheduler: Scheduler) -> OneEngine | MemoryBudget:
        """The host's placement policy, as its config chooses."""
        ctl, held = self.controller, self.supervisor.held
        if ctl is not None and self.host.budgeted:
            self.placement = MemoryBudget(scheduler, ctl, held, self._protected, self._measured)
        else:
            self.placement = OneEngine(scheduler, ctl, held, self._protected)
        return self.placement

    # -- what others change ----------------------------------------------------------------
    def cordon(self, cordoned: bool = True) -> None:
        """Cordon the host (it takes no new request) or lift its cordon."""
        self.scheduler.cordon(cordoned)

    def hold(self, by: str | None) -> None:
        """Another proxy holds the host's lease (`by` says who: every request for its
        engines fails at once), or None: this one does."""
        self._held_by = by

    def unreachable(self, at: float | None) -> None:
        """A connection to the host failed `at` (the chooser's), or None: it answers."""
        self.unreachable_at = at

    def close(self, handing_over: bool = False) -> None:
        """The proxy stops: no switch or idle stop starts from now on; requests waiting
        for a switch fail (ProxyStopping), and those waiting for a slot too when
        `handing_over` (an upgrade's successor serves them)."""
        self.scheduler.close(handing_over)

    def reconsider(self) -> None:
        """Something `protected` depends on changed: move the queue on if it can."""
        self.scheduler.pump()

    # -- what others read ------------------------------------------------------------------
    @property
    def running(self) -> str | None:
        """The engine that runs (on a budgeted host, the one started last)."""
        return self.controller.running if self.controller is not None else None

    @property
    def closing(self) -> bool:
        return self.scheduler.closing

    @property
    def cordoned(self) -> bool:
        return self.scheduler.cordoned

    @property
    def held_by(self) -> str | None:
        return self._held_by

    @property
    def last_used(self) -> float:
        return self.scheduler.last_used

    @property
    def resident_until(self) -> float | None:
        return self.controller.resident_until if self.controller is not None else None

    @property
    def last_switch(self) -> dict[str, Any] | None:
        return self.controller.last_switch if self.controller is not None else None

    @property
    def stop_grace(self) -> float:
        """What each stop allows an engine before it is killed."""
        return self._ctl().agent.stop_grace

    @property
    def busy(self) -> bool:
        """Whether an agent call (adopt, switch, status re-read, stop) is in progress."""
        return self.placement.busy()

    @property
    def switching_to(self) -> str | None:
        return self.placement.switching_to()

    def protected(self, engine: str) -> bool:
        """Whether an upgrade's predecessor still uses `engine` here."""
        return self._protected(engine)

    def runs(self, engine: str | None) -> bool:
        """Whether a request for `engine` (None: any) finds it running here now."""
        return engine is None or engine in self.running_engines()

    def running_engines(self) -> tuple[str, ...]:
        return self.controller.running_engines() if self.controller is not None else ()

    def in_flight(self, engine: str | None = None) -> int:
        return self.scheduler.in_flight(engine)

    def queued(self) -> int:
        return self.scheduler.queued()

    def waiting_for(self, engine: str) -> int:
        """How many requests wait in this host's queue for `engine`."""
        return sum(1 for w in self.scheduler.waiters if w.engine == engine)

    def limit(self, engine: str | None = None) -> int | None:
        return self.scheduler.limit(engine)

    def load(self) -> float:
        return self.scheduler.load()

    def capacity(self, now: float) -> dict[str, Any]:
        return self.scheduler.capacity(now)

    def state_of(self, engine: str) -> str:
        """`loaded`, `loading`, `unloaded`, `failed` (a crash loop), or `asleep` /
        `waking` (a host that sleeps: hosts/sleepwake.py), for /v1/models."""
        if self.sleepwake is not None and self.sleepwake.state in ("asleep", "waking"):
            return self.sleepwake.state
        return self.placement.state_of(engine, self.supervisor.failed(engine))

    def memory_used(self) -> float:
        assert isinstance(self.placement, MemoryBudget)
        return self.placement.memory_used()

    def measured_gb(self, engine: str) -> float | None:
        """The engine's measured GPU memory in GiB (hosts/measured.py), or None."""
        return self._measured(engine)

    def residents(self, now: float) -> list[dict[str, Any]]:
        assert isinstance(self.placement, MemoryBudget)
        return self.placement.residents(now)

    def operations(self) -> list[Deferred[Any]]:
        """Deferreds that fire when the agent call in progress (switch, stop...) is done."""
        return self.controller.operations() if self.controller is not None else []

    def snapshot(self, now: float) -> dict[str, Any]:
        """This host's engine state for /status."""
        ctl = self.controller
        assert ctl is not None
        occupant, resident = ctl.occupant(), ctl.resident_until
        doc: dict[str, Any] = {
            "running": ctl.running,
            "switching_to": self.switching_to,
            "operation": ctl.operation,
            "in_flight": self.in_flight(),
            "queued": self.queued(),
            "protected": occupant is not None and self._protected(occupant),
            "last_switch": dict(ctl.last_switch) if ctl.last_switch else None,
            "last_used_seconds_ago": round(max(0.0, now - self.last_used), 1),
            "resident_seconds_left": None if resident is None or resident <= now
            else round(resident - now, 1),
            "stop_requested": any(w.engine == OFF for w in self.scheduler.waiters),
        }
        if isinstance(self.placement, MemoryBudget):
            doc["resident"] = self.residents(now)
            doc["memory_gb"] = {"used": self.memory_used(), "budget": self.host.memory_gb}
        return doc

    # -- requests and commands -------------------------------------------------------------
    def acquire(self, engine: str | None = None, request_id: str | None = None, *,
                bounded: bool = True, priority: str | None = None) -> Deferred[Lease]:
        """A Lease on `engine` once it runs (None: whichever runs); fails with
        SwitchFailed if it cannot be started, QueueFull or QueueTimeout as the
        scheduler says. Cancelling the Deferred takes the request out of the queue."""
        if self.controller is not None:
            if engine is not None and engine not in self.host.engines:
                return fail(SwitchFailed(self.host.name, engine, "the host has no such engine"))
            refusal = self._held_by or (self.supervisor.refusal(engine) if engine else None)
            if refusal is not None:
                return fail(SwitchFailed(self.host.name, engine or "", refusal))
            if self.sleepwake is not None and self.sleepwake.needs_wake():
                return Deferred.fromCoroutine(self._woken(engine, request_id, bounded, priority))
        return self.scheduler.acquire(engine, request_id, bounded=bounded, priority=priority)

    async def _woken(self, engine: str | None, request_id: str | None, bounded: bool,
                     priority: str | None) -> Lease:
        """`acquire` once the sleeping host woke (WakeFailed if it did not)."""
        assert self.sleepwake is not None
        await self.sleepwake.wake(f"a request for {engine}" if engine else "a request",
                                  engine or "")
        return await self.scheduler.acquire(engine, request_id, bounded=bounded,
                                            priority=priority)

    def stop_now(self) -> Deferred[None]:
        """An operator's stop of every engine: it queues like a switch to no engine, so
        the requests on the running engines finish first (never cut); fires once
        nothing runs, or fails with StopFailed (or ProxyStopping). Cancelling it
        withdraws it."""
        return self.scheduler.enqueue(OFF, None, bounded=False)

    def stop_one(self, engine: str) -> Deferred[None]:
        """An operator's stop of `engine` alone on a budgeted host, through the queue:
        its requests in flight finish first, later ones wait behind the stop (and start
        it again after). Fires once it is stopped; StopFailed if the agent failed."""
        return self.scheduler.enqueue(engine, None, bounded=False, stop=True)

    def idle_candidates(self) -> list[tuple[str, float]]:
        """(engine, idle since) for each engine an idle stop may take now."""
        return self.placement.idle() if self.controller is not None else []

    def stop_engine(self, engine: str | None = None, why: str = "idle") -> Deferred[bool]:
        """An idle (or ttl) stop of `engine` (one engine at a time: the running one) if
        nothing uses, awaits or protects it; fires with whether it stopped."""
        if self._held_by or self.controller is None:
            return succeed(False)
        return self.placement.stop_idle(engine, why)

    def forget(self, engine: str) -> None:
        """`engine` died on its own (the supervisor heard it): it no longer runs."""
        if self.controller is not None:
            self.controller.drop(engine)
        self.scheduler.pump()

    def stop_hung(self, engine: str) -> Deferred[bool]:
        """The supervisor found `engine` hung: it takes no request from now on and is
        stopped at once, its leases notwithstanding; fires with whether the agent
        stopped it (if not, the host's state is read again)."""
        return Deferred.fromCoroutine(self._after(self._ctl().stop_hung(engine)))

    async def adopt(self) -> None:
        """At start-up: adopt what runs on the host as its rule says (no restart).
        Errors are logged, never raised."""
        await self._after(self._ctl().adopt())

    def _ctl(self) -> EngineController:
        assert self.controller is not None, f"host {self.host.name} is not managed"
        return self.controller

    async def _after(self, call: Coroutine[Any, Any, T]) -> T:
        """An agent call, and the queue moved on after it."""
        try:
            return await call
        finally:
            self.scheduler.pump()
