"""One host's queue and slots (Scheduler): every request for a host waits here
for what it needs, in the order hosts/batching.py serves it (priority classes,
the host's `schedule`). It knows slots, waiters and the overtaking bounds,
nothing about engines: each pass over the queue is its placement policy's
(hosts/placement.py, hosts/budget.py), which asks it for grants.

A request gets a Lease. One that would make the queue longer than `max_queue`
fails at once (QueueFull), unless a waiter of a lower class waits: the newest
of the lowest fails in its place (hosts/waiter.py). One that waited
`queue_timeout_seconds` fails (QueueTimeout; not while its engine is being
started). A cancelled wait leaves the queue at once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime

from llmproxy.config import HostConfig
from llmproxy.core.capacity import Queued, QueueLeft, QueueRejected
from llmproxy.core.hub import Hub, Publish
from llmproxy.hosts.batching import blocked, may_overtake, serving_order
from llmproxy.hosts.placement import IPlacement
from llmproxy.hosts.priority import NORMAL, rank
from llmproxy.hosts.queueerrors import ProxyStopping, QueueFull, QueueTimeout
from llmproxy.hosts.waiter import OFF, Lease, Waiter, evicted


class Scheduler:
    """One host's queue and slots. `placement(scheduler)` makes the host's
    placement policy; `per_engine_slots`: an engine's own max_concurrent counts
    its own requests and the host's all of them (engines resident together),
    else the running engine's own limit, or the host's, counts all."""

    def __init__(self, host: HostConfig, clock: IReactorTime,
                 placement: Callable[[Scheduler], IPlacement], *,
                 publish: Publish | None = None, fairness: int = 8,
                 per_engine_slots: bool = False) -> None:
        self.host = host
        self.fairness = fairness
        self.publish = publish or Hub.logging().publish
        self.clock = clock
        self.last_used: float = clock.seconds()
        self.engine_used: dict[str | None, float] = {}   # per engine: its last lease's time
        self.jumped = 0            # grants that overtook the waiting start
        self.batch_began = clock.seconds()   # the last start done (hosts/batching.py)
        self._per_engine = per_engine_slots
        self._cordoned = self._closing = self._handing_over = False
        self._leases: Counter[str | None] = Counter()
        self.waiters: list[Waiter] = []   # in the order of the last pass (read-only outside)
        self._pumping = False
        self._again = False
        self._placement = placement(self)

    # -- what others read and set ----------------------------------------------------
    @property
    def closing(self) -> bool:
        """Set once the proxy stops (`close`): nothing new is started after that."""
        return self._closing

    @property
    def cordoned(self) -> bool:
        """The host takes no new request (`cordon`); the chooser skips it."""
        return self._cordoned

    def cordon(self, cordoned: bool = True) -> None:
        self._cordoned = cordoned

    def close(self, handing_over: bool = False) -> None:
        """The proxy stops: what waits for something that will not come fails."""
        self._handing_over = handing_over
        self._closing = True
        self._placement.closed()
        self.pump()   # fail what waits for something that will not come

    def in_flight(self, engine: str | None = None) -> int:
        """Leases held, on `engine` or on any engine."""
        return self._leases[engine] if engine is not None else sum(self._leases.values())

    def queued(self) -> int:
        return len(self.waiters)

    def limit(self, engine: str | None = None) -> int | None:
        """The slots of `engine` (default: the running one): its own max_concurrent,
        else the host's; None: no limit."""
        engine = engine if engine is not None else self._placement.current()
        preset = self.host.engines.get(engine) if engine else None
        if preset is not None and preset.max_concurrent is not None:
            return preset.max_concurrent
        return self.host.max_concurrent

    def load(self) -> float:
        """(In flight + queued) per slot; a host without a limit counts as one slot."""
        return (self.in_flight() + self.queued()) / (self.limit() or 1)

    def capacity(self, now: float) -> dict[str, Any]:
        """This host's queue and slots, for /status."""
        oldest = min((w.arrived for w in self.waiters), default=None)
        return {"in_flight": self.in_flight(), "queued": len(self.waiters),
                "max_concurrent": self.limit(), "max_queue": self.host.max_queue,
                "queue_timeout_seconds": self.host.queue_timeout_seconds,
                "oldest_wait_seconds": None if oldest is None else round(now - oldest, 3),
                "cordoned": self._cordoned}

    # -- asking for a slot -----------------------------------------------------------
    def acquire(self, engine: str | None = None, request_id: str | None = None, *,
                bounded: bool = True, priority: str | None = None) -> Deferred[Lease]:
        """A Lease once the placement grants it (`priority`: the key's class);
        QueueFull at once if the queue is full, QueueTimeout after
        queue_timeout_seconds (unless not `bounded`: an operator's command).
        Cancelling the Deferred takes it out of the queue."""
        if not self.waiters and not self._placement.busy() and not self._closing and \
                not self._pumping and engine != OFF and self.servable(engine):
            # Nothing waits, its engine runs and a slot is free: granted now,
            # as the queue would grant it, without queueing it first.
            lease = self._lease(self._engine_of(engine))
            self.settle()
            return succeed(lease)
        return self.enqueue(engine, request_id, bounded, priority=rank(priority))

    def enqueue(self, engine: str | None, request_id: str | None, bounded: bool = True,
                stop: bool = False, priority: int = NORMAL) -> Deferred[Any]:
        """Queue a request for `engine` (OFF, or `stop`: an operator's stop)."""
        def cancel(d: Deferred[Any]) -> None:
            if waiter in self.waiters:
                self.waiters.remove(waiter)
                self._left(waiter, "gone")
            self._disarm(waiter)
            self.pump()   # the head of the queue may have changed

        waiter = Waiter(engine, Deferred(cancel), self.clock.seconds(), request_id, stop=stop,
                        priority=priority, bounded=bounded)
        self.waiters.append(waiter)
        self.pump()
        if waiter.deferred.called or waiter not in self.waiters:
            return waiter.deferred
        depth = len(self.waiters)
        if bounded and depth > self.host.max_queue:
            # Full: the newest waiter of a lower class is refused in its place.
            refused = evicted(self.waiters, waiter, OFF) or waiter
            self.waiters.remove(refused)
            self._disarm(refused)
            self.publish(QueueRejected(self.clock.seconds(), self.host.name,
                                       refused.request_id, refused.engine, "queue_full",
                                       depth - 1))
            refused.deferred.errback(QueueFull(self.host.name, depth - 1))
            if refused is waiter:
                return waiter.deferred
        if bounded:
            waiter.timer = self.clock.callLater(self.host.queue_timeout_seconds,
                                                self._expire, waiter)
        reason = "capacity" if self._placement.runs(engine) else "switch"
        waiter.waited = True
        self.publish(Queued(self.clock.seconds(), self.host.name, request_id, engine,
                            reason, depth))
        return waiter.deferred

    def _disarm(self, waiter: Waiter) -> None:
        if waiter.timer is not None and waiter.timer.active():
            waiter.timer.cancel()
        waiter.timer = None

    def _left(self, waiter: Waiter, outcome: str) -> None:
        if not waiter.waited:
            return     # granted at once: it never waited
        self.publish(QueueLeft(self.clock.seconds(), self.host.name, waiter.request_id,
                               outcome, round(self.clock.seconds() - waiter.arrived, 3),
                               len(self.waiters)))

    def _expire(self, waiter: Waiter) -> None:
        waiter.timer = None
        if waiter not in self.waiters:
            return
        if self._placement.starting(waiter.engine):
            waiter.overdue = True       # decided once that start is over
            return
        self._time_out(waiter)
        self.pump()

    def _time_out(self, waiter: Waiter) -> None:
        self.waiters.remove(waiter)
        waited = self.clock.seconds() - waiter.arrived
        self.publish(QueueRejected(self.clock.seconds(), self.host.name, waiter.request_id,
                                   waiter.engine, "queue_timeout", len(self.waiters),
                                   round(waited, 3)))
        waiter.deferred.errback(QueueTimeout(self.host.name, waited))

    # -- what a placement's pass uses --------------------------------------------------
    def servable(self, engine: str | None) -> bool:
        """Whether a request for `engine` at the head of the queue is granted now."""
        return self._placement.runs(engine) and (engine == OFF or self.slot_free(engine))

    def slot_free(self, engine: str | None) -> bool:
        if not self._per_engine:
            limit = self.limit(engine)
            return limit is None or self.in_flight() < limit
        preset = self.host.engines.get(engine) if engine else None
        if preset is not None and preset.max_concurrent is not None \
                and self.in_flight(engine) >= preset.max_concurrent:
            return False
        limit = self.host.max_concurrent
        return limit is None or self.in_flight() < limit

    def grant(self, waiter: Waiter) -> None:
        """`waiter` leaves the queue served: a lease (none for a stop)."""
        if waiter in self.waiters:
            self.waiters.remove(waiter)
        self._left(waiter, "served")
        self._disarm(waiter)
        waiter.deferred.callback(None if waiter.engine == OFF or waiter.stop
                                 else self._lease(self._engine_of(waiter.engine)))

    def fail(self, waiter: Waiter, error: Exception) -> None:
        """`waiter` leaves the queue with `error`."""
        if waiter in self.waiters:
            self.waiters.remove(waiter)
        self._disarm(waiter)
        waiter.deferred.errback(error)

    def fail_waiters(self, engine: str, error: Exception) -> None:
        """Every waiter for `engine` fails with `error` (its start or stop failed)."""
        for waiter in [w for w in self.waiters if w.engine == engine]:
            self.fail(waiter, error)

    def first_for(self, engine: str) -> None:
        """Everyone waiting for `engine` (just started) goes first; its batch begins."""
        self.waiters.sort(key=lambda w: w.engine != engine)
        self.batch_began = self.clock.seconds()

    def time_out_overdue(self) -> None:
        """Waiters whose time ran out while their engine was started fail now."""
        for waiter in [w for w in self.waiters if w.overdue]:
            self._time_out(waiter)

    def may_overtake(self, waiter: Waiter, resident: bool = False) -> bool:
        """Whether a request passes a waiting switch (hosts/batching.py); a yes counts."""
        held = blocked(self.waiters, self._placement.runs, OFF)
        ok, counted = may_overtake(self.host, self.clock.seconds(), held, waiter, resident,
                                   self.jumped, self.fairness, self.batch_began)
        self.jumped, waiter.held_back = self.jumped + (ok and counted), waiter.held_back or not ok
        return ok

    def settle(self) -> None:
        """Nothing waits: the fairness count starts again."""
        self.jumped = 0
        self._placement.settled()

    def _engine_of(self, asked: str | None) -> str | None:
        """The engine a request for `asked` (None: whichever runs) is served by."""
        return self._placement.current() if asked is None else asked

    def _lease(self, engine: str | None) -> Lease:
        self._leases[engine] += 1
        self.last_used = self.engine_used[engine] = self.clock.seconds()

        def release() -> None:
            self._leases[engine] -= 1
            self.last_used = self.engine_used[engine] = self.clock.seconds()
            self.pump()

        return Lease(engine, release)

    def pump(self) -> None:
        """Move the queue on; re-entrant calls (from callbacks it fires) are folded in."""
        if self._pumping:
            self._again = True
            return
        self._pumping = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._order()
                self._placement.place()
        finally:
            self._pumping = False

    def _order(self) -> None:
        """Put the queue in the order it is served (hosts/batching.py)."""
        if len(self.waiters) > 1:
            held = blocked(self.waiters, self._placement.runs, OFF)
            self.waiters = serving_order(self.waiters, self.host.schedule, self.clock.seconds(),
                                         self.host.queue_timeout_seconds / 2, held, OFF)

    def pump_closing(self) -> None:
        """The pass of a closing host: what waits for something that will not come
        fails (everything, when handing over); the rest is served as slots free."""
        waiters, self.waiters = self.waiters, []
        keep = [w for w in waiters if w.engine != OFF and not w.stop
                and self._placement.runs(w.engine) and not self._handing_over]
        self.waiters = keep + self.waiters
        for waiter in waiters:
            if waiter not in keep:
                self._disarm(waiter)
                waiter.deferred.errback(ProxyStopping(self.host.name, waiter.engine))
        while self.waiters and self.slot_free(self.waiters[0].engine):
            self.grant(self.waiters[0])
