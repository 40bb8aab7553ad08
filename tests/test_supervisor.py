"""Supervisor on a task.Clock: with a fake manager, the backoff schedule, the
crash-loop window, never restarting an engine the proxy stopped, `restart:
never`, the hung-engine rule, an operator's start clearing `failed`, a restart
that fails to start counting as a crash, a reopened watch's hello missing an
engine; with a real managed Host and a fake agent, a hung engine stopped under
its stuck lease and started again, and `failed` in /v1/models."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from llmproxy.agent.protocol import Exit
from llmproxy.config import EngineConfig, HostConfig, parse_config
from llmproxy.core.events import EngineExit, EngineUnhealthy, Event
from llmproxy.hosts.catalog import Route
from llmproxy.hosts.fleet import Fleet
from llmproxy.hosts.host import Host
from llmproxy.hosts.queueerrors import SwitchFailed
from llmproxy.hosts.supervise import CRASH_WINDOW
from llmproxy.hosts.supervisor import Supervisor
from llmproxy.hosts.waiter import Lease
from llmproxy.testing.agentfakes import FakeAgentTransport

HOST = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5", engines={
    "a": EngineConfig("a", ("llama-server", "a"), unhealthy_seconds=10.0),
    "b": EngineConfig("b", ("llama-server", "b")),
    "once": EngineConfig("once", ("llama-server", "once"), restart="never"),
})


class FakeManager:
    """What the supervisor uses of a host's manager: which engines run, the
    starts it asks for (answered by the test), the hung engines it stops."""

    def __init__(self, clock: Clock, host: HostConfig = HOST) -> None:
        self.host = host
        self.closing = False
        self.busy = False
        self.running: set[str] = set()
        self.starts: list[tuple[str | None, Deferred[Any]]] = []
        self.hung_stops: list[str] = []
        self.events: list[Event] = []
        self.sending: Callable[[str], Mapping[str, int]] = lambda engine: {}
        self.watching = True
        self.supervisor = Supervisor(self, clock, self.events.append,
                                     sending=lambda engine: self.sending(engine),  # noqa: PLW0108 (late-bound: a test swaps it)
                                     watching=lambda: self.watching)

    def _sending(self, engine: str) -> Mapping[str, int]:
        return self.sending(engine)     # late-bound: a test swaps `sending`

    def runs(self, engine: str | None) -> bool:
        return engine in self.running

    def running_engines(self) -> tuple[str, ...]:
        return tuple(sorted(self.running))

    def forget(self, engine: str) -> None:
        self.running.discard(engine)

    def acquire(self, engine: str | None = None, request_id: str | None = None, *,
                bounded: bool = True) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.starts.append((engine, d))
        return d

    def reconsider(self) -> None:
        pass

    def stop_hung(self, engine: str) -> Deferred[bool]:
        self.running.discard(engine)
        self.hung_stops.append(engine)
        return succeed(True)

    # -- the test's side -----------------------------------------------------------
    def start(self, engine: str) -> None:
        """The start the supervisor asked for succeeds."""
        asked, d = self.starts.pop(0)
        assert asked == engine
        self.running.add(engine)
        d.callback(Lease(engine))

    def crash(self, engine: str, status: int = 3) -> None:
        self.supervisor.exited(engine, Exit(engine, exit_status=status,
                                            log_tail=("loading", "CUDA out of memory")))

    def exits(self) -> list[EngineExit]:
        return [e for e in self.events if isinstance(e, EngineExit)]


def make() -> tuple[FakeManager, Clock]:
    clock = Clock()
    clock.advance(1000)
    return FakeManager(clock), clock


def test_each_crash_is_restarted_after_1_2_4_8_s_and_the_fifth_fails() -> None:
    """A crash forgets the engine and starts it again after the backoff, not
    before; the fifth crash within 10 minutes makes it failed: no start, and
    the event says so."""
    manager, clock = make()
    manager.running.add("a")
    for wait in (1.0, 2.0, 4.0, 8.0):
        manager.crash("a")
        assert not manager.runs("a") and manager.supervisor.held("a") is not None
        clock.advance(wait - 0.01)
        assert manager.starts == []
        clock.advance(0.01)
        manager.start("a")
    manager.crash("a")
    clock.advance(120)
    assert manager.starts == []
    assert [(e.restart_in, e.failed, e.crashes) for e in manager.exits()] == [
        (1.0, False, 1), (2.0, False, 2), (4.0, False, 3), (8.0, False, 4), (None, True, 5)]
    assert manager.exits()[0].exit == "exit status 3"
    assert manager.exits()[0].log_tail == ("loading", "CUDA out of memory")
    assert manager.supervisor.failed("a")
    assert manager.supervisor.snapshot()["a"]["state"] == "failed"


def test_crashes_older_than_ten_minutes_are_forgotten() -> None:
    """Four crashes, then a fifth more than ten minutes later: not failed, and
    its backoff is the first one's again."""
    manager, clock = make()
    manager.running.add("a")
    for wait in (1.0, 2.0, 4.0, 8.0):
        manager.crash("a")
        clock.advance(wait)
        manager.start("a")
    assert manager.supervisor.snapshot()["a"]["crashes"] == 4
    clock.advance(CRASH_WINDOW)
    assert manager.supervisor.snapshot()["a"]["crashes"] == 0
    manager.crash("a")
    last = manager.exits()[-1]
    assert (last.restart_in, last.failed, last.crashes) == (1.0, False, 1)
    assert not manager.supervisor.failed("a")


def test_an_engine_the_proxy_stopped_is_never_restarted() -> None:
    """An exit of an engine the manager no longer has (its idle stop, an
    eviction, an operator's stop forgot it first) is no crash: no event, no
    history, no start."""
    manager, clock = make()
    manager.crash("a")
    clock.advance(120)
    assert manager.events == [] and manager.starts == []
    assert manager.supervisor.snapshot() == {}


def test_restart_never_counts_the_crash_and_starts_nothing() -> None:
    manager, clock = make()
    manager.running.add("once")
    manager.crash("once")
    clock.advance(120)
    assert manager.starts == []
    assert [(e.restart_in, e.crashes) for e in manager.exits()] == [(None, 1)]
    assert "not restarted (restart: never)" in manager.exits()[0].line()[1]
    assert manager.supervisor.snapshot()["once"]["state"] == "exited"


def test_an_operators_start_clears_failed() -> None:
    """Failed: a request is refused with the exit and the last log line; the
    operator's start (clear) forgets the history, and the next crash restarts
    after 1 s again."""
    manager, clock = make()
    manager.running.add("a")
    for wait in (1.0, 2.0, 4.0, 8.0):
        manager.crash("a")
        clock.advance(wait)
        manager.start("a")
    manager.crash("a")
    refusal = manager.supervisor.refusal("a")
    assert refusal is not None
    assert "exit status 3" in refusal and "CUDA out of memory" in refusal
    assert "llmproxy engine gpu1 start a" in refusal
    manager.supervisor.clear("a")
    assert manager.supervisor.refusal("a") is None and not manager.supervisor.failed("a")
    manager.running.add("a")
    manager.crash("a")
    assert manager.exits()[-1].restart_in == 1.0


def test_a_restart_that_fails_to_start_counts_as_a_crash() -> None:
    """The start after the first crash fails (the agent's reason): a second
    crash, said with that reason, restarted after 2 s."""
    manager, clock = make()
    manager.running.add("a")
    manager.crash("a")
    clock.advance(1)
    _, d = manager.starts.pop(0)
    d.errback(SwitchFailed("gpu1", "a", "the engine exited during its start"))
    last = manager.exits()[-1]
    assert (last.exit, last.restart_in, last.crashes) == (
        "the engine exited during its start", 2.0, 2)
    clock.advance(2)
    assert [e for e, _ in manager.starts] == ["a"]


def test_a_hello_that_does_not_list_a_running_engine_is_its_exit() -> None:
    """A reopened watch's hello lists a but not b, which the proxy runs: b died
    while nobody watched, an exit of unknown status, restarted; a is kept.
    While an agent call is under way the hello decides nothing."""
    manager, clock = make()
    manager.running.update({"a", "b"})
    manager.busy = True
    manager.supervisor.hello(["a"])
    assert manager.events == [] and manager.runs("b")
    manager.busy = False
    manager.supervisor.hello(["a"])
    assert manager.runs("a") and not manager.runs("b")
    assert [(e.engine, e.exit, e.restart_in) for e in manager.exits()] == [
        ("b", "exit status unknown", 1.0)]
    clock.advance(1)
    assert [e for e, _ in manager.starts] == ["b"]


class Sent:
    """The bytes of the responses in flight, as the fleet's `sending` gives them."""

    def __init__(self) -> None:
        self.by_request: dict[str, int] = {}

    def __call__(self, engine: str) -> Mapping[str, int]:
        return dict(self.by_request)


def unhealthy(manager: FakeManager, engine: str = "a", **sent_by: int) -> Sent:
    sent = Sent()
    sent.by_request.update(sent_by)
    manager.sending = sent
    manager.running.add(engine)
    manager.supervisor.health(engine, False)
    return sent


def test_unhealthy_but_sending_is_not_hung() -> None:
    """A failing health check while a response keeps sending bytes: never
    replaced however long it lasts; once the bytes stop, replaced after
    unhealthy_seconds (10 s here) of silence."""
    manager, clock = make()
    sent = unhealthy(manager)
    for second in range(60):
        sent.by_request["r1"] = 100 + second
        clock.advance(1)
    assert manager.hung_stops == []
    assert manager.supervisor.snapshot()["a"]["state"] == "unhealthy"
    clock.advance(9)
    assert manager.hung_stops == []
    clock.advance(1.5)
    assert manager.hung_stops == ["a"]


def test_unhealthy_and_silent_is_replaced_and_counted_as_a_crash() -> None:
    """Unhealthy with a stuck response (its bytes do not grow) for 10 s: the
    engine is stopped at once and started again after the first backoff; the
    event stream and the log say it hung and for how long."""
    manager, clock = make()
    with capturedLogs() as logged:
        unhealthy(manager, r1=42)
        clock.advance(9.5)
        assert manager.hung_stops == []
        clock.advance(1)
    assert manager.hung_stops == ["a"]
    hung = [e for e in manager.events if isinstance(e, EngineUnhealthy)]
    assert [(e.engine, e.restart_in, e.crashes) for e in hung] == [("a", 1.0, 1)]
    assert 10.0 <= hung[0].seconds <= 11.0
    assert "hung: its health check failed for 10" in hung[0].line()[1]
    assert any("fails its health check" in formatEvent(e) for e in logged)
    clock.advance(1)
    manager.start("a")
    assert manager.supervisor.snapshot()["a"]["crashes"] == 1


def test_healthy_again_before_the_limit_changes_nothing() -> None:
    manager, clock = make()
    unhealthy(manager)
    clock.advance(9)
    manager.supervisor.health("a", True)
    clock.advance(60)
    assert manager.hung_stops == [] and manager.events == []
    assert manager.supervisor.snapshot() == {}


def test_no_engine_is_hung_while_the_watch_is_down_or_an_agent_call_runs() -> None:
    """Its health is not known while the watch is down, and the agent is busy
    with a call: the replacement waits for both, then happens at the next check."""
    manager, clock = make()
    unhealthy(manager)
    manager.watching = False
    clock.advance(30)
    manager.busy = True
    manager.watching = True
    clock.advance(30)
    assert manager.hung_stops == []
    manager.busy = False
    clock.advance(1)
    assert manager.hung_stops == ["a"]


def test_a_hang_loop_ends_failed_and_restart_never_stays_stopped() -> None:
    """Five hangs within 10 minutes: failed like five crashes. An engine with
    restart: never that hangs is stopped and not started again."""
    manager, clock = make()
    for _ in range(5):
        unhealthy(manager)
        clock.advance(11)
        if manager.starts:
            manager.starts.clear()
        clock.advance(60)
    hung = [e for e in manager.events if isinstance(e, EngineUnhealthy)]
    assert [e.failed for e in hung] == [False, False, False, False, True]
    assert manager.supervisor.failed("a")
    unhealthy(manager, "once")
    clock.advance(11)
    clock.advance(120)
    assert manager.hung_stops[-1] == "once" and manager.starts == []


def test_an_unhealthy_engine_the_proxy_stopped_is_not_replaced() -> None:
    manager, clock = make()
    unhealthy(manager)
    manager.running.discard("a")      # an idle stop, say
    clock.advance(60)
    assert manager.hung_stops == [] and manager.events == []


# -- with a real managed Host and a fake agent ------------------------------------------


def test_a_hung_engine_is_stopped_under_its_stuck_lease_and_started_again() -> None:
    """The stuck request's lease does not delay the stop (a switch would wait for
    it); from the stop on the engine is not running, a new request queues, and
    once the stuck stream ended (its lease released) and the backoff is over the
    engine is started again and the new request served."""
    clock = Clock()
    clock.advance(1000)
    agent = FakeAgentTransport()
    manager = Host(HOST, clock, transport=agent)
    manager.controller.assume("a")
    stuck = manager.acquire("a")
    lease: Lease = stuck.result
    manager.supervisor.health("a", False)
    clock.advance(10.5)
    stop = agent.last()
    assert stop.order == {"op": "stop", "engine": "a", "grace": manager.stop_grace}
    assert not manager.runs("a") and manager.state_of("a") == "unloaded"
    waiting = manager.acquire("a")
    assert not waiting.called
    stop.answer({"ok": True, "stopped": [{"engine": "a", "pid": 7, "killed": False}]})
    lease.release()                  # the stuck stream ended as the engine died
    clock.advance(1)
    start = agent.last()
    assert start.order["op"] == "start" and start.order["engine"] == "a"
    start.answer({"ok": True, "engine": "a", "pid": 8, "healthy": True})
    assert isinstance(waiting.result, Lease) and manager.runs("a")


def test_a_failed_engine_is_failed_in_v1_models_unless_a_replica_does_better() -> None:
    """/v1/models: a model whose engine failed on its only host is `failed`; with
    a replica where it is merely not running, `unloaded` wins."""
    config = parse_config({
        "hosts": [{"name": n, "url": f"http://10.0.0.{i}:8081", "ssh": f"llm@10.0.0.{i}",
                   "engines": {"a": {"command": ["llama-server"]}}}
                  for i, n in ((5, "gpu1"), (6, "gpu2"))],
        "models": {"m": {"hosts": ["gpu1", "gpu2"], "engine": "a"}}})
    clock = Clock()
    agent = FakeAgentTransport()
    fleet = Fleet(config, clock, {}, lambda e: None, transport=agent)
    gpu1 = fleet.managers["gpu1"]
    gpu1.controller.assume("a")
    for _ in range(5):
        gpu1.supervisor.exited("a", Exit("a", exit_status=1))
        clock.advance(10)
        for call in agent.pending:    # the restart
            call.answer({"ok": True, "engine": "a", "pid": 8, "healthy": True})
    assert gpu1.state_of("a") == "failed"
    both, alone = Route("m", config.hosts, "m", "a", None), \
        Route("m", config.hosts[:1], "m", "a", None)
    assert fleet.model_state(alone) == "failed"
    assert fleet.model_state(both) == "unloaded"
    refused = gpu1.acquire("a")
    assert "failed: it died 5 times" in str(refused.result.value)
    refused.addErrback(lambda f: f.trap(SwitchFailed))
    fleet.close()


def test_a_request_that_arrives_during_the_backoff_waits_for_the_restart() -> None:
    """A crash forgets the engine; a request for it in the backoff is queued, not
    refused and not started early: the start comes when the backoff ends, and the
    request is served by it."""
    clock = Clock()
    clock.advance(1000)
    agent = FakeAgentTransport()
    manager = Host(HOST, clock, transport=agent)
    manager.controller.assume("a")
    manager.supervisor.exited("a", Exit("a", exit_status=3, log_tail=("CUDA out of memory",)))
    clock.advance(0.5)
    waiting = manager.acquire("a")
    assert not waiting.called and agent.pending == []
    assert manager.state_of("a") != "loaded"
    clock.advance(0.5)
    start = agent.last()
    assert start.order["op"] == "start" and start.order["engine"] == "a"
    assert not waiting.called
    start.answer({"ok": True, "engine": "a", "pid": 8, "healthy": True})
    assert isinstance(waiting.result, Lease) and manager.runs("a")
    assert manager.supervisor.snapshot()["a"]["state"] == "ok"
