"""An engine that goes silent in the middle of an answer (web/enginesilence.py):
the watch alone on task.Clock, then the proxy in memory on both paths, its
client held by nothing but the timeout."""

from __future__ import annotations

import json

import pytest
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from llmproxy.config import ConfigError, parse_config
from llmproxy.testing.fakes import Connection, FakeResponse
from llmproxy.web.enginesilence import SilenceWatches
from tests.test_proxy import CONFIG, access_lines, chat, make, sse, streamed

T = 8.0
STEP = 0.25


def run(clock: Clock, seconds: float) -> None:
    """Time passing in steps (one `advance` of it all would run each due call
    at its end, and a call it schedules from there)."""
    clock.pump([STEP] * round(seconds / STEP))


def watching(clock: Clock) -> list[object]:
    """The watches' timed calls left on `clock` once the next sweep has run
    (one that finds no answer left does not come again)."""
    run(clock, T / 4)
    return [c for c in clock.getDelayedCalls()
            if isinstance(getattr(c.func, "__self__", None), SilenceWatches)]


class Watched:
    """What a watch looks at, set by the test."""

    def __init__(self, clock: Clock, watches: SilenceWatches | None = None) -> None:
        self.progress = 0
        self.paused = False
        self.fired: list[tuple[float, float]] = []      # (seconds, when)
        self.watches = SilenceWatches(clock, lambda: T) if watches is None else watches
        self.clock = clock

    def start(self) -> None:
        self.watch = self.watches.add(lambda: self.progress, lambda: self.paused,
                                      lambda s: self.fired.append((s, self.clock.seconds())))


def test_the_watch_fires_once_between_the_timeout_and_a_quarter_more() -> None:
    """Progress just before a check: silent from then for the timeout, it fires."""
    clock = Clock()
    w = Watched(clock)
    w.start()
    for _ in range(10):                 # progress before every check: never silent
        run(clock, T / 4 - 0.25)     # (binary fractions: exact clock sums)
        w.progress += 1
        run(clock, 0.25)
    last = clock.seconds() - 0.25
    run(clock, T - 0.5)
    assert w.fired == []
    run(clock, 0.5)
    assert w.fired == [(T, last + T + 0.25)]
    run(clock, 10 * T)
    assert len(w.fired) == 1 and not clock.getDelayedCalls()


def test_progress_just_after_a_check_is_silent_for_at_most_the_timeout_and_a_quarter() -> None:
    clock = Clock()
    w = Watched(clock)
    w.start()
    run(clock, T / 4 + 0.25)        # just after the first check
    w.progress += 1
    run(clock, T + T / 4 - 0.5)
    assert w.fired == []
    run(clock, 0.25)
    assert [s for s, _ in w.fired] == [T]


def test_time_the_client_holds_the_engine_back_never_counts() -> None:
    clock = Clock()
    w = Watched(clock)
    w.start()
    w.paused = True
    run(clock, 5 * T)
    assert w.fired == []
    w.paused = False            # the client drained: silence counts from here
    run(clock, T * 0.9)
    assert w.fired == []
    run(clock, T * 0.4)
    assert len(w.fired) == 1


def test_a_removed_watch_leaves_nothing_on_the_reactor() -> None:
    clock = Clock()
    w = Watched(clock)
    w.start()
    w.watches.remove(w.watch)
    run(clock, T / 4)                   # the sweep that finds none left stops
    assert not clock.getDelayedCalls()
    run(clock, 10 * T)
    assert w.fired == []


def test_every_answer_shares_one_timed_call_and_is_judged_alone() -> None:
    clock = Clock()
    watches = SilenceWatches(clock, lambda: T)
    answers = [Watched(clock, watches) for _ in range(100)]
    for w in answers:
        w.start()
    assert len(watches) == 100 and len(clock.getDelayedCalls()) == 1
    for _ in range(8):                  # all but the first keep sending
        for w in answers[1:]:
            w.progress += 1
        run(clock, T / 4)
    assert [len(w.fired) for w in answers] == [1] + [0] * 99
    assert len(watches) == 99 and len(clock.getDelayedCalls()) == 1


def test_an_answer_that_starts_just_before_a_sweep_gets_its_whole_timeout() -> None:
    clock = Clock()
    watches = SilenceWatches(clock, lambda: T)
    Watched(clock, watches).start()             # keeps the sweep going
    run(clock, T / 4 - STEP)
    w = Watched(clock, watches)
    w.start()                                   # one step before a sweep, then nothing
    run(clock, T - STEP)
    assert w.fired == []
    run(clock, STEP + T / 4)
    assert len(w.fired) == 1


def test_a_timeout_of_zero_watches_nothing() -> None:
    clock = Clock()
    watches = SilenceWatches(clock, lambda: 0.0)
    assert watches.add(lambda: 0, lambda: False, lambda s: None) is None
    assert not clock.getDelayedCalls() and len(watches) == 0


def test_the_timeout_is_a_positive_number_of_seconds() -> None:
    assert parse_config(CONFIG).engine_read_timeout_seconds == 300.0
    with pytest.raises(ConfigError, match="engine_read_timeout_seconds"):
        parse_config({**CONFIG, "engine_read_timeout_seconds": 0})


# The proxy in memory, on the reference path and with the speedups.
@pytest.mark.usefixtures("on_both_paths")
def test_a_silent_engine_ends_the_stream_with_an_error_event_and_is_cut_off() -> None:
    svc, http, clock = make({**CONFIG, "engine_read_timeout_seconds": T})
    conn = Connection(svc.site)
    with capturedLogs() as events:
        upstream = streamed(conn, http)
        upstream.send(sse(1))
        run(clock, T)
        assert not upstream.transport.stopped
        run(clock, T / 4)
    assert upstream.transport.stopped        # the engine connection is closed
    resp = conn.response()
    assert not resp.complete and conn.closed
    assert resp.body.startswith(sse(1))
    error = json.loads(resp.body[len(sse(1)):].decode().removeprefix("data: "))["error"]
    assert error == {"message": "the engine sent nothing for 8s (engine_read_timeout_seconds)",
                     "type": "upstream_error", "code": 504}
    [line] = access_lines(events)
    assert "outcome=upstream-failed" in line and "engine_read_timeout_seconds" in line
    assert not svc.inflight.active and not watching(clock)


@pytest.mark.usefixtures("on_both_paths")
def test_an_engine_that_keeps_sending_or_that_a_full_client_holds_back_is_never_cut() -> None:
    svc, http, clock = make({**CONFIG, "engine_read_timeout_seconds": T})
    conn = Connection(svc.site)
    upstream = streamed(conn, http)
    for i in range(20):                 # an event every half timeout
        upstream.send(sse(i))
        run(clock, T / 2)
    assert conn.transport.producer is not None
    conn.transport.producer.pauseProducing()     # the client's socket is full
    run(clock, 3 * T)
    assert not upstream.transport.stopped
    conn.transport.producer.resumeProducing()
    upstream.send(b"data: [DONE]\n\n")
    upstream.finish()
    resp = conn.response()
    assert resp.complete and resp.body.endswith(b"data: [DONE]\n\n")
    assert not watching(clock)


@pytest.mark.usefixtures("on_both_paths")
def test_a_silent_engine_in_a_whole_body_cuts_it_short() -> None:
    svc, http, clock = make({**CONFIG, "engine_read_timeout_seconds": T})
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.send("POST", "/v1/chat/completions", chat(stream=False))
        upstream = FakeResponse(200, {"Content-Type": "application/json",
                                      "Content-Length": "100"})
        http.calls[-1].deferred.callback(upstream)
        upstream.send(b'{"id": ')
        run(clock, T * 1.25)
    assert upstream.transport.stopped
    resp = conn.response()
    assert resp.body == b'{"id": ' and not resp.complete and conn.closed
    assert "outcome=upstream-failed" in access_lines(events)[0]
    assert not watching(clock)
