"""The queue's rule for several engines' requests (hosts/batching.py): the pure
rule, and a managed Host on task.Clock with a fake agent: a batch of the
running engine's waiters before one switch, the longest-waiting engine next,
max_wait_seconds, the fairness bound for new arrivals, priority classes, and
a switch that waits for the running engine's streams (arrival order beside it)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from twisted.internet.task import Clock

from llmproxy.config import EngineConfig, HostConfig
from llmproxy.hosts.batching import ARRIVAL, BATCH, grouped, may_overtake
from llmproxy.hosts.host import Host
from llmproxy.hosts.priority import HIGH, LOW, NORMAL
from llmproxy.testing.agentfakes import FakeAgentTransport
from llmproxy.testing.fakes import Acquire


def cmd(name: str) -> tuple[str, ...]:
    return ("llama-server", "--port", "8081", "-m", f"/models/{name}.gguf")


HOST = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5", engines={
    n: EngineConfig(n, cmd(n)) for n in ("big", "small", "tiny")
}, min_engine_seconds=0, max_concurrent=1, max_wait_seconds=10)


@dataclass
class W:
    """A waiter as the rule reads it."""

    engine: str | None
    arrived: float = 0.0
    priority: int = NORMAL
    seq: int = 0
    stop: bool = False
    waited: bool = True
    held_back: bool = False


def make(schedule: str = BATCH, **kwargs: Any) -> tuple[Host, FakeAgentTransport, Clock]:
    clock = Clock()
    clock.advance(1000)
    agent = FakeAgentTransport()
    m = Host(replace(HOST, schedule=schedule), clock, transport=agent, publish=lambda e: None,
             **kwargs)
    m.controller.assume("big")
    return m, agent, clock


def started(engine: str) -> dict[str, Any]:
    return {"ok": True, "engine": engine, "pid": 77, "healthy": True, "elapsed": 3.0,
            "already_running": False, "stopped": []}


def switches(agent: FakeAgentTransport) -> list[str]:
    return [c.order["engine"] for c in agent.calls if c.order.get("op") == "start"]


def rule(waiter: W, blocked: list[W], now: float = 5.0, **kw: Any) -> tuple[bool, bool]:
    args: dict[str, Any] = {"resident": False, "jumped": 0, "fairness": 2, **kw}
    return may_overtake(replace(HOST, schedule=kw.pop("schedule", BATCH)), now, blocked,
                        waiter, **{k: v for k, v in args.items() if k != "schedule"})


# -- the pure rule --------------------------------------------------------------------
def test_a_waiting_request_of_the_running_engine_passes_free_within_max_wait() -> None:
    assert rule(W("big"), [W("small", arrived=0.0)], now=9.9) == (True, False)
    assert rule(W("big"), [W("small", arrived=0.0)], now=10.0) == (False, False)


def test_arrival_order_counts_every_pass_against_fairness() -> None:
    assert rule(W("big"), [W("small")], schedule=ARRIVAL) == (True, True)
    assert rule(W("big"), [W("small")], schedule=ARRIVAL, jumped=2) == (False, True)
    assert rule(W("big"), [W("small")], schedule=ARRIVAL, jumped=2, resident=True) == \
        (True, False)


def test_new_arrivals_lower_classes_and_held_back_ones_spend_fairness_in_batch() -> None:
    blocked = [W("small")]
    assert rule(W("big", waited=False), blocked) == (True, True)
    assert rule(W("big", waited=False), blocked, jumped=2) == (False, True)
    assert rule(W("big", priority=LOW), blocked, jumped=2) == (False, True)
    assert rule(W("big", held_back=True), blocked, jumped=2) == (False, True)
    assert rule(W("big", priority=HIGH), blocked, jumped=2) == (True, False)


def test_grouped_batches_engines_in_order_of_their_first_waiter_never_across_a_stop() -> None:
    t1, s1, b1, t2, stop, s2, t3 = (W("tiny"), W("small"), W("big"), W("tiny"),
                                    W("", stop=True), W("small"), W("tiny"))
    out = grouped([t1, s1, b1, t2, stop, s2, t3], lambda w: w.engine,
                  lambda w: w.stop, lambda w: w.engine == "big")
    assert out == [t1, t2, s1, b1, stop, s2, t3]


# -- a managed host -------------------------------------------------------------------
def scenario(schedule: str) -> tuple[list[str], list[Acquire]]:
    """big runs with its one slot taken; small waits, then three more big requests
    queue for the slot; everything is released as soon as it is granted."""
    m, agent, _ = make(schedule, fairness=1)
    holder = Acquire(m, "big")
    s1 = Acquire(m, "small")
    bigs = [Acquire(m, "big", f"b{i}") for i in range(3)]
    assert s1.waiting and all(b.waiting for b in bigs)
    holder.lease.release()
    served: list[Acquire] = []
    for _ in range(20):
        done = [a for a in [s1, *bigs] if not a.waiting and a not in served]
        for a in done:
            served.append(a)
            a.lease.release()
        if agent.pending:
            agent.last().answer(started(agent.last().order["engine"]))
        if not done and not agent.pending:
            break
    assert all(not a.waiting for a in [s1, *bigs])
    return switches(agent), served


def test_batch_serves_the_running_engines_waiters_then_switches_once() -> None:
    swaps, served = scenario(BATCH)
    assert swaps == ["small"] and [a.name for a in served] == ["b0", "b1", "b2", ""]
    assert scenario(ARRIVAL)[0] == ["small", "big"]        # fairness 1: one pass, then back


def test_the_engine_whose_oldest_waiter_waited_longest_goes_next_with_all_its_waiters(
) -> None:
    m, agent, clock = make()
    holder = Acquire(m, "big")
    t1 = Acquire(m, "tiny", "t1")
    clock.advance(1)
    s1 = Acquire(m, "small", "s1")
    t2 = Acquire(m, "tiny", "t2")
    s2 = Acquire(m, "small", "s2")
    assert [w.request_id for w in m.scheduler.waiters] == ["t1", "t2", "s1", "s2"]
    holder.lease.release()
    agent.last().answer(started("tiny"))
    assert not t1.waiting and t2.waiting and s1.waiting      # one slot
    t1.lease.release()
    assert not t2.waiting and s1.waiting
    t2.lease.release()
    agent.last().answer(started("small"))
    assert not s1.waiting and s2.waiting
    s1.lease.release()
    assert not s2.waiting and switches(agent) == ["tiny", "small"]


def test_no_request_passes_a_switch_whose_oldest_waiter_waited_max_wait_seconds() -> None:
    m, agent, clock = make()
    holder = Acquire(m, "big")
    s1 = Acquire(m, "small")
    bigs = [Acquire(m, "big", f"b{i}") for i in range(3)]
    holder.lease.release()
    assert not bigs[0].waiting                   # within max_wait: the batch goes on
    clock.advance(10)
    bigs[0].lease.release()
    assert bigs[1].waiting and switches(agent) == ["small"]     # the switch, not b1
    agent.last().answer(started("small"))
    assert not s1.waiting and bigs[1].waiting


def test_new_arrivals_pass_a_waiting_switch_at_most_fairness_times_in_batch() -> None:
    agent = FakeAgentTransport()
    m = Host(replace(HOST, max_concurrent=None), Clock(), transport=agent,
             publish=lambda e: None, fairness=2)
    m.controller.assume("big")
    holder = Acquire(m, "big")
    s1 = Acquire(m, "small")
    passed = [Acquire(m, "big", f"n{i}") for i in range(4)]
    assert [a.waiting for a in passed] == [False, False, True, True]
    assert passed[2].waiting and s1.waiting          # refused once: stays behind
    for a in [holder, *passed[:2]]:
        a.lease.release()
    agent.last().answer(started("small"))
    assert not s1.waiting and passed[2].waiting and passed[3].waiting


def test_a_switch_in_batch_never_cuts_a_stream() -> None:
    """The switch waits for the running engine's lease, however long it is held."""
    m, agent, clock = make()
    stream = Acquire(m, "big")
    s1 = Acquire(m, "small")
    clock.advance(50)                    # past max_wait: nothing more passes ...
    assert switches(agent) == [] and s1.waiting          # ... but the stream goes on
    stream.lease.release()
    assert switches(agent) == ["small"]


def test_low_requests_pass_a_high_switch_only_under_the_fairness_bound() -> None:
    m, agent, _ = make(fairness=1)
    holder = Acquire(m, "big")
    lows = [m.acquire("big", f"l{i}", priority="low") for i in range(3)]
    m.acquire("small", "switch", priority="high")
    assert m.scheduler.waiters[0].request_id == "switch"
    holder.lease.release()
    assert lows[0].called and not lows[1].called          # the one counted pass
    lows[0].addCallback(lambda lease: lease.release())
    assert not lows[1].called and switches(agent) == ["small"]
