"""The stop chain with task.Clock and a fake target: the order of its steps,
the one budget they share, the cut-logging window and the engine wait."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from llmproxy.core.clockwaits import within
from llmproxy.core.hub import Hub
from llmproxy.lifecycle.stop import StopBudget, StopChain
from llmproxy.observe.inflight import InFlight


class FakeTarget:
    """Records each step with the clock time it ran at."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.steps: list[tuple[str, float]] = []
        self.hub = Hub.logging()
        self.inflight = InFlight(clock, self.hub, id_prefix="t")
        self.operations: list[Deferred[Any]] = []
        self.admission: Deferred[None] = succeed(None)
        self.progress: list[tuple[int, float]] = []
        self.aborted: list[str] = []
        self.predecessor: tuple[int, Deferred[None]] | None = None
        # What a cut request's handler does when its connection is dropped.
        self.on_abort = lambda exchange: self.inflight.end(exchange, "client-gone")

    def _note(self, step: str) -> None:
        self.steps.append((step, self.clock.seconds()))

    def stop_readiness(self) -> None:
        self._note("readiness")

    def stop_admission(self) -> Deferred[None]:
        self._note("admission")
        return self.admission

    def in_flight(self) -> Sequence[Any]:
        return list(self.inflight.active.values())

    def drained(self) -> Deferred[None]:
        return self.inflight.idle()

    def engine_operations(self) -> Sequence[Deferred[Any]]:
        self._note("engines")
        return self.operations

    def predecessor_exit(self) -> tuple[int, Deferred[None]] | None:
        return self.predecessor

    def drain_progress(self, remaining: int, seconds_left: float) -> None:
        self.progress.append((remaining, seconds_left))

    def stop_services(self) -> Deferred[None]:
        self._note("services")
        return succeed(None)

    def request(self, model: str = "m") -> Any:
        exchange = self.inflight.begin("POST", "/v1/chat/completions", "10.0.0.1")
        exchange.asked_for(model)
        exchange.bound_for("gpu1")

        def abort() -> None:
            self.aborted.append(exchange.id)
            self.on_abort(exchange)

        exchange.on_abort(abort)
        return exchange


def run(clock: Clock, budget: StopBudget, target: FakeTarget, t0: float = 0.0) -> Deferred[Any]:
    return Deferred.fromCoroutine(StopChain(clock, budget, target, target.hub).run(t0))


def test_steps_run_in_order_and_a_clean_drain_ends_when_the_last_request_does() -> None:
    """readiness -> (prestop) -> admission -> drain -> engines -> services, and the
    drain ends the moment the last request ends, not at its deadline."""
    clock = Clock()
    target = FakeTarget(clock)
    exchange = target.request()
    with capturedLogs() as events:
        done = run(clock, StopBudget(prestop=2, drain=30), target)
        clock.advance(2)
        assert [s for s, _ in target.steps] == ["readiness", "admission"]
        assert target.steps[1][1] == 2          # admission stops after prestop, not before
        clock.advance(5)
        assert not done.called                   # still draining
        target.inflight.end(exchange, "completed")
    assert done.called
    result = done.result
    assert result.clean and not target.aborted
    assert [s for s, _ in target.steps] == ["readiness", "admission", "engines", "services"]
    assert target.steps[-1][1] == 7
    text = [formatEvent(e) for e in events]
    assert any("stopping: 1 request(s) in flight, budget 94s" in t for t in text)
    assert "drained, exiting" in text


def test_drain_deadline_is_counted_from_the_signal() -> None:
    """One global budget: the drain ends at t0 + prestop + drain even when the
    stop began late (t0 in the past) or admission was slow."""
    clock = Clock()
    clock.advance(100)
    target = FakeTarget(clock)
    target.request()
    admission: Deferred[None] = Deferred()
    target.admission = admission
    done = run(clock, StopBudget(prestop=0, drain=10), target, t0=97.0)   # signal 3 s ago
    clock.advance(2)
    admission.callback(None)                                             # admission took 2 s
    clock.advance(4.9)
    assert not target.aborted
    clock.advance(0.1)                                                   # 97 + 10 = 107
    assert target.aborted and clock.seconds() == 107
    assert done.called and not done.result.clean


def test_cut_requests_get_two_seconds_to_log_and_are_named() -> None:
    """At the deadline every request left is cut (aborted, outcome=cut, named in
    the log); handlers that do not finish get 2 s, then a fallback line names them."""
    clock = Clock()
    target = FakeTarget(clock)
    quick = target.request("fast")
    slow = target.request("stuck")
    target.on_abort = lambda e: None               # handlers finish later, by hand
    with capturedLogs() as events:
        done = run(clock, StopBudget(prestop=0, drain=5), target)
        clock.advance(5)
        assert target.aborted == [quick.id, slow.id]
        clock.advance(1)
        target.inflight.end(quick, "client-gone")    # logs within the window
        clock.advance(0.99)
        assert not done.called
        clock.advance(0.01)                          # the 2 s window is over
    assert done.called
    assert [e.id for e in done.result.cut] == [quick.id, slow.id]
    text = [formatEvent(e) for e in events]
    assert "drain time over: cut 2 request(s)" in text
    assert any(quick.id in t and "outcome=cut" in t and "model=fast" in t for t in text)
    assert any(slow.id in t and "did not finish within 2s" in t and "model=stuck" in t
               for t in text)
    assert target.steps[-1] == ("services", 7.0)
    target.inflight.end(slow, "client-gone")     # its handler ends at last: none left
    assert not target.inflight.active


def test_engine_operation_in_progress_is_waited_for() -> None:
    """An idle stop or switch already running is waited for before the services stop."""
    clock = Clock()
    target = FakeTarget(clock)
    operation: Deferred[None] = Deferred()
    target.operations = [operation]
    done = run(clock, StopBudget(prestop=0, drain=30), target)
    clock.advance(20)
    assert not done.called and target.steps[-1][0] == "engines"
    operation.callback(None)
    assert done.called and target.steps[-1] == ("services", 20.0)


def test_engine_wait_is_capped_at_60_seconds() -> None:
    """An engine operation that never ends holds the stop for 60 s, no more."""
    clock = Clock()
    target = FakeTarget(clock)
    target.operations = [Deferred()]
    with capturedLogs() as events:
        done = run(clock, StopBudget(prestop=0, drain=30), target)
        clock.advance(59.9)
        assert not done.called
        clock.advance(0.1)
    assert done.called and target.steps[-1] == ("services", 60.0)
    assert "engine operation(s) still running after 60s: exiting without them" in [
        formatEvent(e) for e in events]


def test_no_step_runs_past_the_whole_budget() -> None:
    """Admission that never completes, a drain that never ends and an engine
    operation that never ends: the chain still ends at t0 + total budget."""
    clock = Clock()
    target = FakeTarget(clock)
    stuck = target.request()
    target.on_abort = lambda e: None
    target.admission = Deferred()
    target.operations = [Deferred()]
    budget = StopBudget(prestop=1, drain=4)
    done = run(clock, budget, target)
    for _ in range(200):
        if done.called:
            break
        clock.advance(1)
    assert done.called and clock.seconds() <= budget.total
    target.inflight.end(stuck, "client-gone")    # its handler ends at last: none left
    assert not target.inflight.active


def test_drain_progress_is_told_as_requests_end() -> None:
    """While draining, the target hears how many requests are left and the time
    left: when the drain starts and as each request ends, never from a timer."""
    clock = Clock()
    target = FakeTarget(clock)
    first, second = target.request(), target.request()
    run(clock, StopBudget(prestop=0, drain=10), target)
    assert target.progress == [(2, 10.0)]
    clock.advance(3)
    assert target.progress == [(2, 10.0)]
    target.inflight.end(first, "completed")
    assert target.progress == [(2, 10.0), (1, 7.0)]
    target.inflight.end(second, "completed")
    assert target.progress == [(2, 10.0), (1, 7.0), (0, 7.0)]
    other = target.inflight.begin("GET", "/status", "c")   # after the drain: not told
    target.inflight.end(other, "completed")
    assert len(target.progress) == 3


def test_within_passes_the_result_on_and_never_cancels() -> None:
    """`within` observes a Deferred without changing its result or cancelling it."""
    clock = Clock()
    d: Deferred[str] = Deferred()
    timed = within(clock, d, 1)
    clock.advance(1)
    assert timed.result is False
    d.callback("value")
    assert d.result == "value"


def test_successor_waits_for_its_draining_predecessor_within_the_budget() -> None:
    """After an upgrade, the new main process's stop waits for its predecessor
    to exit (its streams would die with us under KillMode=mixed), but never
    past the budget."""
    clock = Clock()
    target = FakeTarget(clock)
    gone: Deferred[None] = Deferred()
    target.predecessor = (4242, gone)
    with capturedLogs() as events:
        done = run(clock, StopBudget(prestop=0, drain=10), target)
        clock.advance(30)
        assert not done.called and target.steps[-1][0] == "engines"
        gone.callback(None)
    assert done.called and target.steps[-1] == ("services", 30.0)
    assert any("for predecessor pid 4242" in formatEvent(e) for e in events)

    clock = Clock()
    target = FakeTarget(clock)
    target.predecessor = (4242, Deferred())
    budget = StopBudget(prestop=0, drain=10)
    done = run(clock, budget, target)
    clock.advance(budget.total)
    assert done.called
