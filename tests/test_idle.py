"""IdleStopper with task.Clock and fake agents: when an idle stop fires, when it must not,
shutdown between hosts, and the stops the graceful stop waits for."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from llmproxy.config import EngineConfig, HostConfig
from llmproxy.hosts.host import Host
from llmproxy.hosts.idle import IdleStopper
from llmproxy.testing.agentfakes import FakeAgentTransport

STOPPED = {"ok": True, "stopped": [{"engine": "big", "pid": 7, "killed": False}]}


def host(name: str) -> HostConfig:
    return HostConfig(name, f"http://{name}:8081", ssh=f"llm@{name}", engines={
        "big": EngineConfig("big", ("llama-server", "-m", "big.gguf")),
        "small": EngineConfig("small", ("llama-server", "-m", "small.gguf"))})


PROTECTED: set[str] = set()   # engines a predecessor still uses (the `protected` hook)


def guarded(engine: str) -> bool:
    return engine in PROTECTED


def setup(n: int = 1, idle: float = 900.0) -> tuple[list[Host], FakeAgentTransport,
                                                    Clock, IdleStopper]:
    PROTECTED.clear()
    clock = Clock()
    agent = FakeAgentTransport()
    managers = [Host(host(f"gpu{i + 1}"), clock, transport=agent, protected=guarded)
                for i in range(n)]
    for manager in managers:
        manager.controller.assume("big")
    return managers, agent, clock, IdleStopper(managers, clock, idle, check_every=5.0)


def stops(agent: FakeAgentTransport) -> list[str]:
    return [c.host.name for c in agent.calls if c.order["op"] == "stop"]


def test_the_engine_is_stopped_after_idle_seconds_and_not_before() -> None:
    """With idle 900 s and a check every 5 s: no stop at 899 s, a stop order at 900 s."""
    (m,), agent, clock, idle = setup()
    idle.start()
    clock.advance(895)
    assert agent.calls == []
    assert idle.deadline(m) == 900
    with capturedLogs() as events:
        clock.advance(5)
    assert stops(agent) == ["gpu1"]
    assert "idle stop of big on gpu1" in [formatEvent(e) for e in events]
    agent.last().answer(STOPPED)
    assert m.running is None and idle.deadline(m) is None
    clock.advance(2000)
    assert len(agent.calls) == 1


def test_a_request_moves_the_deadline() -> None:
    """Idle time counts from the last lease granted or released."""
    (m,), agent, clock, idle = setup()
    idle.start()
    clock.advance(600)
    m.acquire("big").addCallback(lambda lease: lease.release())
    assert idle.deadline(m) == 1500
    clock.advance(895)
    assert agent.calls == []
    clock.advance(5)
    assert stops(agent) == ["gpu1"]


def test_no_stop_while_a_request_is_in_flight() -> None:
    """An engine with a lease held (a long stream) is never idle-stopped, however long."""
    (m,), agent, clock, idle = setup(idle=10)
    leases: list[Any] = []
    m.acquire("big").addCallback(leases.append)
    idle.start()
    clock.pump([5.0] * 100)
    assert agent.calls == [] and idle.deadline(m) is None
    leases[0].release()
    clock.advance(10)
    assert stops(agent) == ["gpu1"]


def test_no_stop_while_a_switch_waits_or_the_engine_is_protected() -> None:
    """A queued switch or the protected hook holds the idle stop off."""
    (m,), agent, clock, idle = setup(idle=10)
    PROTECTED.add("big")
    idle.start()
    clock.advance(100)
    assert agent.calls == [] and idle.deadline(m) is None
    PROTECTED.discard("big")
    m.controller.assume(None)
    # The switch's start order is in progress (its waiter's queue timeout passes).
    m.acquire("small").addErrback(lambda f: None)
    clock.advance(100)
    assert [c.order["op"] for c in agent.calls] == ["start"]


def test_closing_stops_the_loop_between_hosts() -> None:
    """Closing set while the first host's stop is being started: the second host, idle too,
    is not stopped, and no later check starts anything."""
    managers, agent, clock, idle = setup(n=2, idle=10)
    first = managers[0]
    original = first.stop_engine

    def stop_then_shutdown() -> Deferred[bool]:
        d = original()
        idle.close()  # the shutdown signal arrives meanwhile
        return d

    first.stop_engine = stop_then_shutdown  # type: ignore[method-assign]
    clock.advance(10)
    idle.check()
    assert stops(agent) == ["gpu1"]
    clock.advance(100)
    idle.check()
    assert stops(agent) == ["gpu1"]


def test_closing_before_a_check_starts_no_stop() -> None:
    """Once closing, the loop never starts a stop, even for hosts long idle."""
    _, agent, clock, idle = setup(n=2, idle=10)
    idle.start()
    idle.close()
    clock.advance(1000)
    assert agent.calls == []


def test_a_closing_manager_is_skipped() -> None:
    """A host whose manager is closing is not stopped even if the stopper is not closing."""
    (m,), agent, clock, idle = setup(idle=10)
    m.close()
    clock.advance(20)
    idle.check()
    assert agent.calls == []


def test_operations_track_each_stop_until_it_is_done() -> None:
    """One Deferred per stop in progress, firing when the agent has answered; none after."""
    _, agent, clock, idle = setup(n=2, idle=10)
    assert idle.operations() == []
    clock.advance(10)
    idle.check()
    ops = idle.operations()
    assert len(ops) == 2 and not any(d.called for d in ops)
    idle.check()  # a stop in progress is not started twice
    assert len(stops(agent)) == 2
    agent.calls[0].answer(STOPPED)
    assert ops[0].called and not ops[1].called
    assert len(idle.operations()) == 1
    agent.calls[1].answer(STOPPED)
    assert ops[1].called and idle.operations() == []


def test_stop_halts_the_loop() -> None:
    """After stop(), the clock passing starts no check."""
    _, agent, clock, idle = setup(idle=10)
    idle.start()
    idle.stop()
    clock.advance(100)
    assert agent.calls == [] and clock.getDelayedCalls() == []


def test_an_engine_s_own_idle_stop_seconds_overrides_the_top_level_one() -> None:
    """`engines.E.idle_stop_seconds` is E's TTL: a 60 s engine stops at 60 s on a
    proxy whose top-level idle time is 900 s; the other engine keeps the 900 s."""
    clock = Clock()
    agent = FakeAgentTransport()
    ttl = HostConfig("gpu1", "http://gpu1:8081", ssh="llm@gpu1", engines={
        "big": EngineConfig("big", ("llama-server", "-m", "big.gguf"), idle_stop_seconds=60),
        "small": EngineConfig("small", ("llama-server", "-m", "small.gguf"))})
    short, other = Host(ttl, clock, transport=agent), Host(host("gpu2"), clock, transport=agent)
    short.controller.assume("big")
    other.controller.assume("big")
    idle = IdleStopper([short, other], clock, 900.0, check_every=5.0)
    idle.start()
    assert (idle.deadline(short), idle.deadline(other)) == (60, 900)
    clock.advance(55)
    assert stops(agent) == []
    clock.advance(5)
    assert stops(agent) == ["gpu1"]
    agent.last().answer(STOPPED)
    short.controller.assume("small")        # the host's other engine keeps the top-level time
    assert idle.deadline(short) == short.last_used + 900
