"""The root service's side of the stop, in memory: signals, readiness,
admission (idle keep-alive connections closed, `Connection: close` on every
response from then on), cut requests and the exit status."""

from __future__ import annotations

import json
import signal
from typing import Any

from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.components import Process
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.lifecycle.signals import EXIT_CLEAN, EXIT_CUT
from llmproxy.testing.fakes import Connection, FakeHTTPClient, FakeResponse


class FakeReactor(Clock):
    """A Clock that also records what the service asks of the reactor."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped = 0

    def stop(self) -> None:
        self.stopped += 1

    def callWhenRunning(self, f: Any, *args: Any) -> None:
        pass


class FakeDeadline:
    def __init__(self) -> None:
        self.armed: list[float] = []
        self.disarmed = False

    def arm(self, seconds: float) -> None:
        self.armed.append(seconds)

    def disarm(self) -> None:
        self.disarmed = True


def make(**config: Any) -> tuple[LLMProxyService, FakeHTTPClient, FakeReactor, list[int],
                                 FakeDeadline]:
    reactor = FakeReactor()
    http = FakeHTTPClient()
    exits: list[int] = []
    deadline = FakeDeadline()
    process = Process(exit=exits.append, hard_deadline=deadline)  # type: ignore[arg-type]
    svc = build_service(ServiceInputs(
        parse_config({"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}],
                      "drain_seconds": 10, **config}),
        reactor, http=http, process=process))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("m"),))
    svc._ready = True
    return svc, http, reactor, exits, deadline


def body(stream: bool = True) -> bytes:
    return json.dumps({"model": "m", "stream": stream}).encode()


def test_first_signal_starts_the_stop_and_a_second_exits_at_once() -> None:
    """SIGTERM stops the reactor (which runs the chain) and arms the hard
    deadline at the budget plus a margin; a second SIGTERM exits with 143."""
    svc, _, reactor, exits, deadline = make()
    reactor.advance(50)
    svc.signal_received(signal.SIGTERM)
    assert reactor.stopped == 1 and svc.stop_t0 == 50
    assert deadline.armed == [10 + 2 + 60 + 5]
    assert exits == []
    with capturedLogs() as events:
        svc.signal_received(signal.SIGTERM)
    assert exits == [143]
    assert reactor.stopped == 1
    assert any("exiting now with status 143" in formatEvent(e) for e in events)


def test_second_sigint_exits_130() -> None:
    """Ctrl-C twice: the second exits with 130."""
    svc, _, _, exits, _ = make()
    svc.signal_received(signal.SIGINT)
    svc.signal_received(signal.SIGINT)
    assert exits == [130]


def test_admission_closes_idle_keepalive_and_busy_responses_say_close() -> None:
    """At stop admission an idle keep-alive connection is closed, /readyz says
    503, and a response that starts afterwards carries `Connection: close` and
    closes its connection when done."""
    svc, http, _, _, _ = make()
    idle = Connection(svc.site)
    idle.send("GET", "/healthz")
    assert idle.response().status == 200 and not idle.closed
    busy = Connection(svc.site)
    busy.send("POST", "/v1/chat/completions", body(stream=False))
    svc.stop_readiness()
    svc.stop_admission()
    assert idle.closed and not busy.closed
    upstream = FakeResponse(200, {"Content-Type": "application/json", "Content-Length": "2"})
    http.calls[0].deferred.callback(upstream)
    upstream.send(b"{}")
    upstream.finish()
    resp = busy.response()
    assert resp.headers["connection"] == "close" and resp.body == b"{}"
    assert busy.closed
    probe = Connection(svc.site)
    probe.send("GET", "/readyz")
    assert probe.response().status == 503
    assert probe.response().headers["connection"] == "close"


def test_stream_started_before_the_stop_finishes_then_its_connection_closes() -> None:
    """A stream whose headers went out before the stop completes in full, and
    its keep-alive connection is closed afterwards instead of reused."""
    svc, http, _, _, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", body())
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[0].deferred.callback(upstream)
    upstream.send(b"data: 1\n\n")
    svc.stop_admission()
    upstream.send(b"data: [DONE]\n\n")
    upstream.finish()
    resp = conn.response()
    assert resp.complete and resp.body == b"data: 1\n\ndata: [DONE]\n\n"
    assert conn.closed


def test_clean_stop_exits_0_and_cut_stop_exits_3() -> None:
    """The exit status says whether the stop had to cut requests."""
    svc, _, reactor, _, deadline = make()
    d = svc.stopService()
    assert d.called and svc.exit_status == EXIT_CLEAN and deadline.disarmed

    svc, http, reactor, _, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", body())
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[0].deferred.callback(upstream)
    upstream.send(b"data: 1\n\n")
    with capturedLogs() as events:
        d = svc.stopService()
        reactor.advance(10)                       # drain deadline
        assert conn.transport.disconnecting       # aborted, never finished
        conn.disconnect()                         # the kernel's connectionLost
        reactor.advance(2)
    assert d.called and svc.exit_status == EXIT_CUT
    assert not conn.response().complete
    text = [formatEvent(e) for e in events]
    assert any("outcome=cut" in t and "model=m host=gpu1" in t for t in text)
    assert upstream.transport.stopped


def test_connection_accepted_just_before_the_stop_still_gets_served() -> None:
    """A connection accepted right before admission stopped, whose request has
    not arrived yet, is not closed as idle: its request, arriving during the
    drain, is served (with Connection: close) and the drain waits for it."""
    svc, http, reactor, _, _ = make()
    early = Connection(svc.site)               # connected, nothing sent yet
    svc.stop_admission()
    assert not early.closed
    drained = svc.drained()
    early.send("POST", "/v1/chat/completions", body(stream=False))
    assert not drained.called                  # its request is in flight now
    upstream = FakeResponse(200, {"Content-Type": "application/json", "Content-Length": "2"})
    http.calls[0].deferred.callback(upstream)
    upstream.send(b"{}")
    upstream.finish()
    resp = early.response()
    assert resp.status == 200 and resp.headers["connection"] == "close"
    assert early.closed
    reactor.advance(0.05)                      # the drain looks again
    assert drained.called


def test_connection_that_never_sends_is_closed_after_the_grace() -> None:
    """A connection that sends nothing holds the drain for the first-request
    grace at most, then is closed."""
    from llmproxy.lifecycle.service import FIRST_REQUEST_GRACE

    svc, _, reactor, _, _ = make()
    silent = Connection(svc.site)
    svc.stop_admission()
    drained = svc.drained()
    reactor.advance(FIRST_REQUEST_GRACE - 0.1)
    assert not drained.called and not silent.closed
    reactor.advance(0.2)
    assert drained.called and silent.closed


def test_the_drain_ends_in_the_turn_the_last_request_ends() -> None:
    """With one stream in flight the stop waits; when the stream's last byte is
    relayed, the drain ends in that same reactor turn (no clock advance) and its
    connection is closed; the stop then ends as that connection is gone (its last
    bytes flushed), and no timer is left behind."""
    svc, http, reactor, _, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", body())
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[0].deferred.callback(upstream)
    upstream.send(b"data: 1\n\n")
    with capturedLogs() as events:
        d = svc.stopService()
        reactor.advance(3)
        assert not d.called
        upstream.send(b"data: [DONE]\n\n")
        upstream.finish()
        assert "drained, exiting" in [formatEvent(e) for e in events]
    assert conn.response().complete and conn.transport.disconnecting
    assert not d.called
    conn.disconnect()                        # the kernel's connectionLost
    assert d.called and svc.exit_status == EXIT_CLEAN and reactor.seconds() == 3
    assert reactor.getDelayedCalls() == []


def test_a_raising_subscriber_breaks_neither_a_request_nor_the_stop() -> None:
    """A view that raises on every event is logged each time and kept (core/hub.py): the
    request it saw start is still answered in full with its access line, and the stop
    still drains and exits cleanly."""
    svc, http, _, _, _ = make()

    def broken(event: object) -> None:
        raise RuntimeError("a broken view")

    svc.parts.hub.subscribe(broken)
    with capturedLogs() as events:
        conn = Connection(svc.site)
        conn.send("POST", "/v1/chat/completions", body(stream=False))
        upstream = FakeResponse(200, {"Content-Type": "application/json"})
        http.calls[0].deferred.callback(upstream)
        upstream.send(b'{"ok": true}')
        upstream.finish()
        d = svc.stopService()
        conn.disconnect()                    # the closed connection is gone
    resp = conn.response()
    assert resp.complete and resp.status == 200 and resp.body == b'{"ok": true}'
    assert d.called and svc.exit_status == EXIT_CLEAN
    text = [formatEvent(e) for e in events]
    assert any("outcome=completed" in t for t in text) and "drained, exiting" in text
    # kept: every later event reached it too, and each failure was logged
    assert sum(1 for e in events if e.get("log_failure") is not None) >= 3


def test_a_first_signal_while_draining_after_an_upgrade_is_a_first_signal() -> None:
    """A process draining because of an upgrade (no signal yet) takes its first
    SIGINT as a first signal: it drains on; only a second one exits (130)."""
    svc, _, reactor, exits, _ = make()
    svc._begin_stop()                    # what the hand-over does
    assert reactor.stopped == 1
    with capturedLogs() as events:
        svc.signal_received(signal.SIGINT)
    assert exits == [] and reactor.stopped == 1
    assert "received SIGINT: stopping gracefully" in [formatEvent(e) for e in events]
    svc.signal_received(signal.SIGINT)
    assert exits == [130]


def test_a_reload_during_start_up_waits_until_the_proxy_serves() -> None:
    """SIGHUP before the proxy serves: nothing reloads and nothing is told to
    systemd yet; the one reload runs once the proxy is ready."""
    svc, _, _, _, _ = make()
    svc._ready = False
    pending = svc.reload()
    again = svc.reload()
    assert pending is again and pending is not None and not pending.called
    assert svc.reloader.last is None and not svc.reloader.busy

