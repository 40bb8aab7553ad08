"""A host's queue on a task.Clock (the Scheduler, and a managed Host's use of it): slots
(`max_concurrent`, an engine's own), FIFO order, the queue bound, the per-waiter
timeout, clients leaving, slots and switches in one queue under one fairness
rule, residency (`min_engine_seconds`), closing, an operator's stop, and the
events each decision publishes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.test.requesthelper import DummyRequest

from llmproxy.config import EngineConfig, HostConfig
from llmproxy.core.capacity import Queued, QueueLeft, QueueRejected
from llmproxy.core.events import EngineSwitch, Event, IdleStop
from llmproxy.hosts.host import Host
from llmproxy.hosts.placement import RESIDENCY_IDLE
from llmproxy.hosts.queueerrors import ProxyStopping, QueueFull, QueueTimeout, StopFailed
from llmproxy.hosts.scheduler import Scheduler
from llmproxy.hosts.waiter import Lease
from llmproxy.observe.inflight import Exchange
from llmproxy.testing.agentfakes import FakeAgentTransport, engine_found, status_answer
from llmproxy.testing.fakes import Acquire
from llmproxy.web.queuewait import QueueWait
from llmproxy.web.requeststate import RequestState

PLAIN = HostConfig("laptop", "http://10.0.0.7:11434", max_concurrent=2, max_queue=3,
                   queue_timeout_seconds=60)
MANAGED = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5", engines={
    "big": EngineConfig("big", ("llama-server", "-m", "big.gguf")),
    "small": EngineConfig("small", ("llama-server", "-m", "small.gguf"), max_concurrent=1),
}, max_concurrent=2, min_engine_seconds=0)     # residency: where a test gives one


class Req(Acquire):
    """One acquire() and what became of it."""

    def failed(self) -> type[BaseException] | None:
        if not isinstance(self.result, Failure):
            return None
        self.result.trap(QueueFull, QueueTimeout, ProxyStopping, StopFailed)
        return type(self.result.value)


def plain(host: HostConfig = PLAIN) -> tuple[Host, Clock, list[Event]]:
    clock = Clock()
    events: list[Event] = []
    return Host(host, clock, publish=events.append), clock, events


def managed(host: HostConfig = MANAGED, running: str | None = "big",
            **kwargs: Any) -> tuple[Host, FakeAgentTransport, Clock, list[Event]]:
    clock = Clock()
    agent = FakeAgentTransport()
    events: list[Event] = []
    m = Host(host, clock, transport=agent, publish=events.append, **kwargs)
    m.controller.assume(running)
    return m, agent, clock, events


def started(engine: str) -> dict[str, Any]:
    return {"ok": True, "engine": engine, "pid": 7, "healthy": True, "stopped": []}


def test_without_a_limit_every_request_is_granted_at_once() -> None:
    """No max_concurrent: nothing ever waits, nothing is published."""
    gate, _, events = plain(replace(PLAIN, max_concurrent=None))
    reqs = [Req(gate) for _ in range(50)]
    assert all(not r.waiting for r in reqs) and gate.in_flight() == 50
    assert gate.queued() == 0 and events == []


def test_only_a_request_that_cannot_be_granted_at_once_goes_into_the_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request nothing waits before, on a running engine with a slot free, is
    granted without queueing; one behind a waiter, one beyond the slots and one
    for an engine that is not running are queued, and keep their order."""
    queued: list[str | None] = []
    enqueue = Scheduler.enqueue

    def spy(self: Scheduler, engine: str | None, request_id: str | None,
            bounded: bool = True, **kwargs: Any) -> Deferred[Any]:
        queued.append(request_id)
        return enqueue(self, engine, request_id, bounded, **kwargs)

    monkeypatch.setattr(Scheduler, "enqueue", spy)
    m, agent, _, events = managed(replace(MANAGED, max_concurrent=2))
    a, b = Req(m, "big", "a"), Req(m, "big", "b")
    assert a.lease.engine == b.lease.engine == "big" and queued == [] and events == []
    c = Req(m, "big", "c")        # beyond the two slots
    d = Req(m, None, "d")         # behind c, though any engine would do
    switch = Req(m, "small", "switch")
    assert c.waiting and d.waiting and switch.waiting and queued == ["c", "d", "switch"]
    a.lease.release()
    assert not c.waiting and d.waiting
    b.lease.release()
    assert not d.waiting and m.in_flight() == 2 and switch.waiting
    c.lease.release()
    d.lease.release()
    agent.last().answer(started("small"))
    assert switch.lease.engine == "small" and m.queued() == 0
    switch.lease.release()
    e = Req(m, "small", "e")      # the queue is empty again: granted at once
    assert e.lease.engine == "small" and queued == ["c", "d", "switch"]


def test_beyond_max_concurrent_requests_wait_and_are_served_in_arrival_order() -> None:
    """Two slots: the first two are granted, the others wait; each release grants the
    oldest waiter, so in flight never passes two and service follows arrival."""
    gate, _, events = plain(replace(PLAIN, max_queue=10))
    reqs = [Req(gate, name=f"r{i}") for i in range(6)]
    assert [r.waiting for r in reqs] == [False, False, True, True, True, True]
    served = [r.name for r in reqs if not r.waiting]
    while gate.in_flight():
        assert gate.in_flight() <= 2
        next(r for r in reqs if not r.waiting and r.lease._on_release).lease.release()
        served += [r.name for r in reqs if not r.waiting and r.name not in served]
    assert served == [f"r{i}" for i in range(6)]
    queued = [e for e in events if isinstance(e, Queued)]
    assert [(e.request_id, e.reason, e.depth) for e in queued] == [
        ("r2", "capacity", 1), ("r3", "capacity", 2), ("r4", "capacity", 3),
        ("r5", "capacity", 4)]
    assert [e.request_id for e in events if isinstance(e, QueueLeft)] == ["r2", "r3", "r4",
                                                                           "r5"]


def test_a_full_queue_refuses_at_once() -> None:
    """max_queue 3 with two slots: the sixth request fails with QueueFull without
    waiting; a queue_full rejection is published with the depth."""
    gate, _, events = plain()
    reqs = [Req(gate, name=f"r{i}") for i in range(5)]
    extra = Req(gate, name="r5")
    assert extra.failed() is QueueFull
    assert str(extra.result.value) == "the queue of host laptop is full (3 waiting, max_queue)"
    assert gate.queued() == 3 and all(r.result is None for r in reqs[2:])
    [rejected] = [e for e in events if isinstance(e, QueueRejected)]
    assert (rejected.request_id, rejected.reason, rejected.depth) == ("r5", "queue_full", 3)
    assert rejected.line()[1] == "queue of laptop is full (3 waiting): refused r5 with 429"
    reqs[0].lease.release()
    assert not reqs[2].waiting and Req(gate).waiting   # room again


def test_a_waiter_times_out_after_queue_timeout_seconds_and_not_before() -> None:
    """queue_timeout_seconds 60: at 59.9 s it still waits, at 60 s it fails with
    QueueTimeout and leaves the queue; a granted request leaves no timer behind."""
    gate, clock, events = plain()
    a, b = Req(gate), Req(gate)
    late = Req(gate, name="late")
    clock.advance(59.9)
    assert late.waiting and gate.queued() == 1
    clock.advance(0.1)
    assert late.failed() is QueueTimeout and gate.queued() == 0
    assert str(late.result.value) == "waited 60s in the queue of host laptop " \
        "(queue_timeout_seconds)"
    [rejected] = [e for e in events if isinstance(e, QueueRejected)]
    assert (rejected.reason, rejected.waited) == ("queue_timeout", 60)
    served = Req(gate)
    a.lease.release()
    assert not served.waiting and clock.getDelayedCalls() == []
    b.lease.release()


def test_a_client_that_leaves_is_out_of_the_queue_at_once() -> None:
    """Cancelling a wait removes it now: the next free slot goes to the one behind it."""
    gate, clock, events = plain()
    a, _ = Req(gate), Req(gate)
    gone, behind = Req(gate, name="gone"), Req(gate, name="behind")
    gone.deferred.cancel()
    assert gate.queued() == 1 and clock.getDelayedCalls() != []
    a.lease.release()
    assert not behind.waiting
    assert isinstance(gone.result, Failure) and gate.in_flight() == 2
    assert [(e.request_id, e.outcome) for e in events if isinstance(e, QueueLeft)] == [
        ("gone", "gone"), ("behind", "served")]


def test_an_engines_own_max_concurrent_overrides_the_hosts() -> None:
    """The host allows 2 at once, engine small 1: while small runs, a second request
    for it waits."""
    m, _, _, _ = managed(running="small")
    assert m.limit() == 1 and m.limit("big") == 2
    first, second = Req(m, "small"), Req(m, "small")
    assert not first.waiting and second.waiting
    first.lease.release()
    assert not second.waiting


def test_slots_and_switches_are_one_queue_in_arrival_order() -> None:
    """One slot on big (host limit 1): a request for big waits for the slot, then one
    for small waits for a switch behind it; the waiter for big is served first (FIFO),
    and the switch starts only once big has nothing in flight."""
    m, agent, _, events = managed(replace(MANAGED, max_concurrent=1))
    holder = Req(m, "big")
    slot = Req(m, "big", "slot")
    switch = Req(m, "small", "switch")
    assert slot.waiting and switch.waiting and m.switching_to is None
    assert [e.reason for e in events if isinstance(e, Queued)] == ["capacity", "switch"]
    holder.lease.release()
    assert not slot.waiting and agent.calls == [] and m.switching_to == "small"
    slot.lease.release()
    assert agent.last().order["engine"] == "small"
    agent.last().answer(started("small"))
    assert switch.lease.engine == "small"


def test_fairness_bounds_overtaking_when_slots_are_the_limit() -> None:
    """Two slots on big, a switch to small waiting: requests for big that arrive after
    the switch may take free slots ahead of it, at most `fairness` of them; the rest
    wait behind the switch."""
    m, agent, _, _ = managed(replace(MANAGED, schedule="arrival"), fairness=2)
    a, b = Req(m, "big"), Req(m, "big")
    switch = Req(m, "small")
    c, d, e = Req(m, "big"), Req(m, "big"), Req(m, "big")
    assert c.waiting and d.waiting and e.waiting        # no slot yet
    a.lease.release()
    assert not c.waiting and d.waiting
    b.lease.release()
    assert not d.waiting and e.waiting                    # 2 of 2 overtook
    c.lease.release()
    d.lease.release()
    assert e.waiting and agent.last().order["engine"] == "small"
    agent.last().answer(started("small"))
    assert switch.lease.engine == "small" and e.waiting


def test_a_waiter_whose_engine_is_starting_does_not_time_out_meanwhile() -> None:
    """The queue timeout passes while the waiter's own engine starts: it is served when
    the start succeeds; a waiter still without a slot then times out at once."""
    m, agent, clock, _ = managed(running=None)
    first, second = Req(m, "small"), Req(m, "small")     # small has one slot
    clock.advance(61)
    assert first.waiting and second.waiting
    agent.last().answer(started("small"))
    assert first.lease.engine == "small"
    assert second.failed() is QueueTimeout


def test_residency_keeps_the_engine_while_requests_for_it_keep_coming() -> None:
    """min_engine_seconds 30 after a switch to big: a request for small waits although
    big is idle; requests for big arriving meanwhile are served; once big had no request
    for RESIDENCY_IDLE seconds the switch goes ahead."""
    m, agent, clock, events = managed(replace(MANAGED, min_engine_seconds=30), running=None)
    m.acquire("big").addCallback(lambda lease: lease.release())
    agent.last().answer(started("big"))
    assert m.resident_until == 30
    small = Req(m, "small")
    assert small.waiting and len(agent.calls) == 1
    assert [e.reason for e in events if isinstance(e, EngineSwitch)
            and e.stage == "waiting"] == ["residency"]
    for _ in range(3):
        clock.advance(RESIDENCY_IDLE - 1)
        Req(m, "big").lease.release()
    assert len(agent.calls) == 1 and m.running == "big"
    clock.advance(RESIDENCY_IDLE)
    assert agent.last().order["engine"] == "small"


def test_residency_ends_at_min_engine_seconds_whatever_overtook_the_switch() -> None:
    """However busy the flow for the resident engine, the waiting switch starts at
    min_engine_seconds after the switch, not before: the requests that overtake it
    meanwhile do not count against `fairness` (with a bound of 2, 9 overtake),
    and once the residency is over the bound holds again."""
    host = replace(MANAGED, min_engine_seconds=10)
    for fairness in (100, 2):
        m, agent, clock, _ = managed(host, running=None, fairness=fairness)
        m.acquire("big").addCallback(lambda lease: lease.release())
        agent.last().answer(started("big"))
        Req(m, "small")
        for _ in range(9):
            clock.advance(1)
            Req(m, "big").lease.release()
        assert len(agent.calls) == 1 and m.running == "big"
        clock.advance(1)
        assert agent.last().order["engine"] == "small"


def test_by_default_one_client_alternating_models_cannot_thrash_the_host() -> None:
    """A host without min_engine_seconds gets 30 s of residency: while requests for
    big keep coming (a steady flow, more than `fairness` of them), a client
    alternating small and big does not switch the host; at 30 s it does, once."""
    host = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5",
                      engines=MANAGED.engines, max_concurrent=2)
    assert host.min_engine_seconds == 30
    m, agent, clock, events = managed(host, running=None)
    m.acquire("big").addCallback(lambda lease: lease.release())
    agent.last().answer(started("big"))
    small = Req(m, "small")
    for _ in range(29):
        clock.advance(1)
        Req(m, "big").lease.release()          # the other users of big
    assert small.waiting and len(agent.calls) == 1 and m.running == "big"
    clock.advance(1)
    assert agent.last().order["engine"] == "small"
    switches = [e for e in events if isinstance(e, EngineSwitch)]
    assert [e.stage for e in switches if e.stage != "waiting"] == ["begun", "done", "begun"]
    assert {e.reason for e in switches if e.stage == "waiting"} <= {"residency", "busy"}


def test_an_adopted_engine_has_no_residency() -> None:
    """Residency starts with a switch; an engine found running is not held."""
    m, agent, _, _ = managed(replace(MANAGED, min_engine_seconds=60))
    Req(m, "small")
    assert agent.last().order["engine"] == "small"


def test_closing_serves_waiters_for_slots_unless_handing_over() -> None:
    """A plain stop: a request waiting for a slot is still served as slots free (the
    drain waits for it). Closing for an upgrade's hand-over: it fails with ProxyStopping
    (nothing reached an engine: the successor serves it)."""
    gate, _, _ = plain()
    a, _ = Req(gate), Req(gate)
    waiting = Req(gate)
    gate.close()
    assert waiting.waiting
    a.lease.release()
    assert not waiting.waiting
    gate2, _, _ = plain()
    Req(gate2), Req(gate2)
    moved = Req(gate2)
    gate2.close(handing_over=True)
    assert moved.failed() is ProxyStopping
    assert str(moved.result.value) == "host laptop will not serve it: the proxy is stopping"


def test_an_operators_stop_waits_for_the_requests_on_the_engine() -> None:
    """stop_now queues like a switch to no engine: no stop order while a request runs,
    then one, and it fires once the engine is stopped (not an idle stop); a request
    after it starts the engine again."""
    m, agent, _, events = managed()
    stream = Req(m, "big")
    stopped = m.stop_now()
    assert not stopped.called and agent.calls == []
    after = Req(m, "small")
    stream.lease.release()
    assert agent.last().order == {"op": "stop", "engine": "big", "grace": 10.0}
    agent.last().answer({"ok": True, "stopped": [{"engine": "big", "pid": 7, "killed": False}]})
    assert stopped.called and m.switching_to == "small"
    assert agent.last().order["engine"] == "small"
    agent.last().answer(started("small"))
    assert after.lease.engine == "small"
    assert not [e for e in events if isinstance(e, IdleStop)]


def test_an_operators_stop_stops_every_engine_found_there_one_by_one() -> None:
    """An engine found beside the adopted one (not adopted: this host runs one at a time) is
    stopped too, by a stop naming it, before the operator's stop fires: nothing runs after."""
    m, agent, _, _ = managed(running=None)
    Deferred.fromCoroutine(m.adopt())
    agent.last().answer(status_answer(
        engine_found("big", ["llama-server", "-m", "big.gguf"], started_at=2.0),
        engine_found("small", ["llama-server", "-m", "small.gguf"], started_at=1.0)))
    assert m.running == "big"
    stopped = m.stop_now()
    assert agent.last().order == {"op": "stop", "engine": "big", "grace": 10.0}
    agent.last().answer({"ok": True, "stopped": [{"engine": "big", "pid": 7, "killed": False}]})
    assert not stopped.called and m.running is None
    assert agent.last().order == {"op": "stop", "engine": "small", "grace": 10.0}
    agent.last().answer({"ok": True, "stopped": [{"engine": "small", "pid": 8,
                                                  "killed": False}]})
    assert stopped.called and len(agent.calls) == 3


def test_a_failed_operators_stop_says_why_and_rereads_the_state() -> None:
    """A stop the agent could not do fails with StopFailed naming the reason."""
    m, agent, _, _ = managed()
    results: list[Any] = []
    m.stop_now().addBoth(results.append)
    agent.last().answer({"ok": False, "error": "process group 7 still alive"})
    agent.last("status").answer(status_answer(engine_found("big", ["llama-server", "-m",
                                                                    "big.gguf"])))
    [failure] = results
    assert isinstance(failure, Failure) and failure.check(StopFailed)
    assert str(failure.value) == ("stopping engine big on host gpu1 failed: process group 7 "
                                  "still alive")
    assert m.running == "big"


def test_a_stop_with_nothing_running_is_done_at_once() -> None:
    """Nothing runs: stop_now fires at once, no agent call."""
    m, agent, _, _ = managed(running=None)
    d: Deferred[None] = m.stop_now()
    assert d.called and agent.calls == []


def test_a_requests_wait_hands_a_lease_granted_now_over_as_it_is() -> None:
    """A request's QueueWait: a lease the host grants at once comes back as the
    already fired Deferred it is (no coroutine between, on every request's
    path); one that must wait fires once a slot is free."""
    gate, clock, _ = plain()
    request = DummyRequest([b""])
    request.state = RequestState()   # as every ProxyRequest has
    exchange = Exchange("x-1", "POST", "/v1/chat/completions", "127.0.0.1", clock,
                        lambda event: None)
    waits = [QueueWait(clock, request, exchange, gate, None) for _ in range(3)]
    granted = [w.acquire() for w in waits[:2]]
    leases: list[Lease] = []
    for d in granted:
        assert isinstance(d, Deferred) and d.called
        d.addCallback(leases.append)
    queued = waits[2].acquire()
    assert not queued.called
    leases[0].release()
    assert queued.called and isinstance(queued.result, Lease)
