"""A budgeted host (Host) on task.Clock with a fake agent:
engines resident together within memory_gb, eviction of idle engines (least
recently used first) that never touches one with a request in flight or
queued, one eviction shared by every waiter, the fairness bound on a start
that waits for engines to fall idle, per-engine stops, adoption of several,
and the reasons every stop and start carries."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from twisted.internet.task import Clock

from llmproxy.config import EngineConfig, HostConfig
from llmproxy.core.events import EngineSwitch, IdleStop
from llmproxy.hosts.host import Host
from llmproxy.hosts.idle import IdleStopper
from llmproxy.hosts.queueerrors import SwitchFailed
from llmproxy.testing.agentfakes import FakeAgentTransport, engine_found, status_answer
from llmproxy.testing.fakes import Acquire

URL = "http://10.0.0.5:"


def engine(name: str, port: int, gb: float, **kw: Any) -> EngineConfig:
    return EngineConfig(name, ("llama-server", "--port", str(port), "-m", name),
                        memory_gb=gb, url=f"{URL}{port}", **kw)


HOST = HostConfig("gpu1", f"{URL}8081", ssh="llm@10.0.0.5", memory_gb=80, engines={
    "chat": engine("chat", 8081, 40), "embed": engine("embed", 8082, 4),
    "code": engine("code", 8084, 30), "big": engine("big", 8083, 70)},
    min_engine_seconds=0)    # no residency but where a test gives one
STARTED = {"ok": True, "pid": 9, "healthy": True, "stopped": []}
STOPPED = {"ok": True, "stopped": [{"engine": "x", "pid": 9, "killed": False}]}


def make(host: HostConfig = HOST) -> tuple[Host, FakeAgentTransport, Clock,
                                           list[Any]]:
    clock, agent, events = Clock(), FakeAgentTransport(), []
    return Host(host, clock, transport=agent, publish=events.append), agent, clock, events


def start(m: Host, agent: FakeAgentTransport, name: str) -> None:
    """`name` started through a request, which is then released."""
    a = Acquire(m, name)
    assert agent.last().order["op"] == "start" and agent.last().order["engine"] == name
    agent.last().answer({**STARTED, "engine": name})
    a.lease.release()


def test_engines_that_fit_run_together_each_started_beside_the_others() -> None:
    """chat (40) and embed (4) on 80 GB: two non-exclusive starts, on each engine's
    own url; both serve at once; a request for a resident engine needs no agent call."""
    m, agent, _, _ = make()
    chat = Acquire(m, "chat")
    order = agent.last().order
    assert (order["engine"], order["health_url"], order.get("exclusive", False)) == \
        ("chat", f"{URL}8081/health", False)
    agent.last().answer({**STARTED, "engine": "chat"})
    embed = Acquire(m, "embed")
    assert agent.last().order["health_url"] == f"{URL}8082/health"
    agent.last().answer({**STARTED, "engine": "embed"})
    assert chat.lease.engine == "chat" and embed.lease.engine == "embed"
    assert m.running_engines() == ("chat", "embed") and m.memory_used() == 44
    calls = len(agent.calls)
    again = Acquire(m, "chat")
    assert again.lease.engine == "chat" and len(agent.calls) == calls


def test_requests_for_a_resident_engine_are_served_while_another_starts() -> None:
    """While embed's start is under way, chat keeps serving (one agent call at a time
    does not stop the queue)."""
    m, agent, _, _ = make()
    start(m, agent, "chat")
    embed = Acquire(m, "embed")
    chat = Acquire(m, "chat")
    assert embed.waiting and chat.lease.engine == "chat"
    assert m.residents(0.0)[-1]["state"] == "loading" and m.state_of("embed") == "loading"


def test_a_start_that_does_not_fit_evicts_idle_engines_lru_first_once_for_all_waiters() -> None:
    """big (70) on a host holding chat (40, used last) and embed (4, used first) and
    code (30): the idle ones go least recently used first, as few as needed, then big
    starts; both requests waiting for big share the one eviction and start."""
    m, agent, clock, events = make()
    start(m, agent, "embed")
    clock.advance(1)
    start(m, agent, "code")
    clock.advance(1)
    start(m, agent, "chat")
    clock.advance(1)
    first, second = Acquire(m, "big"), Acquire(m, "big")
    stops = []
    while agent.last().order["op"] == "stop":
        stops.append(agent.last().order["engine"])
        agent.last().answer(STOPPED)
    assert stops == ["embed", "code", "chat"][:len(stops)] and stops == ["embed", "code", "chat"]
    assert agent.last().order == {**agent.last().order, "op": "start", "engine": "big"}
    agent.last().answer({**STARTED, "engine": "big"})
    assert first.lease.engine == second.lease.engine == "big"
    assert [e.why for e in events if isinstance(e, IdleStop) and e.stage == "begun"] == \
        ["evicted for big"] * 3
    begun = [e.line()[1] for e in events if isinstance(e, EngineSwitch) and e.stage == "begun"]
    assert begun == ["starting embed on gpu1", "starting code on gpu1", "starting chat on gpu1",
                     "switching gpu1 from embed, code, chat to big: starting big"]


def test_an_engine_with_a_request_in_flight_is_never_evicted() -> None:
    """chat streams: big waits (a `waiting` EngineSwitch naming chat and memory_gb);
    the idle embed is not stopped in vain; once chat's request ends, chat and embed
    go and big starts."""
    m, agent, _, events = make()
    start(m, agent, "embed")
    chat = Acquire(m, "chat")
    agent.last().answer({**STARTED, "engine": "chat"})
    calls = len(agent.calls)
    big = Acquire(m, "big")
    assert big.waiting and len(agent.calls) == calls
    waiting = [e for e in events if isinstance(e, EngineSwitch) and e.stage == "waiting"]
    assert waiting[-1].reason == "memory" and waiting[-1].previous == "chat"
    assert waiting[-1].line()[1] == \
        "switching gpu1 from chat to big: waiting for chat to fall idle (the host's memory_gb)"
    chat.lease.release()
    assert [c.order["engine"] for c in agent.pending] == ["embed"]    # LRU first
    agent.last().answer(STOPPED)
    assert agent.last().order["engine"] == "chat" and agent.last().order["op"] == "stop"
    agent.last().answer(STOPPED)
    agent.last().answer({**STARTED, "engine": "big"})
    assert big.lease.engine == "big"


def test_requests_that_keep_an_engine_busy_overtake_a_waiting_start_at_most_fairness_times(
) -> None:
    """With big waiting for chat to fall idle, new chat requests pass it 8 times, then
    queue behind it; chat then falls idle and big starts."""
    m, agent, _, _ = make(replace(HOST, schedule="arrival"))   # the arrival rule
    chat = Acquire(m, "chat")
    agent.last().answer({**STARTED, "engine": "chat"})
    big = Acquire(m, "big")
    passed = [Acquire(m, "chat", f"c{i}") for i in range(10)]
    assert [a.waiting for a in passed] == [False] * 8 + [True] * 2
    for a in [chat, *passed[:8]]:
        a.lease.release()
    agent.last().answer(STOPPED)            # chat evicted for big
    agent.last().answer({**STARTED, "engine": "big"})
    assert big.lease.engine == "big"
    # The two chat requests behind big were never granted on the evicted chat: they
    # wait for big to fall idle (chat does not fit beside it), then chat comes back.
    assert passed[8].waiting and passed[9].waiting
    big.lease.release()
    assert agent.last().order == {**agent.last().order, "op": "stop", "engine": "big"}
    agent.last().answer(STOPPED)
    agent.last().answer({**STARTED, "engine": "chat"})
    assert passed[8].lease.engine == passed[9].lease.engine == "chat"


def test_a_queued_request_keeps_an_idle_engine_and_the_residency_holds_it() -> None:
    """An engine within min_engine_seconds of its start is not evicted: big waits
    until the residency is over (a timer re-checks), then chat goes."""
    host = HostConfig(HOST.name, HOST.url, ssh=HOST.ssh, memory_gb=80, engines=HOST.engines,
                      min_engine_seconds=30)
    m, agent, clock, _ = make(host)
    start(m, agent, "chat")
    big = Acquire(m, "big")
    calls = len(agent.calls)
    clock.advance(29)
    assert len(agent.calls) == calls and big.waiting
    clock.advance(1)
    assert agent.last().order == {**agent.last().order, "op": "stop", "engine": "chat"}


def test_within_its_residency_an_engines_requests_pass_a_waiting_start_freely() -> None:
    """chat resident for 30 s (the default) cannot be evicted for big: its requests
    keep being served meanwhile, more than `fairness` of them; once its residency
    is over the bound holds again and big starts when chat falls idle."""
    host = HostConfig(HOST.name, HOST.url, ssh=HOST.ssh, memory_gb=80, engines=HOST.engines)
    m, agent, clock, _ = make(host)
    start(m, agent, "chat")
    big = Acquire(m, "big")
    passed = [Acquire(m, "chat", f"c{i}") for i in range(12)]
    assert not any(a.waiting for a in passed) and big.waiting
    for a in passed:
        a.lease.release()
    clock.advance(30)
    assert agent.last().order == {**agent.last().order, "op": "stop", "engine": "chat"}


def test_a_failed_start_fails_its_waiters_with_the_agent_s_reason() -> None:
    m, agent, _, _ = make()
    a = Acquire(m, "chat")
    agent.last().answer({"ok": False, "error": "chat exited with status 1"})
    agent.last("status").answer(status_answer())
    assert isinstance(a.result.value, SwitchFailed)
    assert "chat exited with status 1" in str(a.result.value)


def test_an_operator_stop_of_one_engine_waits_for_its_requests_and_leaves_the_others() -> None:
    m, agent, _, events = make()
    start(m, agent, "embed")
    chat = Acquire(m, "chat")
    agent.last().answer({**STARTED, "engine": "chat"})
    done = m.stop_one("chat")
    later = Acquire(m, "chat")
    assert not done.called and later.waiting and agent.last().order["op"] == "start"
    chat.lease.release()
    assert agent.last().order == {**agent.last().order, "op": "stop", "engine": "chat"}
    agent.last().answer(STOPPED)
    assert done.called and m.running_engines() == ("embed",)
    assert [e.why for e in events if isinstance(e, IdleStop)][-1] == "operator"
    assert agent.last().order["op"] == "start"     # the request behind the stop restarts chat


def test_adoption_takes_every_healthy_configured_engine_within_the_budget() -> None:
    m, agent, _, _ = make()
    from twisted.internet.defer import Deferred
    Deferred.fromCoroutine(m.adopt())
    agent.last().answer(status_answer(
        engine_found("chat", HOST.engines["chat"].command, started_at=1),
        engine_found("embed", HOST.engines["embed"].command, started_at=2),
        engine_found("big", HOST.engines["big"].command, started_at=3)))
    assert m.running_engines() == ("chat", "embed")
    assert m.snapshot(0.0)["memory_gb"] == {"used": 44.0, "budget": 80}


def test_idle_and_ttl_stops_take_one_engine_and_leave_the_other() -> None:
    """embed has its own idle_stop_seconds of 60: it stops at 60 s (why `ttl`), chat
    stays until the top-level 900 s (why `idle`)."""
    host = HostConfig(HOST.name, HOST.url, ssh=HOST.ssh, memory_gb=80, engines={
        "chat": HOST.engines["chat"], "embed": engine("embed", 8082, 4, idle_stop_seconds=60)})
    m, agent, clock, events = make(host)
    start(m, agent, "chat")
    start(m, agent, "embed")
    idle = IdleStopper([m], clock, 900.0, check_every=5.0)
    idle.start()
    clock.advance(60)
    assert agent.last().order == {**agent.last().order, "op": "stop", "engine": "embed"}
    agent.last().answer(STOPPED)
    assert m.running_engines() == ("chat",)
    clock.advance(840)
    assert agent.last().order == {**agent.last().order, "op": "stop", "engine": "chat"}
    assert [e.why for e in events if isinstance(e, IdleStop) and e.stage == "begun"] == \
        ["ttl", "idle"]
