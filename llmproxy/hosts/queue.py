"""One host's queue and its slots (HostQueue): every request for a host waits
here for what it needs, in arrival order within its key's priority class
(hosts/priority.py), under one rule (a budgeted host's is hosts/resident.py's).

A request asks for an engine (a managed host's preset) or for none in
particular (an unmanaged host, a model its roster lists). It gets a Lease,
which is both its hold on the engine and its concurrency slot:

- the head of the queue is served when its engine runs and a slot is free
  (`max_concurrent`: the running engine's own, else the host's; none: no limit);
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

The queue is bounded: a request that would make it longer than `max_queue`
fails at once (QueueFull), unless a waiter of a lower priority class waits:
then the newest of the lowest class fails in its place (hosts/waiter.py). One
that waited `queue_timeout_seconds` fails (QueueTimeout; not while its own
engine is being started, which is bounded by that engine's start timeout). A
cancelled wait (the client left) leaves the queue at once: nothing of it
reaches an engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from llmproxy.config import HostConfig
from llmproxy.core.capacity import Queued, QueueLeft, QueueRejected
from llmproxy.core.hub import Hub, Publish
from llmproxy.hosts.priority import NORMAL, ordered, rank
from llmproxy.hosts.queueerrors import ProxyStopping, QueueFull, QueueTimeout, SwitchFailed
from llmproxy.hosts.waiter import Waiter as _Waiter
from llmproxy.hosts.waiter import evicted

__all__ = ["OFF", "RESIDENCY_IDLE", "HostQueue", "Lease", "ProxyStopping", "QueueFull",
           "QueueTimeout", "SwitchFailed"]

RESIDENCY_IDLE = 5.0   # a resident engine holds the host while it had a request this recently
OFF = ""               # what an operator's stop waits for: no engine (no engine has this name)


@dataclass
class Lease:
    """One request's slot on its host and hold on the engine that runs there; the
    engine is not switched or stopped until every lease on it is released."""

    engine: str | None
    _on_release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        """Give the slot back; calling it again does nothing."""
        callback, self._on_release = self._on_release, None
        if callback is not None:
            callback()


class HostQueue:
    """One host's queue and slots. An unmanaged host's gate is complete as it is
    (its server always runs); HostManager adds the engine switches."""

    def __init__(self, host: HostConfig, clock: IReactorTime, *,
                 publish: Publish | None = None, fairness: int = 8) -> None:
        self.host = host
        self.fairness = fairness
        self.running: str | None = None
        self.cordoned = False
        self.unreachable_at: float | None = None   # a connection to it failed (see choose)
        self.last_used: float = clock.seconds()
        self.engine_used: dict[str | None, float] = {}   # per engine: its last lease's time
        self.resident_until: float | None = None
        self.protected: Callable[[str], bool] = lambda engine: False
        self._clock = clock
        self._publish = publish or Hub.logging().publish
        self._closing = False
        self.handing_over = False   # closing for an upgrade: every waiter goes to the successor
        self._leases: Counter[str | None] = Counter()
        self._queue: list[_Waiter] = []
        self._operation: str | None = None
        self._jumped = 0            # grants that overtook the waiting switch
        self._recheck: IDelayedCall | None = None
        self._pumping = False
        self._again = False

    # -- what others read ----------------------------------------------------
    @property
    def closing(self) -> bool:
        """Set once the proxy stops: nothing new is switched to after that."""
        return self._closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self._closing = value
        if value:
            if self._recheck is not None and self._recheck.active():
                self._recheck.cancel()
            self._pump()   # fail what waits for something that will not come

    def runs(self, engine: str | None) -> bool:
        """Whether a request for `engine` (None: any) finds it running here now."""
        return engine is None or engine in self.running_engines()

    def running_engines(self) -> tuple[str, ...]:
        return (self.running,) if self.running is not None else ()

    def in_flight(self, engine: str | None = None) -> int:
        """Leases held, on `engine` or on any engine."""
        return self._leases[engine] if engine is not None else sum(self._leases.values())

    def queued(self) -> int:
        """Requests waiting in the queue (for a slot, a switch or a stop)."""
        return len(self._queue)

    def limit(self, engine: str | None = None) -> int | None:
        """The slots of `engine` (default: the running one): its own max_concurrent,
        else the host's; None: no limit."""
        engine = engine if engine is not None else self.running
        preset = self.host.engines.get(engine) if engine else None
        if preset is not None and preset.max_concurrent is not None:
            return preset.max_concurrent
        return self.host.max_concurrent

    def load(self) -> float:
        """(In flight + queued) per slot; a host without a limit counts as one slot."""
        return (self.in_flight() + self.queued()) / (self.limit() or 1)

    def capacity(self, now: float) -> dict[str, Any]:
        """This host's queue and slots, for /status."""
        oldest = min((w.arrived for w in self._queue), default=None)
        return {"in_flight": self.in_flight(), "queued": len(self._queue),
                "max_concurrent": self.limit(), "max_queue": self.host.max_queue,
                "queue_timeout_seconds": self.host.queue_timeout_seconds,
                "oldest_wait_seconds": None if oldest is None else round(now - oldest, 3),
                "cordoned": self.cordoned}

    # -- asking for a slot -----------------------------------------------------
    def acquire(self, engine: str | None = None, request_id: str | None = None, *,
                bounded: bool = True, priority: str | None = None) -> Deferred[Lease]:
        """A Lease once the rule above grants it (`priority`: the key's class);
        QueueFull at once if the queue is full, QueueTimeout after
        queue_timeout_seconds (unless not `bounded`: an operator's command).
        Cancelling the Deferred takes it out of the queue."""
        if not self._queue and self._operation is None and not self._closing and \
                not self._pumping and engine != OFF and self._servable(engine):
            # Nothing waits, its engine runs and a slot is free: granted now,
            # as the queue would grant it, without queueing it first.
            lease = self._lease(self._engine_of(engine))
            self._jumped = 0
            self._settled()
            return succeed(lease)
        return self._enqueue(engine, request_id, bounded, priority=rank(priority))

    def _enqueue(self, engine: str | None, request_id: str | None, bounded: bool = True,
                 stop: bool = False, priority: int = NORMAL) -> Deferred[Any]:
        def cancel(d: Deferred[Any]) -> None:
            if waiter in self._queue:
                self._queue.remove(waiter)
                self._left(waiter, "gone")
            self._disarm(waiter)
            self._pump()   # the head of the queue may have changed

        waiter = _Waiter(engine, Deferred(cancel), self._clock.seconds(), request_id, stop=stop,
                         priority=priority, bounded=bounded)
        self._queue.append(waiter)
        self._pump()
        if waiter.deferred.called or waiter not in self._queue:
            return waiter.deferred
        depth = len(self._queue)
        if bounded and depth > self.host.max_queue:
            # Full: the newest waiter of a lower class is refused in its place.
            refused = evicted(self._queue, waiter, OFF) or waiter
            self._queue.remove(refused)
            self._disarm(refused)
            self._publish(QueueRejected(self._clock.seconds(), self.host.name,
                                        refused.request_id, refused.engine, "queue_full",
                                        depth - 1))
            refused.deferred.errback(QueueFull(self.host.name, depth - 1))
            if refused is waiter:
                return waiter.deferred
        if bounded:
            waiter.timer = self._clock.callLater(self.host.queue_timeout_seconds,
                                                 self._expire, waiter)
        reason = "capacity" if self._runs(engine) else "switch"
        waiter.waited = True
        self._publish(Queued(self._clock.seconds(), self.host.name, request_id, engine,
                             reason, depth))
        return waiter.deferred

    def _disarm(self, waiter: _Waiter) -> None:
        if waiter.timer is not None and waiter.timer.active():
            waiter.timer.cancel()
        waiter.timer = None

    def _left(self, waiter: _Waiter, outcome: str) -> None:
        if not waiter.waited:
            return     # granted at once: it never waited
        self._publish(QueueLeft(self._clock.seconds(), self.host.name, waiter.request_id,
                                outcome, round(self._clock.seconds() - waiter.arrived, 3),
                                len(self._queue)))

    def _expire(self, waiter: _Waiter) -> None:
        waiter.timer = None
        if waiter not in self._queue:
            return
        if self._starting(waiter.engine):
            waiter.overdue = True       # decided once that start is over
            return
        self._time_out(waiter)
        self._pump()

    def _time_out(self, waiter: _Waiter) -> None:
        self._queue.remove(waiter)
        waited = self._clock.seconds() - waiter.arrived
        self._publish(QueueRejected(self._clock.seconds(), self.host.name, waiter.request_id,
                                    waiter.engine, "queue_timeout", len(self._queue),
                                    round(waited, 3)))
        waiter.deferred.errback(QueueTimeout(self.host.name, waited))

    # -- the rule --------------------------------------------------------------
    def _runs(self, engine: str | None) -> bool:
        if engine == OFF:
            return self._occupant() is None
        return engine is None or engine == self.running

    def _servable(self, engine: str | None) -> bool:
        """Whether a request for `engine` at the head of the queue is granted now."""
        return self._runs(engine) and (engine == OFF or self._slot_free(engine))

    def _slot_free(self, engine: str | None) -> bool:
        limit = self.limit(engine)
        return limit is None or self.in_flight() < limit

    def _grant(self, waiter: _Waiter) -> None:
        self._left(waiter, "served")
        self._disarm(waiter)
        waiter.deferred.callback(None if waiter.engine == OFF or waiter.stop
                                 else self._lease(self._engine_of(waiter.engine)))

    def _engine_of(self, asked: str | None) -> str | None:
        """The engine a request for `asked` (None: whichever runs) is served by."""
        return self.running if asked is None else asked

    def _lease(self, engine: str | None) -> Lease:
        self._leases[engine] += 1
        self.last_used = self.engine_used[engine] = self._clock.seconds()

        def release() -> None:
            self._leases[engine] -= 1
            self.last_used = self.engine_used[engine] = self._clock.seconds()
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
                self._order()
                self._pump_once()
        finally:
            self._pumping = False

    def _order(self) -> None:
        """Put the queue in the order its rule considers it (hosts/priority.py)."""
        if len(self._queue) > 1:
            self._queue = ordered(self._queue, self._clock.seconds(),
                                  self.host.queue_timeout_seconds / 2,
                                  lambda w: w.stop or w.engine == OFF or not self._runs(w.engine))

    def _pump_once(self) -> None:
        if self._operation is not None:
            return
        if self._closing:
            self._pump_closing()
            return
        while self._queue and self._servable(self._queue[0].engine):
            self._grant(self._queue.pop(0))
        for waiter in [w for w in self._queue if w.overdue]:
            self._time_out(waiter)
        if not self._queue:
            self._jumped = 0
            self._settled()
            return
        if self._runs(self._queue[0].engine):
            return     # the head waits for a slot, and everyone behind it
        self._overtake()
        self._consider_switch(self._queue[0].engine)

    def _overtake(self) -> None:
        resident = self._residency_end() is not None   # overtaking is free then
        for waiter in list(self._queue[1:]):
            if waiter not in self._queue or waiter.engine == OFF or not self._runs(waiter.engine):
                continue
            if (not resident and self._jumped >= self.fairness) or \
                    not self._slot_free(waiter.engine):
                return
            self._queue.remove(waiter)
            if not resident:
                self._jumped += 1
            self._grant(waiter)

    def _consider_switch(self, target: str | None) -> None:
        assert target is not None
        old = self._occupant()
        busy = self.in_flight()
        why = ("busy" if busy else "protected" if old is not None and self.protected(old)
               else "residency" if self._resident(target) else None)
        if why is None:
            self._begin_switch(target)
        else:
            self._switch_waits(target, old, why, busy)

    def _residency_end(self) -> float | None:
        """When the running engine's residency ends, while it lasts; else None."""
        if self.resident_until is None:
            return None
        until = min(self.resident_until, self.last_used + RESIDENCY_IDLE)
        return until if self._clock.seconds() < until else None

    def _resident(self, target: str) -> bool:
        """The running engine keeps the host (and a re-check is scheduled)."""
        until = None if target == OFF else self._residency_end()
        if until is None:
            return False
        now = self._clock.seconds()
        if self._recheck is not None and self._recheck.active():
            self._recheck.cancel()
        self._recheck = self._clock.callLater(until - now, self._pump)
        return True

    def _pump_closing(self) -> None:
        waiters, self._queue = self._queue, []
        keep = [w for w in waiters if w.engine != OFF and not w.stop and self._runs(w.engine)
                and not self.handing_over]
        self._queue = keep + self._queue
        for waiter in waiters:
            if waiter not in keep:
                self._disarm(waiter)
                waiter.deferred.errback(ProxyStopping(self.host.name, waiter.engine))
        while self._queue and self._slot_free(self._queue[0].engine):
            self._grant(self._queue.pop(0))

    def _fail_waiters(self, engine: str, error: Exception) -> None:
        """Every waiter for `engine` fails with `error` (its switch or stop failed)."""
        failed = [w for w in self._queue if w.engine == engine]
        self._queue = [w for w in self._queue if w.engine != engine]
        for waiter in failed:
            self._disarm(waiter)
            waiter.deferred.errback(error)

    # -- what a managed host adds ------------------------------------------------
    def _occupant(self) -> str | None:
        """The engine on the host (running, or found there and not adopted)."""
        return self.running

    def _starting(self, engine: str | None) -> bool:
        """Whether `engine` is being started right now."""
        return False

    def _begin_switch(self, target: str) -> None:
        raise AssertionError(f"host {self.host.name} has no engines to switch to {target!r}")

    def _switch_waits(self, target: str, old: str | None, why: str, busy: int) -> None:
        """A switch to `target` waits (`why`: busy, protected, residency)."""

    def _settled(self) -> None:
        """Nothing waits any more."""
