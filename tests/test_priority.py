"""Priority classes in a host's queue (hosts/priority.py, hosts/scheduler.py): higher
classes first, arrival order within one, no starvation, and never past an
engine switch's fairness bound. Unit tests on a clock."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from twisted.internet.task import Clock
from twisted.python.failure import Failure

from llmproxy.config import EngineConfig, HostConfig
from llmproxy.core.capacity import QueueRejected
from llmproxy.hosts.host import Host
from llmproxy.hosts.priority import HIGH, LOW, NORMAL, ordered, rank
from llmproxy.hosts.queueerrors import QueueFull
from llmproxy.testing.agentfakes import FakeAgentTransport
from llmproxy.testing.fakes import Acquire

ONE_SLOT = HostConfig("laptop", "http://10.0.0.7:11434", max_concurrent=1, max_queue=10,
                      queue_timeout_seconds=60)
MANAGED = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5", engines={
    "big": EngineConfig("big", ("llama-server", "-m", "big.gguf")),
    "small": EngineConfig("small", ("llama-server", "-m", "small.gguf")),
}, max_concurrent=1, max_queue=20, queue_timeout_seconds=600)


class Req(Acquire):
    """One acquire() with a key's priority class."""

    def __init__(self, gate: Host, engine: str | None = None, priority: str = "normal",
                 name: str = "") -> None:
        self.name = name
        self.result: Any = None
        self.deferred = gate.acquire(engine, name or None, priority=priority)
        self.deferred.addBoth(self._done)


def served_order(reqs: list[Req], release: Any) -> list[str]:
    """Release the slot over and over; the names in the order they got it."""
    order: list[str] = []
    while any(r.waiting for r in reqs):
        release()
        for r in reqs:
            if not r.waiting and r.name not in order:
                order.append(r.name)
                release = r.lease.release
    return order


def test_higher_classes_are_served_first_and_arrival_order_within_a_class() -> None:
    """One slot, held: low, normal, low, high, normal arrive in that order; as the
    slot frees, high goes first, then the normals in arrival order, then the lows."""
    clock = Clock()
    q = Host(ONE_SLOT, clock, publish=lambda e: None)
    holder = Req(q, name="holder")
    reqs = [Req(q, priority=p, name=n) for p, n in
            [("low", "l1"), ("normal", "n1"), ("low", "l2"), ("high", "h1"), ("normal", "n2")]]
    assert all(r.waiting for r in reqs)
    assert served_order(reqs, holder.lease.release) == ["h1", "n1", "n2", "l1", "l2"]


def test_a_low_request_that_waited_half_the_queue_timeout_is_served_as_normal() -> None:
    """A low request that has waited more than queue_timeout_seconds / 2 (30 s of 60)
    goes before a normal one that came later (one that has waited less does
    not), but never before a high one, however long it waited: a steady flood
    of low requests cannot outrank fresh high ones."""
    for waited, first in ((0.5, "later"), (1.5, "old")):
        clock = Clock()
        q = Host(ONE_SLOT, clock, publish=lambda e: None)
        holder = Req(q, name="holder")
        old = Req(q, priority="low", name="old")
        clock.advance(29)
        later = Req(q, priority="normal", name="later")
        clock.advance(waited)
        assert served_order([old, later], holder.lease.release)[0] == first

    clock = Clock()
    q = Host(ONE_SLOT, clock, publish=lambda e: None)
    holder = Req(q, name="holder")
    lows = [Req(q, priority="low", name=f"low{i}") for i in range(3)]
    clock.advance(50)                    # the lows waited 50 s of 60
    high = Req(q, priority="high", name="high")
    assert served_order([*lows, high], holder.lease.release)[0] == "high"


def test_a_full_queue_refuses_the_newest_lowest_waiter_for_a_higher_arrival() -> None:
    """max_queue 3, full of low, normal, low: a high arrival waits and the newest
    low waiter gets the QueueFull it would have got (a queue_full event for it);
    a low arrival into a full queue is refused itself, as is a normal one when
    nothing lower waits."""
    clock = Clock()
    events: list[Any] = []
    q = Host(replace(ONE_SLOT, max_queue=3), clock, publish=events.append)
    holder = Req(q, name="holder")
    l1, n1, l2 = (Req(q, priority=p, name=n) for p, n in
                  (("low", "l1"), ("normal", "n1"), ("low", "l2")))
    high = Req(q, priority="high", name="h1")
    assert high.waiting and l1.waiting and n1.waiting
    assert isinstance(l2.result, Failure) and l2.result.check(QueueFull)
    assert [e.request_id for e in events if isinstance(e, QueueRejected)] == ["l2"]
    late_low = Req(q, priority="low", name="l3")
    assert isinstance(late_low.result, Failure) and late_low.result.check(QueueFull)
    n2 = Req(q, priority="normal", name="n2")
    assert n2.waiting and isinstance(l1.result, Failure)
    n3 = Req(q, priority="normal", name="n3")
    assert isinstance(n3.result, Failure) and n3.result.check(QueueFull)
    assert served_order([high, n1, n2], holder.lease.release) == ["h1", "n1", "n2"]


def test_priority_never_passes_a_waiting_switch_beyond_the_fairness_bound() -> None:
    """big runs with its one slot taken; a normal request for small waits for a
    switch; then high requests for big keep coming. At most `fairness` of them pass
    the switch; the next waits behind it, and the switch is made."""
    clock = Clock()
    agent = FakeAgentTransport()
    m = Host(MANAGED, clock, transport=agent, publish=lambda e: None, fairness=2)
    m.controller.assume("big")
    holder = Req(m, "big", name="holder")
    switch = Req(m, "small", name="switch")
    highs = [Req(m, "big", "high", f"h{i}") for i in range(4)]
    holder.lease.release()
    assert not highs[0].waiting            # 1 of 2 passed the switch
    highs[0].lease.release()
    assert not highs[1].waiting            # 2 of 2
    highs[1].lease.release()
    assert highs[2].waiting and highs[3].waiting and switch.waiting
    assert agent.last().order["engine"] == "small"


def test_a_high_request_for_another_engine_goes_ahead_of_low_ones() -> None:
    """Low requests for the running engine wait for its slot; a high one for another
    engine comes later and goes to the head: it waits for the switch, and the lows
    pass it only under the fairness bound (here 1)."""
    clock = Clock()
    agent = FakeAgentTransport()
    m = Host(replace(MANAGED), clock, transport=agent, publish=lambda e: None, fairness=1)
    m.controller.assume("big")
    holder = Req(m, "big", name="holder")
    lows = [Req(m, "big", "low", f"l{i}") for i in range(3)]
    switch = Req(m, "small", "high", "switch")
    holder.lease.release()
    assert not lows[0].waiting and lows[1].waiting          # the one overtake
    lows[0].lease.release()
    assert lows[1].waiting and agent.last().order["engine"] == "small"
    agent.last().answer({"ok": True, "engine": "small", "pid": 7, "healthy": True,
                         "stopped": []})
    assert switch.lease.engine == "small"


def test_the_order_keeps_every_waiter_behind_an_earlier_barrier() -> None:
    """The order itself: a barrier (a waiter for an engine that does not run) is
    never passed by a later waiter; before it, classes order as usual."""

    class W:
        def __init__(self, seq: int, priority: int, barrier: bool = False) -> None:
            self.seq, self.priority, self.arrived, self.barrier = seq, priority, 0.0, barrier

    a, b, c, d = W(0, LOW), W(1, NORMAL, barrier=True), W(2, HIGH), W(3, HIGH, barrier=True)
    assert ordered([d, c, b, a], 1.0, 30.0, lambda w: w.barrier) == [b, c, d, a]
    assert rank(None) == NORMAL and rank("high") == HIGH and rank("low") == LOW
