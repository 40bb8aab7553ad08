"""How long the proxy waits for a client, on task.Clock through the real Site and
HTTPChannel: the header timeout counts from the connection (a byte now and then
does not extend it), the idle timeout between keep-alive requests, the body
timeout between body reads, and the write stall: a client that reads nothing
while its response waits is aborted, its request logged client-stalled, its
upstream closed and its engine lease released."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from llmproxy.speedups import REFERENCE, Selection
from llmproxy.testing.fakes import Connection, FakeResponse
from llmproxy.web.timers import ChannelTimers, ClientTimeouts
from tests import test_proxy_engines as engines
from tests.test_proxy import CONFIG, access_lines, chat, make, sse

TIMEOUTS = {"client_header_timeout_seconds": 10, "client_idle_timeout_seconds": 120,
            "client_body_timeout_seconds": 30, "client_write_stall_seconds": 60}


# Each test on the reference path and with the speedups (conftest.py's `on_both_paths`).
pytestmark = pytest.mark.usefixtures("on_both_paths")


def proxy(speedups: Selection | None = None) -> tuple[Any, Any, Any]:
    return make({**CONFIG, **TIMEOUTS}, speedups)


def test_twisteds_own_inactivity_timer_is_off() -> None:
    """HTTPChannel's timeOut restarts on every byte; ours replace it."""
    svc, _, _ = proxy()
    assert svc.site.timeOut is None
    assert Connection(svc.site).channel.timeOut is None


def test_header_timeout_counts_from_the_connection() -> None:
    """A client sending one header byte a second is answered 408 (JSON) and
    closed 10 s after it connected, not 10 s after its last byte."""
    svc, http, clock = proxy()
    conn = Connection(svc.site)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    for byte in head[:9]:
        conn.channel.dataReceived(bytes([byte]))
        clock.advance(1)
    assert not conn.closed
    clock.advance(0.5)
    assert not conn.closed
    clock.advance(0.5)
    resp = conn.response()
    assert resp.status == 408 and resp.json()["error"]["code"] == "request_timeout"
    assert "client_header_timeout_seconds" in resp.json()["error"]["message"]
    assert conn.closed and not http.calls


def test_a_silent_connection_is_closed_without_an_answer() -> None:
    """Nothing at all within the header timeout: closed, nothing written."""
    svc, _, clock = proxy()
    conn = Connection(svc.site)
    clock.advance(10)
    assert conn.closed and conn.transport.value() == b""


def test_header_timeout_ends_with_the_headers() -> None:
    """Once the headers are in, the request may take as long as its answer takes."""
    svc, http, clock = proxy()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat())
    clock.advance(25)                       # the upstream header timeout is 30 s
    assert not conn.closed and len(http.calls) == 1


def test_idle_keep_alive_connection_is_closed_after_the_idle_timeout() -> None:
    """Between keep-alive requests the idle timeout runs (silently closed at 120 s);
    the first byte of a next request switches to the header timeout."""
    svc, _, clock = proxy()
    conn = Connection(svc.site)
    conn.send("GET", "/healthz")
    assert conn.response().status == 200
    clock.advance(119)
    assert not conn.closed
    conn.channel.dataReceived(b"GET /hea")          # the next request begins
    clock.advance(9.9)
    assert not conn.closed
    clock.advance(0.1)
    assert conn.closed and conn.transport.value().count(b"HTTP/1.1 408") == 1

    other = Connection(svc.site)
    other.send("GET", "/healthz")
    written = other.transport.value()
    clock.advance(120)
    assert other.closed and other.transport.value() == written


def test_after_a_request_with_a_body_the_idle_timeout_runs() -> None:
    """A keep-alive connection that sent a POST with a body is idle once answered:
    closed silently at the idle timeout, not answered 408 at the header timeout."""
    svc, http, clock = proxy()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat(stream=False))
    upstream = FakeResponse(200, {"Content-Type": "application/json", "Content-Length": "2"})
    http.calls[0].deferred.callback(upstream)
    upstream.send(b"{}")
    upstream.finish()
    written = conn.transport.value()
    clock.advance(119.9)
    assert not conn.closed
    clock.advance(0.1)
    assert conn.closed and conn.transport.value() == written


def test_a_pipelined_request_gets_the_header_timeout() -> None:
    """Bytes of the next request that arrived while the first was answered start
    its header timeout as soon as the first is done."""
    svc, http, clock = proxy()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat(stream=False))
    conn.channel.dataReceived(b"GET /hea")
    upstream = FakeResponse(200, {"Content-Type": "application/json", "Content-Length": "2"})
    http.calls[0].deferred.callback(upstream)
    upstream.send(b"{}")
    upstream.finish()
    clock.advance(10)
    assert conn.closed and conn.transport.value().count(b"HTTP/1.1 408 ") == 1


def test_body_timeout_runs_between_reads() -> None:
    """Each piece of the body restarts the body timeout; 30 s without one is a
    408 and the connection closes; nothing went upstream."""
    svc, http, clock = proxy()
    conn = Connection(svc.site)
    conn.channel.dataReceived(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              b"Content-Length: 100\r\n\r\n")
    for _ in range(5):
        clock.advance(29)
        conn.channel.dataReceived(b"x")
    assert not conn.closed                   # 145 s in, past the header timeout too
    clock.advance(30)
    resp = conn.response()
    assert resp.status == 408 and "client_body_timeout_seconds" in resp.json()["error"]["message"]
    assert conn.closed and not http.calls


def stream(svc: Any, http: Any, model: str = "coder") -> tuple[Connection, FakeResponse]:
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat(model))
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[-1].deferred.callback(upstream)
    upstream.send(sse(1))
    return conn, upstream


def test_a_client_that_reads_nothing_is_aborted_at_the_write_stall_bound() -> None:
    """The transport pauses the response (its buffer is full) and nothing drains
    for 60 s: the connection is aborted (never ended cleanly), the upstream
    closed, and the access line says client-stalled."""
    svc, http, clock = proxy()
    conn, upstream = stream(svc, http)
    with capturedLogs() as events:
        conn.channel.pauseProducing()         # what the transport does when full
        assert upstream.transport.paused
        clock.advance(59.9)
        assert not conn.transport.disconnecting
        clock.advance(0.1)
        assert conn.transport.disconnected    # aborted
        conn.disconnect()                     # the transport reports the abort
    assert upstream.transport.stopped
    [line] = access_lines(events)
    assert "outcome=client-stalled" in line and "client_write_stall_seconds" in line
    assert not svc.inflight.active


def test_a_client_that_reads_again_is_not_aborted() -> None:
    """Paused, then resumed before the bound: the stall timer starts over."""
    svc, http, clock = proxy()
    conn, upstream = stream(svc, http)
    for _ in range(3):
        conn.channel.pauseProducing()
        clock.advance(50)
        conn.channel.resumeProducing()
    clock.advance(100)
    assert not conn.transport.disconnecting
    upstream.finish()
    assert conn.response().complete


def test_a_slow_reader_that_makes_progress_is_not_aborted() -> None:
    """Still paused at the bound, but the transport's buffer shrank since: the
    client reads, slowly; it is measured again from there. (The transport's
    buffer is measured by the response_writes speedup: Twisted has no public
    measure of it, see the next test.)"""
    svc, http, clock = proxy(Selection(True, ("response_writes",)))
    conn, _ = stream(svc, http)
    transport: Any = conn.transport
    transport.dataBuffer, transport.offset, transport._tempDataLen = b"x" * 100_000, 0, 0
    conn.channel.pauseProducing()
    clock.advance(30)
    transport.offset = 10_000                 # 10 kB went out meanwhile
    clock.advance(30)
    assert not transport.disconnecting
    clock.advance(59.9)                       # nothing more went out
    assert not transport.disconnecting
    clock.advance(0.1)
    assert transport.disconnected


def test_on_the_reference_path_the_stall_is_a_pause_that_lasts_the_bound() -> None:
    """Without the speedup the channel hears of its transport's buffer only
    through pauseProducing and resumeProducing (which Twisted's transport
    calls once its buffer has drained): a response still paused at the bound
    is a stalled one, however much of the buffer went out meanwhile; one
    resumed before it, however slow the reader, is not."""
    svc, http, clock = proxy(REFERENCE)
    conn, _ = stream(svc, http)
    transport: Any = conn.transport
    assert conn.channel.unsent() is None
    conn.channel.pauseProducing()
    clock.advance(50)
    conn.channel.resumeProducing()            # the client took all that waited
    conn.channel.pauseProducing()
    clock.advance(59)
    assert not transport.disconnecting        # 109 s paused in all, in two pauses
    clock.advance(1)
    assert transport.disconnected


def test_a_stalled_client_releases_its_engine_lease() -> None:
    """On a managed host, a stalled reader's lease is released at the stall
    bound, so the engine can serve (or switch for) the next request."""
    svc, http, _, clock = engines.make()
    manager = svc.fleet.managers["gpu1"]
    conn, _ = stream(svc, http, "qwen")
    assert manager.in_flight() == 1
    conn.channel.pauseProducing()
    clock.advance(60)
    conn.disconnect()
    assert manager.in_flight() == 0 and not svc.inflight.active


@pytest.mark.parametrize("kind, attribute", [
    ("header", "header"), ("idle", "idle"), ("body", "body"), ("write stall", "write_stall")])
def test_timeouts_come_from_the_config(kind: str, attribute: str) -> None:
    """Each timer uses its config key."""
    svc, _, _ = make({**CONFIG, "client_header_timeout_seconds": 1,
                      "client_idle_timeout_seconds": 2, "client_body_timeout_seconds": 3,
                      "client_write_stall_seconds": 4})
    timeouts = svc.site.timeouts
    assert timeouts == ClientTimeouts(header=1, idle=2, body=3, write_stall=4)
    assert timeouts.seconds(kind) == getattr(timeouts, attribute)


def test_timers_stop_with_the_connection() -> None:
    """A connection that goes leaves no timer behind."""
    svc, _, clock = proxy()
    conn = Connection(svc.site)
    conn.channel.pauseProducing()
    conn.disconnect()
    assert clock.getDelayedCalls() == [] or all(
        not isinstance(getattr(c.func, "__self__", None), ChannelTimers)
        for c in clock.getDelayedCalls())


class _Channel:
    """What the timers call back: a channel's methods (it keeps its timers)."""

    timers: ChannelTimers

    def expired(self, kind: str) -> None:
        raise AssertionError(f"{kind} expired")

    def unsent(self) -> int:
        return 0


def test_stopped_timers_let_go_of_their_channel() -> None:
    """A channel keeps its timers and they kept its methods: once stopped (the
    connection is gone), they hold nothing of it, so the channel goes with its
    last reference, not at the next garbage collection; a timer armed after
    that (a late requestDone) runs out harmlessly."""
    clock = Clock()
    channel = _Channel()
    channel.timers = timers = ChannelTimers(clock.callLater, ClientTimeouts(), channel.expired,
                                            channel.unsent, clock.seconds)
    timers.awaiting_headers()
    gc.collect()
    gc.disable()
    try:
        timers.stop()
        gone = weakref.ref(channel)
        del channel
        assert gone() is None
    finally:
        gc.enable()
    timers.between_requests(next_started=False)
    clock.advance(3600)
    assert not clock.getDelayedCalls()


def _timer_calls(conn: Connection) -> list[str]:
    """The calls the channel makes on its timers from now on, by name."""
    calls: list[str] = []
    timers = conn.channel.timers

    def spying(name: str) -> Any:
        real = getattr(timers, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)
        return spy

    for name in ("data", "headers_done", "answering"):
        setattr(timers, name, spying(name))
    return calls


def test_a_request_moves_the_timers_phase_by_phase() -> None:
    """A request, whether its head and body come in one read or its head is
    split over reads, takes its connection's timers phase by phase to
    answering; it is then answered and the connection waits, idle, for the
    next."""
    svc, http, _ = proxy(REFERENCE)
    for split in (False, True):
        conn = Connection(svc.site)
        calls = _timer_calls(conn)
        body = chat()
        data = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        for piece in ((data[:20], data[20:]) if split else (data,)):
            conn.channel.dataReceived(piece)
        timers = conn.channel.timers
        assert calls == (["data", "data", "headers_done", "answering"] if split
                         else ["data", "headers_done", "answering"])
        assert (timers.phase, timers.heard, timers._deadline) == ("answering", True, None)
        upstream = FakeResponse(200, {"Content-Type": "application/json"})
        http.calls[-1].deferred.callback(upstream)
        upstream.send(b"{}")
        upstream.finish()
        assert conn.response().status == 200 and timers.phase == "idle"
