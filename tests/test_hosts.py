"""A managed Host with a fake agent transport and task.Clock: leases, switches that wait for the
running engine's requests, coalescing, the fairness bound, failures, adoption, closing, the
protected hook and the operations the graceful stop waits for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure

from llmproxy.config import EngineConfig, HostConfig
from llmproxy.hosts.host import Host
from llmproxy.hosts.queueerrors import ProxyStopping, SwitchFailed
from llmproxy.testing.agentfakes import FakeAgentTransport, engine_found, status_answer
from llmproxy.testing.fakes import Acquire

BIG = ("llama-server", "--port", "8081", "-m", "/models/big.gguf")
SMALL = ("llama-server", "--port", "8081", "-m", "/models/small.gguf")
TINY = ("llama-server", "--port", "8081", "-m", "/models/tiny.gguf")
HOST = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5", engines={
    "big": EngineConfig("big", BIG),
    "small": EngineConfig("small", SMALL, health="/v1/models", start_timeout_seconds=60),
    "tiny": EngineConfig("tiny", TINY),
}, min_engine_seconds=0)     # no residency: these tests are about the switches themselves
OK_STATUS = status_answer()  # nothing runs


class Req(Acquire):
    """One acquire() and what became of it."""

    def error(self) -> str:
        assert isinstance(self.result, Failure), self.result
        assert self.result.check(SwitchFailed, ProxyStopping)
        return str(self.result.value)


def make(running: str | None = "big", **kwargs: Any) -> tuple[Host, FakeAgentTransport,
                                                              Clock]:
    clock = Clock()
    clock.advance(1000)
    agent = FakeAgentTransport()
    manager = Host(HOST, clock, transport=agent, **kwargs)
    manager.controller.assume(running)
    return manager, agent, clock


def started(engine: str) -> dict[str, Any]:
    return {"ok": True, "engine": engine, "pid": 77, "healthy": True, "elapsed": 3.0,
            "already_running": False, "stopped": []}


def stopped(engine: str, pid: int = 77) -> dict[str, Any]:
    return {"ok": True, "stopped": [{"engine": engine, "pid": pid, "killed": False}]}


def logged(events: Sequence[Any]) -> list[str]:
    return [formatEvent(e) for e in events]


def test_a_request_for_the_running_engine_is_granted_at_once() -> None:
    """No agent call, the lease counts in flight, and release is idempotent."""
    m, agent, clock = make()
    clock.advance(5)
    r = Req(m, "big")
    assert r.lease.engine == "big"
    assert m.in_flight() == 1 and m.in_flight("big") == 1 and m.in_flight("small") == 0
    assert m.last_used == 1005
    clock.advance(3)
    r.lease.release()
    r.lease.release()
    assert m.in_flight() == 0
    assert m.last_used == 1008
    assert agent.calls == []


def test_a_switch_waits_for_the_running_engines_requests_then_starts_the_engine() -> None:
    """The start order goes out only once the last lease on the old engine is released; it
    carries the engine's command, health URL and timeouts, and is exclusive (the agent stops
    every other engine: this host runs one at a time); success grants the waiter."""
    m, agent, clock = make(stop_grace=10.0)
    stream = Req(m, "big")
    with capturedLogs() as events:
        r = Req(m, "small")
        assert r.waiting and agent.calls == []
        assert m.switching_to == "small"
        stream.lease.release()
    assert "switching gpu1 from big to small: waiting for 1 request(s) on big" in logged(events)
    call = agent.last()
    assert call.order == {"op": "start", "engine": "small", "command": list(SMALL),
                          "health_url": "http://10.0.0.5:8081/v1/models", "timeout": 60,
                          "grace": 10.0, "exclusive": True}
    assert call.timeout == 60 + 10 + 30
    assert call.host is HOST
    assert r.waiting and m.running is None and m.switching_to == "small"
    clock.advance(12.5)
    with capturedLogs() as events:
        call.answer(started("small"))
    assert "engine small on gpu1 ready in 12.5s" in logged(events)
    assert r.lease.engine == "small"
    assert m.running == "small" and m.switching_to is None and m.in_flight("small") == 1
    assert m.last_switch == {"at": 1012.5, "engine": "small", "outcome": "ok", "reason": None,
                             "elapsed": 12.5}


def test_concurrent_requests_needing_the_same_switch_share_one_agent_call() -> None:
    """Three requests for the same engine: one start order, three leases."""
    m, agent, _ = make(running=None)
    reqs = [Req(m, "small") for _ in range(3)]
    assert len(agent.calls) == 1
    late = Req(m, "small")  # arrives while the switch runs
    assert len(agent.calls) == 1
    agent.last().answer(started("small"))
    assert [r.lease.engine for r in [*reqs, late]] == ["small"] * 4
    assert m.in_flight("small") == 4
    assert [c.order["op"] for c in agent.calls] == ["start"]


def test_fairness_bounds_how_many_requests_may_overtake_a_waiting_switch() -> None:
    """While a switch waits, exactly `fairness` new requests for the running engine are
    granted; the next one queues behind the switch and is served after it, by a switch back."""
    m, agent, _ = make(fairness=3)
    first = Req(m, "big")
    switch = Req(m, "small")
    overtakers = [Req(m, "big") for _ in range(3)]
    assert all(not r.waiting for r in overtakers)
    behind = Req(m, "big")
    assert behind.waiting
    for r in [first, *overtakers]:
        assert agent.calls == []
        r.lease.release()
    agent.last("start").answer(started("small"))
    assert switch.lease.engine == "small" and behind.waiting
    assert m.switching_to == "big"
    switch.lease.release()
    assert agent.last().order["engine"] == "big"
    agent.last().answer(started("big"))
    assert behind.lease.engine == "big"
    assert [c.order.get("engine") for c in agent.calls] == ["small", "big"]


def test_the_fairness_count_starts_afresh_for_each_switch() -> None:
    """After a switch, requests may again overtake the next waiting switch `fairness` times."""
    m, agent, _ = make(running=None, fairness=1)
    a = Req(m, "small")
    agent.last().answer(started("small"))
    b = Req(m, "big")   # waits for a
    c = Req(m, "small")  # overtakes (1 of 1)
    d = Req(m, "small")  # queues
    assert not c.waiting and d.waiting and b.waiting
    a.lease.release()
    c.lease.release()
    agent.last().answer(started("big"))
    assert b.lease.engine == "big" and d.waiting
    e = Req(m, "big")  # d's switch waits: this is the 1 overtaker allowed
    f = Req(m, "big")
    assert not e.waiting and f.waiting


def test_a_failed_switch_fails_its_waiters_and_rereads_the_hosts_state() -> None:
    """Every request for the engine gets SwitchFailed with the agent's reason; then a status
    order, and `running` comes from its answer, not from a guess; last_switch says why."""
    m, agent, clock = make(running=None)
    reqs = [Req(m, "small"), Req(m, "small")]
    clock.advance(4)
    with capturedLogs() as events:
        agent.last().answer({"ok": False, "error": "small exited with status 1",
                             "log_tail": "loading...\nerror: cannot open /models/small.gguf"})
    reason = "small exited with status 1 (last log line: «error: cannot open /models/small.gguf»)"
    for r in reqs:
        assert r.error() == f"switching host gpu1 to engine small failed: {reason}"
    assert f"switching gpu1 to small failed: {reason}" in logged(events)
    assert m.last_switch == {"at": 1004, "engine": "small", "outcome": "failed",
                             "reason": reason, "elapsed": 4}
    status = agent.last()
    assert status.order == {"op": "status"}
    assert m.busy and m.running is None
    status.answer(status_answer(engine_found("big", BIG, pid=5)))
    assert m.running == "big" and not m.busy
    assert Req(m, "big").lease.engine == "big"


def test_an_unreachable_agent_fails_the_switch_with_its_reason() -> None:
    """An AgentError (ssh down) is the reason; a failed re-read leaves running None."""
    m, agent, _ = make()
    r = Req(m, "small")
    agent.last().fail("agent on gpu1: exit status 255 without an answer; stderr: refused")
    assert r.error() == ("switching host gpu1 to engine small failed: agent on gpu1: exit "
                         "status 255 without an answer; stderr: refused")
    agent.last("status").fail("agent on gpu1: no answer within 30s")
    assert m.running is None and not m.busy


def test_after_a_failed_switch_requests_for_other_engines_are_served_in_order() -> None:
    """Requests queued for other engines each get their own switch, FIFO."""
    m, agent, _ = make(running=None)
    small = Req(m, "small")
    tiny = Req(m, "tiny")
    big = Req(m, "big")
    agent.last().answer({"ok": False, "error": "small not healthy within 60 s"})
    assert small.error().endswith("small not healthy within 60 s")
    agent.last("status").answer(OK_STATUS)
    assert agent.last().order["engine"] == "tiny"
    agent.last().answer(started("tiny"))
    assert tiny.lease.engine == "tiny" and big.waiting
    tiny.lease.release()
    assert agent.last().order["engine"] == "big"


def test_adopt_keeps_a_healthy_engine_started_with_the_configured_command() -> None:
    """At start-up a healthy engine of this host, same name and command, is adopted: no
    restart, requests for it are granted at once."""
    m, agent, _ = make(running=None)
    with capturedLogs() as events:
        d = Deferred.fromCoroutine(m.adopt())
        assert agent.last().order == {"op": "status"}
        assert Req(m, "big").waiting  # nothing is granted while the state is unknown
        agent.last().answer(status_answer(engine_found("big", BIG, pid=4242)))
    assert d.called and m.running == "big"
    assert "adopted engine big on gpu1 (pid 4242), no restart" in logged(events)
    assert [c.order["op"] for c in agent.calls] == ["status"]
    assert m.in_flight("big") == 1


def test_adopt_does_not_take_an_engine_that_differs_or_is_unhealthy() -> None:
    """Another command, an unhealthy engine or an engine not in the config: running None,
    and the log says why."""
    cases: list[tuple[list[dict[str, Any]], str]] = [
        ([engine_found("big", [*BIG, "--ctx", "4096"])],
         "engine big on gpu1 not adopted: started with another command than the config's"),
        ([engine_found("big", BIG, healthy=False)],
         "engine big on gpu1 not adopted: not healthy "
         "(no 200 from http://10.0.0.5:8081/health)"),
        ([engine_found("old", ["x"])],
         "engine old on gpu1 not adopted: not one of this host's engines"),
        ([], "no engine runs on gpu1"),
    ]
    for found, line in cases:
        m, agent, _ = make(running="big")
        with capturedLogs() as events:
            Deferred.fromCoroutine(m.adopt())
            agent.last().answer(status_answer(*found))
        assert m.running is None
        assert line in logged(events)


def test_adopt_takes_the_latest_started_fit_engine_and_names_the_others() -> None:
    """Several engines running on a host that runs one at a time: the healthy one started with
    its configured command that started last is adopted; every other one is foreign, each
    logged with why, and the next switch's start is exclusive (the agent stops them)."""
    m, agent, _ = make(running=None)
    with capturedLogs() as events:
        Deferred.fromCoroutine(m.adopt())
        agent.last().answer(status_answer(
            engine_found("big", BIG, pid=1, started_at=30.0, healthy=False),
            engine_found("small", SMALL, pid=2, started_at=20.0),
            engine_found("tiny", TINY, pid=3, started_at=10.0),
            engine_found("old", ["x"], pid=4, started_at=40.0)))
    assert m.running == "small"
    lines = logged(events)
    assert "adopted engine small on gpu1 (pid 2), no restart" in lines
    assert ("engine big on gpu1 not adopted: not healthy (no 200 from "
            "http://10.0.0.5:8081/health)") in lines
    assert ("engine tiny on gpu1 not adopted: small was adopted: this host runs one engine at "
            "a time") in lines
    assert "engine old on gpu1 not adopted: not one of this host's engines" in lines
    assert "no engine runs on gpu1" not in lines
    Req(m, "tiny")
    assert agent.last().order["engine"] == "tiny" and agent.last().order["exclusive"] is True


def test_adopt_never_guesses_from_an_answer_it_cannot_read() -> None:
    """An answer of another protocol (an agent from another install) or without a list of
    engines: running None, and the log says why, naming both protocol versions."""
    for answer, reason in [
        ({"ok": True, "protocol": 1, "engine": "big", "healthy": True, "command": list(BIG)},
         "the agent on gpu1 speaks protocol 1, this proxy speaks 4: install the same llmproxy "
         "version on gpu1 as on the proxy"),
        ({"ok": True, "engine": "big", "healthy": True},
         "the agent's status answer has no list of engines: "),
    ]:
        m, agent, _ = make(running="big")
        with capturedLogs() as events:
            Deferred.fromCoroutine(m.adopt())
            agent.last().answer(answer)
        assert m.running is None
        assert any(line.startswith(f"cannot read what runs on gpu1: {reason}")
                   for line in logged(events)), logged(events)


def test_adopt_logs_errors_and_never_raises() -> None:
    """An unreachable agent at start-up: logged, running None, the coroutine succeeds."""
    m, agent, _ = make()
    results: list[Any] = []
    with capturedLogs() as events:
        Deferred.fromCoroutine(m.adopt()).addBoth(results.append)
        agent.last().fail("agent on gpu1: no answer within 30s")
    assert results == [None] and m.running is None
    assert "cannot read what runs on gpu1: agent on gpu1: no answer within 30s" in logged(events)


def test_closing_fails_waiting_switches_and_starts_no_new_one() -> None:
    """Once closing: a waiting switch is abandoned with ProxyStopping (nothing reached an
    engine: the request may be answered elsewhere), a request needing a switch fails at
    once, the running engine still serves, no stop starts."""
    m, agent, _ = make()
    stream = Req(m, "big")
    waiting = Req(m, "small")
    m.close()
    assert waiting.error() == "host gpu1 will not switch to engine small: the proxy is stopping"
    assert Req(m, "tiny").error().endswith("the proxy is stopping")
    assert not Req(m, "big").waiting
    stream.lease.release()
    assert agent.calls == []
    assert m.stop_engine().result is False


def test_closing_lets_a_switch_in_progress_finish_for_its_waiters() -> None:
    """A switch already running completes; its waiters (and latecomers for it) are served."""
    m, agent, _ = make(running=None)
    r = Req(m, "small")
    m.close()
    late = Req(m, "small")
    agent.last().answer(started("small"))
    assert r.lease.engine == "small" and late.lease.engine == "small"
    assert len(agent.calls) == 1


def test_a_protected_engine_is_neither_switched_away_from_nor_stopped() -> None:
    """While `protected` says the predecessor still uses the engine, the switch waits
    (no timer polls it); once released and reconsider() is called, it starts in that
    same turn; an idle stop is refused."""
    in_use = {"big"}
    m, agent, clock = make(protected=lambda engine: engine in in_use)
    assert m.stop_engine().result is False
    with capturedLogs() as events:
        r = Req(m, "small")
        clock.advance(5)
    assert agent.calls == [] and r.waiting
    assert logged(events) == ["switching gpu1 from big to small: waiting while the previous "
                              "llmproxy still uses big"]
    assert m.snapshot(clock.seconds())["protected"] is True
    in_use.clear()
    clock.advance(50)
    # No timer polls it: the one delayed call is the request's queue timeout.
    assert agent.calls == []
    assert [c.getTime() for c in clock.getDelayedCalls()] == [1000 + 60]
    m.reconsider()
    assert agent.last().order["engine"] == "small"


def test_operations_track_a_switch_until_its_status_reread_is_done() -> None:
    """operations() gives one Deferred per agent activity in progress, firing only when the
    switch and the state re-read after its failure are both done; none when idle."""
    m, agent, _ = make()
    assert m.operations() == []
    Req(m, "small")
    ops = m.operations()
    assert len(ops) == 1 and not ops[0].called
    agent.last().answer({"ok": False, "error": "boom"})
    assert not ops[0].called
    agent.last("status").answer(OK_STATUS)
    assert ops[0].called
    assert m.operations() == []


def test_an_idle_stop_stops_the_engine_and_later_requests_start_it_again() -> None:
    """stop_engine sends a stop order naming the engine (grace, timeout), sets running None and
    says True; a request during the stop waits for it, then gets its own start."""
    m, agent, _ = make(stop_grace=5.0)
    with capturedLogs() as events:
        d = m.stop_engine()
    assert "idle stop of big on gpu1" in logged(events)
    assert agent.last().order == {"op": "stop", "engine": "big", "grace": 5.0}
    assert agent.last().timeout == 35
    assert len(m.operations()) == 1
    r = Req(m, "big")
    assert r.waiting and len(agent.calls) == 1
    agent.last().answer(stopped("big"))
    assert d.result is True
    assert agent.last().order["op"] == "start"
    agent.last().answer(started("big"))
    assert r.lease.engine == "big"


def test_stop_engine_refuses_while_anything_uses_or_awaits_the_engine() -> None:
    """In flight, queued, nothing running: no stop order."""
    m, agent, _ = make()
    lease = Req(m, "big").lease
    assert m.stop_engine().result is False
    Req(m, "small")
    lease.release()  # the switch starts
    assert m.stop_engine().result is False
    m2, agent2, _ = make(running=None)
    assert m2.stop_engine().result is False
    assert [c.order["op"] for c in agent.calls] == ["start"] and agent2.calls == []


def test_a_failed_stop_rereads_the_state() -> None:
    """A stop the agent could not do: False, and running comes from a status re-read."""
    m, agent, _ = make()
    d = m.stop_engine()
    agent.last().answer({"ok": False, "error": "OSError: process group 7 still alive"})
    agent.last("status").answer(status_answer(engine_found("big", BIG, pid=7)))
    assert d.result is False and m.running == "big"


def test_a_cancelled_waiter_leaves_the_queue_and_its_switch_does_not_happen() -> None:
    """A client giving up while waiting: out of the queue; with no one left, no switch."""
    m, agent, _ = make()
    lease = Req(m, "big").lease
    r = Req(m, "small")
    r.deferred.cancel()
    assert m.queued() == 0 and m.switching_to is None
    lease.release()
    assert agent.calls == []


def test_an_engine_the_host_does_not_have_is_refused() -> None:
    """A name outside host.engines fails with SwitchFailed, no agent call."""
    m, agent, _ = make()
    assert Req(m, "huge").error() == ("switching host gpu1 to engine huge failed: the host "
                                      "has no such engine")
    assert agent.calls == []


def test_snapshot_reports_the_hosts_engine_state() -> None:
    """/status fields: running, switching_to, in flight, queued, last switch, idle age,
    residency left and an operator's stop waiting."""
    m, _, clock = make()
    lease = Req(m, "big").lease
    Req(m, "small")
    clock.advance(7)
    assert m.snapshot(clock.seconds()) == {
        "running": "big", "switching_to": "small", "operation": None, "in_flight": 1,
        "queued": 1, "protected": False, "last_switch": None, "last_used_seconds_ago": 7.0,
        "resident_seconds_left": None, "stop_requested": False}
    lease.release()
    snap = m.snapshot(clock.seconds())
    assert snap["running"] is None and snap["operation"] == "switch"
    assert snap["switching_to"] == "small"


def test_a_lease_released_inside_its_grant_callback_does_not_start_a_switch_early() -> None:
    """Re-entrant calls from callbacks are folded in: the next switch starts only once every
    granted lease is released, never between two grants."""
    m, agent, _ = make(running=None)
    a = m.acquire("small")
    a.addCallback(lambda lease: lease.release())
    b = Req(m, "small")
    Req(m, "big")
    agent.last().answer(started("small"))
    assert b.lease.engine == "small" and m.in_flight() == 1
    assert len(agent.calls) == 1
    b.lease.release()
    assert agent.last().order["engine"] == "big"
