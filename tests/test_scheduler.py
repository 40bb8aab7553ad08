"""The Scheduler alone on a task.Clock, with a stub placement policy: it knows
slots, waiters, priority classes and the fairness count, and nothing about
engines (what runs, what starts, is the policy's answer to each pass)."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.python.failure import Failure

from llmproxy.config import HostConfig
from llmproxy.hosts.queueerrors import ProxyStopping
from llmproxy.hosts.scheduler import Scheduler
from llmproxy.testing.fakes import Acquire

HOST = HostConfig("gpu1", "http://10.0.0.5:8081", max_concurrent=1, max_queue=10,
                  queue_timeout_seconds=60)


class Stub:
    """A placement whose engine `a` runs and `b` does not; it grants the head of the
    queue while it may, and counts its passes."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.q = scheduler
        self.passes = 0
        self.running = {"a"}

    def runs(self, engine: str | None) -> bool:
        return engine is None or engine in self.running

    def current(self) -> str | None:
        return "a"

    def busy(self) -> bool:
        return False

    def starting(self, engine: str | None) -> bool:
        return False

    def place(self) -> None:
        self.passes += 1
        if self.q.closing:
            self.q.pump_closing()
            return
        while self.q.waiters and self.q.servable(self.q.waiters[0].engine):
            self.q.grant(self.q.waiters[0])
        if not self.q.waiters:
            self.q.settle()

    def settled(self) -> None:
        pass

    def closed(self) -> None:
        pass


def make() -> tuple[Scheduler, Stub]:
    stubs: list[Stub] = []

    def placement(scheduler: Scheduler) -> Stub:
        stubs.append(Stub(scheduler))
        return stubs[0]

    return Scheduler(HOST, Clock(), placement, publish=lambda e: None), stubs[0]


def test_the_scheduler_asks_its_placement_and_grants_slots_in_class_order() -> None:
    """One slot: the first request is granted at once; a normal and a high one wait,
    and the high one is granted first when the slot frees, by the placement's pass;
    what the placement says does not run waits for it, whatever the slots."""
    q, stub = make()
    first = Acquire(q, "a")
    assert first.lease.engine == "a" and q.in_flight() == 1
    normal = Acquire(q, "a", "normal")
    high = q.acquire("a", "high", priority="high")
    assert normal.waiting and not high.called and q.queued() == 2
    passes = stub.passes
    first.lease.release()
    assert stub.passes > passes
    assert high.called and normal.waiting
    high.result.release()
    assert normal.lease.engine == "a"
    normal.lease.release()
    other = Acquire(q, "b")
    assert other.waiting and q.in_flight() == 0      # `b` does not run: no slot helps


def test_closing_for_a_hand_over_fails_every_waiter() -> None:
    """`close(handing_over=True)`: nothing waits for a successor's turn here."""
    q, _ = make()
    held = Acquire(q, "a")
    waiting = Acquire(q, "a")
    q.close(handing_over=True)
    assert isinstance(waiting.result, Failure) and waiting.result.check(ProxyStopping)
    assert held.lease.engine == "a" and q.closing and q.queued() == 0
