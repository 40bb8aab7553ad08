"""Queue position and ETA (observe/queueeta.py, observe/queueview.py): ordinals,
the running median, the ETA arithmetic, and a managed Host's queue as its
waiters move (task.Clock, a fake agent), with the SSE comment and the
queue.update event."""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock

from llmproxy.config import EngineConfig, HostConfig
from llmproxy.core.events import EngineSwitch, Event, RequestEnded, RequestRouted
from llmproxy.core.hub import Hub
from llmproxy.hosts.host import Host
from llmproxy.observe.queueeta import Line, Need, RunningMedian, etas, etas_together, ordinal
from llmproxy.observe.queueview import QueueUpdate, QueueView, comment
from llmproxy.testing.agentfakes import FakeAgentTransport
from llmproxy.testing.fakes import Acquire

HOST = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5", engines={
    "big": EngineConfig("big", ("llama-server", "-m", "big.gguf"), start_timeout_seconds=90),
    "small": EngineConfig("small", ("llama-server", "-m", "small.gguf"),
                          start_timeout_seconds=60),
}, min_engine_seconds=0, max_concurrent=1)


def test_ordinals() -> None:
    """1st 2nd 3rd 4th ... 11th 12th 13th ... 21st 22nd 23rd ... 101st 111th 112th."""
    assert [ordinal(n) for n in (1, 2, 3, 4, 10, 11, 12, 13, 14, 20, 21, 22, 23, 24, 100,
                                 101, 102, 103, 111, 112, 113, 121)] == [
        "1st", "2nd", "3rd", "4th", "10th", "11th", "12th", "13th", "14th", "20th", "21st",
        "22nd", "23rd", "24th", "100th", "101st", "102nd", "103rd", "111th", "112th", "113th",
        "121st"]


def test_running_median_keeps_the_last_samples() -> None:
    """None before any sample; the median of the last `size` ones; negatives count as 0."""
    m = RunningMedian(3)
    assert m.value() is None
    for sample in (10.0, 2.0, 4.0):
        m.add(sample)
    assert m.value() == 4.0
    m.add(100.0)           # 10 falls out: 2, 4, 100
    assert m.value() == 4.0
    m.add(-5.0)            # 4, 100, 0
    assert m.value() == 4.0 and len(m) == 3


def test_etas_slots_then_a_switch() -> None:
    """Behind a running request (one slot, 8 s median): the next waiter for the same
    engine at 8 s, the one after at 16 s; a waiter for another engine waits for the
    slot to drain then its start (30 s): 24 + 30 = 54, the next for it at 54 + 5."""
    durations = {"a": 8.0, "b": 5.0}
    queue = [Need("a"), Need("a"), Need("b"), Need("b")]
    found = etas(queue, Line("a", in_flight=1), lambda e: 30.0, durations.get, lambda e: 1)
    assert found == [8.0, 16.0, 54.0, 59.0]


def test_etas_no_limit_and_a_start_under_way() -> None:
    """A start under way with 12 s left and no slot limit: every waiter for it at 12 s;
    never negative."""
    found = etas([Need("b"), Need(None)], Line("b", 0, ready_in=12.0), lambda e: 30.0,
                 lambda e: None, lambda e: None)
    assert found == [12.0, 12.0]
    assert etas([Need("b")], Line("b", 0, ready_in=-3.0), lambda e: 1.0, lambda e: None,
                lambda e: None) == [0.0]


def test_etas_unknown_duration_is_none_not_a_guess() -> None:
    """A waiter behind a running request whose engine's duration is unmeasured: unknown;
    one that waits only for a free slot now is known (0)."""
    found = etas([Need("a"), Need("a")], Line("a", in_flight=1), lambda e: 5.0,
                 lambda e: None, lambda e: 2)
    assert found == [0.0, None]


def test_etas_an_operators_stop_drains_then_next_starts() -> None:
    """A stop waits for the drain; what follows it starts afresh."""
    found = etas([Need(None, stop=True), Need("b")], Line("a", in_flight=1),
                 lambda e: 20.0, lambda e: 4.0, lambda e: 1)
    assert found == [4.0, 24.0]


def test_etas_together_each_engine_its_own_line() -> None:
    """Engines together: a waiter for a running engine waits for its own slot only; one
    for an engine that does not run waits for its start."""
    lines = {"a": Line("a", in_flight=1), "b": Line(None)}
    found = etas_together([Need("b"), Need("a")], lines, lambda e: 15.0, lambda e: 6.0,
                          lambda e: 1)
    assert found == [15.0, 6.0]


def make() -> tuple[Host, QueueView, Clock, list[Event], FakeAgentTransport]:
    clock = Clock()
    clock.advance(1000)
    hub = Hub()
    seen: list[Event] = []
    hub.subscribe(seen.append)
    agent = FakeAgentTransport()
    host = Host(HOST, clock, transport=agent, publish=hub.publish)
    assert host.controller is not None
    host.controller.assume("big")
    view = QueueView(clock, lambda: {"gpu1": host}, hub.publish)
    hub.subscribe(view)
    return host, view, clock, seen, agent


def started(engine: str) -> dict[str, Any]:
    return {"ok": True, "engine": engine, "pid": 77, "healthy": True, "elapsed": 3.0,
            "already_running": False, "stopped": []}


def test_positions_and_etas_move_as_the_queue_moves() -> None:
    """Behind a running request: the first waiter for the running engine is 1st, the
    switch behind it 2nd with the declared start_timeout until a start is measured;
    when the running request ends, everyone moves up; the measured start (the switch's
    elapsed) and request duration replace the declared figure for later waits."""
    host, view, clock, seen, agent = make()
    view(RequestRouted(clock.seconds(), "r0", "POST", "/v1/x", "big", "gpu1", "big"))
    first = Acquire(host, "big", "r0")
    a = Acquire(host, "big", "r1")
    b = Acquire(host, "small", "r2")
    assert a.waiting and b.waiting
    clock.advance(2)
    assert view.place(host, "r1") == (1, None)          # big's duration: unmeasured
    assert view.place(host, "r2") == (2, None)
    doc = view.queue(host)
    assert [(w["position"], w["engine"], w["priority"], w["request_id"], w["waited_seconds"])
            for w in doc] == [(1, "big", "normal", "r1", 2.0), (2, "small", "normal", "r2",
                                                               2.0)]
    clock.advance(8)
    view(RequestEnded(clock.seconds(), "r0", "POST", "/v1/x", "10.0.0.9", "big", "gpu1",
                      "big", 200, 10, 10.0, "completed", routed=True))
    first.lease.release()
    assert not a.waiting
    assert view.place(host, "r1") is None               # served: no longer waits
    view(RequestRouted(clock.seconds(), "r1", "POST", "/v1/x", "big", "gpu1", "big"))
    assert view.place(host, "r2") == (1, 10.0 + 60.0)   # r1's slot (10 s), small's declared
    a.lease.release()                                   # the switch begins
    assert agent.pending, "the switch called the agent"
    clock.advance(20)
    assert view.place(host, "r2") == (1, 40.0)          # 60 declared, 20 gone
    assert comment("gpu1", 1, 40.0) == ": queued 1st for gpu1, about 40 s"
    agent.last("start").answer(started("small"))
    assert not b.waiting
    assert [e for e in seen if isinstance(e, EngineSwitch) and e.stage == "done"]
    assert view.start_time(host, "small") == 20.0       # measured replaces declared
    assert view.start_time(host, "big") == 90.0         # declared until measured
    clock.advance(0)
    updates = [e for e in seen if isinstance(e, QueueUpdate)]
    assert updates and updates[-1].host == "gpu1" and updates[-1].waiters == ()
    assert updates[0].fields()["waiters"][0]["position"] == 1


def test_queue_update_is_folded_per_reactor_turn() -> None:
    """Three waiters queued in one turn publish one queue.update, listing all three
    in served order."""
    host, _view, clock, seen, _agent = make()
    Acquire(host, "big", "r0")
    for name in ("r1", "r2", "r3"):
        Acquire(host, "big", name)
    clock.advance(0)
    updates = [e for e in seen if isinstance(e, QueueUpdate)]
    assert len(updates) == 1
    assert [w["request_id"] for w in updates[0].waiters] == ["r1", "r2", "r3"]
    assert [w["position"] for w in updates[0].waiters] == [1, 2, 3]


def test_comment_rounds_up_and_says_unknown() -> None:
    """The ETA rounds up to whole seconds, never below 0; unknown says so."""
    assert comment("gpu1", 3, 11.2) == ": queued 3rd for gpu1, about 12 s"
    assert comment("gpu1", 12, 0.0) == ": queued 12th for gpu1, about 0 s"
    assert comment("gpu1", 22, None) == ": queued 22nd for gpu1, wait unknown"
