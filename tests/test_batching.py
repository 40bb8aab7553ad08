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


def test_new_arrivals_pass_free_lower_classes_and_held_back_ones_spend_fairness_in_batch(
) -> None:
    blocked = [W("small")]
    assert rule(W("big", waited=False), blocked, jumped=2) == (True, False)
    assert rule(W("big", priority=LOW), blocked) == (True, True)
    assert rule(W("big", priority=LOW), blocked, jumped=2) == (False, True)
    assert rule(W("big", held_back=True), blocked, jumped=2) == (False, True)
    assert rule(W("big", priority=HIGH), blocked, jumped=2) == (True, False)


def test_max_wait_counts_from_the_end_of_the_start_that_began_the_batch() -> None:
    """A waiter that arrived during the running engine's start has waited for that
    start, not for the batch: its max_wait_seconds count from the start's end."""
    blocked = [W("small", arrived=0.0)]
    assert rule(W("big"), blocked, now=17.9, since=8.0) == (True, False)
    assert rule(W("big"), blocked, now=18.0, since=8.0) == (False, False)
    assert rule(W("big"), [W("small", arrived=9.0)], now=18.0, since=8.0) == (True, False)


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


def test_new_arrivals_pass_a_waiting_switch_freely_in_batch_until_max_wait() -> None:
    """With free slots, new requests for the running engine pass a waiting switch
    beyond the fairness bound while its waiter has waited less than max_wait_seconds;
    from then on they stay behind it, and it begins once the running ones end."""
    agent = FakeAgentTransport()
    clock = Clock()
    m = Host(replace(HOST, max_concurrent=None), clock, transport=agent,
             publish=lambda e: None, fairness=2)
    m.controller.assume("big")
    holder = Acquire(m, "big")
    s1 = Acquire(m, "small")
    passed = [Acquire(m, "big", f"n{i}") for i in range(4)]
    assert not any(a.waiting for a in passed) and s1.waiting
    clock.advance(10)
    late = Acquire(m, "big", "late")
    assert late.waiting and s1.waiting and switches(agent) == []
    for a in [holder, *passed]:
        a.lease.release()
    assert switches(agent) == ["small"]
    agent.last().answer(started("small"))
    assert not s1.waiting and late.waiting


def test_a_long_start_does_not_use_up_the_next_batchs_max_wait() -> None:
    """small is started while a request for big arrives; the start takes longer than
    max_wait_seconds. Once small runs, a second request for small still passes the
    waiting switch back to big (the big request has waited 0 s because of the batch),
    and the switch back comes after max_wait_seconds of the batch."""
    m, agent, clock = make()
    s0 = Acquire(m, "small", "s0")
    assert switches(agent) == ["small"]
    b1 = Acquire(m, "big", "b1")
    clock.advance(20)
    agent.last().answer(started("small"))
    assert not s0.waiting and b1.waiting
    s1 = Acquire(m, "small", "s1")
    assert s1.waiting                                     # one slot
    s0.lease.release()
    assert not s1.waiting and switches(agent) == ["small"]
    clock.advance(10)
    s2 = Acquire(m, "small", "s2")
    s1.lease.release()
    assert s2.waiting and switches(agent) == ["small", "big"]


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


def test_on_a_budgeted_host_a_long_start_does_not_use_up_its_engines_batch() -> None:
    """gpu1 with memory_gb 80: code (30 GB) is started while a request for big (70 GB,
    which needs code stopped) arrives; the start takes longer than max_wait_seconds.
    Once code runs, new requests for code pass the waiting start of big for
    max_wait_seconds of the batch, and from then on none does: code is evicted."""
    def engine(name: str, port: int, gb: float) -> EngineConfig:
        return EngineConfig(name, cmd(name), memory_gb=gb, url=f"http://10.0.0.5:{port}")

    host = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5", memory_gb=80,
                      engines={"code": engine("code", 8081, 30), "big": engine("big", 8082, 70)},
                      min_engine_seconds=0, max_wait_seconds=10)
    clock, agent = Clock(), FakeAgentTransport()
    m = Host(host, clock, transport=agent, publish=lambda e: None)
    code = Acquire(m, "code", "c0")
    big = Acquire(m, "big", "b1")
    clock.advance(20)
    agent.last().answer(started("code"))
    assert not code.waiting and big.waiting
    c1 = Acquire(m, "code", "c1")
    assert not c1.waiting and big.waiting            # 0 s of the batch so far
    clock.advance(10)
    c2 = Acquire(m, "code", "c2")
    assert c2.waiting and big.waiting
    code.lease.release()
    c1.lease.release()
    assert (agent.last().order["op"], agent.last().order["engine"]) == ("stop", "code")
    assert c2.waiting                                  # code is evicted for big


def idle_hold_scenario(schedule: str) -> tuple[Host, Acquire, Clock, FakeAgentTransport]:
    """small is started (a 4 s load) for s0 while big waits for the switch back; s0 ends
    and small is idle."""
    m, agent, clock = make(schedule)
    s0 = Acquire(m, "small", "s0")
    clock.advance(4)
    agent.last().answer(started("small"))
    b1 = Acquire(m, "big", "b1")
    s0.lease.release()
    return m, b1, clock, agent


def test_an_idle_engine_keeps_the_host_as_long_as_its_own_load_took_in_batch() -> None:
    """In batch, small (idle, loaded in 4 s) keeps the host from the waiting switch to
    big: a request for small 2 s later is served at once, without a switch; 4 s after
    small's last request the switch to big begins. Arrival order switches at once."""
    m, b1, clock, agent = idle_hold_scenario(BATCH)
    assert switches(agent) == ["small"] and b1.waiting
    clock.advance(2)
    s1 = Acquire(m, "small", "s1")
    assert not s1.waiting and switches(agent) == ["small"]
    s1.lease.release()
    clock.advance(3.9)
    assert switches(agent) == ["small"]
    clock.advance(0.1)
    assert switches(agent) == ["small", "big"]
    assert switches(idle_hold_scenario(ARRIVAL)[3]) == ["small", "big"]


def test_the_idle_hold_never_outlasts_max_wait_seconds_of_the_batch() -> None:
    """small's load took 30 s (longer than max_wait_seconds, 10): once big's waiter has
    waited 10 s of the batch, the switch begins although small was used 2 s ago."""
    m, agent, clock = make()
    s0 = Acquire(m, "small", "s0")
    clock.advance(30)
    agent.last().answer(started("small"))
    b1 = Acquire(m, "big", "b1")
    clock.advance(8)
    s0.lease.release()
    assert switches(agent) == ["small"]
    clock.advance(2)
    assert switches(agent) == ["small", "big"] and b1.waiting


def test_on_a_budgeted_host_an_idle_engine_is_kept_as_long_as_its_load_took() -> None:
    """gpu1 with memory_gb 80: code (30 GB, loaded in 5 s) falls idle while big (70 GB)
    waits to start; code is evicted only 5 s after its last request, and a request for
    code within them is served by it."""
    def engine(name: str, port: int, gb: float) -> EngineConfig:
        return EngineConfig(name, cmd(name), memory_gb=gb, url=f"http://10.0.0.5:{port}")

    host = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5", memory_gb=80,
                      engines={"code": engine("code", 8081, 30), "big": engine("big", 8082, 70)},
                      min_engine_seconds=0, max_wait_seconds=30)
    clock, agent = Clock(), FakeAgentTransport()
    m = Host(host, clock, transport=agent, publish=lambda e: None)
    code = Acquire(m, "code", "c0")
    clock.advance(5)
    agent.last().answer(started("code"))
    big = Acquire(m, "big", "b1")
    code.lease.release()
    calls = len(agent.calls)
    clock.advance(3)
    c1 = Acquire(m, "code", "c1")
    assert not c1.waiting and big.waiting and len(agent.calls) == calls
    c1.lease.release()
    clock.advance(4.9)
    assert len(agent.calls) == calls
    clock.advance(0.1)
    assert (agent.last().order["op"], agent.last().order["engine"]) == ("stop", "code")
