"""llmproxy.compat.h2limits: Twisted's HTTP/2 connection bounded against one
client, driven by a real h2 client (and raw frames) over a memory transport
on a task.Clock: nothing read after a protocol error, no spin on a shut
window and a stall bound on a finished answer, INTERNAL_ERROR for a stream
the proxy cuts, the HTTP/1.1 header limits, no traceback from PRIORITY
floods or frames for an answered stream; its guard (HTTP/2 not offered when
it fails); and the TLS negotiation that drops bytes once its protocol closed."""

from __future__ import annotations

import json
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import (
    ContinuationFrame,
    HeadersFrame,
    PriorityFrame,
    RstStreamFrame,
)
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

import twisted
from llmproxy import compat
from llmproxy.compat import h2limits
from llmproxy.compat.goaway import GracefulH2Connection, TrackedH2Connection
from llmproxy.compat.h2limits import (
    CLOSE_SECONDS,
    BoundedGracefulH2Connection,
    BoundedH2Connection,
)
from llmproxy.core.events import Http2Closed
from llmproxy.lifecycle.negotiation import NegotiatedConnection, NegotiatingFactory
from llmproxy.lifecycle.tlslistener import alpn
from llmproxy.web.site import ProxySite
from llmproxy.web.timers import ClientTimeouts
from tests.h2client import Client

STALL = 7.0


class Pages(Resource):
    """/slow is held open until the test ends it; anything else answers at once."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Request] = []

    def render(self, request: Request) -> bytes | int:
        if request.path == b"/slow":
            self.held.append(request)
            request.write(b"part")
            return NOT_DONE_YET
        return b"page " + request.path * 100


def serve(cls: type = BoundedH2Connection, window: int = 65535,
          ) -> tuple[Any, Client, Pages, list[Any], Clock]:
    clock, root, events = Clock(), Pages(), []
    site = ProxySite(root, 1 << 20, reactor=clock, timeouts=ClientTimeouts(write_stall=STALL))
    connection = cls(clock, site, events.append)
    return connection, Client(connection, clock, window=window), root, events, clock


def test_the_guard_passes_on_the_twisted_it_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the pinned Twisted the entry is on; another version, or a changed
    method, turns it off and says HTTP/2 is not offered."""
    assert compat.select().on("h2_limits") and h2limits.guard() is None
    assert h2limits.connection_class(True) is BoundedGracefulH2Connection
    assert h2limits.connection_class(False) is BoundedH2Connection
    assert issubclass(BoundedGracefulH2Connection, GracefulH2Connection)
    monkeypatch.setattr(twisted, "__version__", "27.1.0")
    assert compat.select().off["h2_limits"].endswith("HTTP/2 is not offered")
    monkeypatch.setattr(twisted, "__version__", "26.10.0")
    name = "twisted.web._http2.H2Connection._sendPrioritisedData"
    monkeypatch.setitem(h2limits.SOURCES, name, "0" * 16)
    assert f"{name} changed" in compat.select().off["h2_limits"]


def test_without_the_entry_alpn_offers_http11_alone() -> None:
    """h2 is offered only where it is served."""
    assert alpn() == [b"h2", b"http/1.1"] and alpn(False) == [b"http/1.1"]


def continuation_flood(stream: int = 1, frames: int = 65) -> bytes:
    """A HEADERS frame without END_HEADERS and `frames` CONTINUATIONs: h2 refuses it."""
    out = HeadersFrame(stream, data=b"\x82", flags=["END_STREAM"]).serialize()
    return out + b"".join(ContinuationFrame(stream, data=b"\x84").serialize()
                          for _ in range(frames))


@pytest.mark.parametrize("cls", [BoundedH2Connection, BoundedGracefulH2Connection])
def test_after_a_protocol_error_nothing_more_is_read(cls: type, monkeypatch: Any) -> None:
    """65 CONTINUATION frames: the connection ends (GOAWAY, one Http2Closed
    event), every byte after is dropped before h2 sees it (where Twisted
    went on feeding h2's buffer), and the transport is aborted CLOSE_SECONDS
    later if the close has not finished."""
    server, client, _, events, clock = serve(cls)
    client.send_raw(continuation_flood())
    assert client.goaway_codes() == [ErrorCodes.PROTOCOL_ERROR]
    assert client.transport.disconnecting and not client.transport.disconnected
    seen: list[bytes] = []
    monkeypatch.setattr(server.conn, "receive_data", lambda data: seen.append(data) or [])
    for _ in range(100):
        server.dataReceived(b"\x00" * 16384)
    assert seen == []
    clock.advance(CLOSE_SECONDS)
    assert client.transport.disconnected
    assert [type(e) for e in events] == [Http2Closed]
    level, text = events[0].line()
    assert level == "warn" and "connection closed: ProtocolError" in text


def test_twisteds_own_connection_reads_on_after_the_error(monkeypatch: Any) -> None:
    """What the entry fixes: Twisted's connection hands h2 every later byte."""
    server, client, _, _, _ = serve(TrackedH2Connection)
    client.send_raw(continuation_flood())
    seen: list[bytes] = []
    monkeypatch.setattr(server.conn, "receive_data", lambda data: seen.append(data) or [])
    server.dataReceived(b"\x00" * 10)
    assert seen == [b"\x00" * 10]


def test_a_closed_connection_cancels_its_abort() -> None:
    """A close that finishes in time leaves no timer behind."""
    server, client, _, _, clock = serve()
    client.send_raw(continuation_flood())
    server.connectionLost(None)
    assert clock.getDelayedCalls() == []


def spins(server: Any, clock: Clock, monkeypatch: Any, turns: int = 200) -> int:
    """How often the sending loop runs over `turns` turns of the reactor (a
    loop that reschedules itself at once fails the test instead of hanging
    task.Clock, which runs a call made for now in the same advance)."""
    calls = []
    original = type(server)._sendPrioritisedData

    def counted(self: Any, *args: Any) -> None:
        calls.append(1)
        assert len(calls) <= turns, "the sending loop spins"
        original(self, *args)

    monkeypatch.setattr(type(server), "_sendPrioritisedData", counted)
    for _ in range(turns):
        clock.advance(0)
    return len(calls)


def test_a_shut_window_does_not_spin_the_loop(monkeypatch: Any) -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE 0 and a finished answer: the loop blocks
    the stream and waits (Twisted's ran again on every turn of the reactor)."""
    server, client, _, _, clock = serve(window=0)
    stream = client.request("/page")
    assert client.status[stream] == 200 and stream not in client.data
    assert spins(server, clock, monkeypatch) == 0


def test_a_window_opened_later_sends_the_answer() -> None:
    """The blocked stream goes on when the client opens its window, by a
    WINDOW_UPDATE or by SETTINGS, and ends whole; its stall timer is gone."""
    _, client, _, events, clock = serve(window=0)
    stream = client.request("/page")
    client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    client.pump()
    assert len(client.data[stream]) == 100 and stream not in client.ended
    client.h2.increment_flow_control_window(65535, stream)
    client.pump()
    assert client.data[stream] == b"page " + b"/page" * 100 and stream in client.ended
    clock.advance(STALL)
    client.pump()
    assert client.resets() == [] and events == []


def test_a_finished_answer_never_read_is_reset_after_the_stall_bound() -> None:
    """The write-stall bound holds for an answer whose body is done but
    unsent: at client_write_stall_seconds its stream is reset (INTERNAL_ERROR),
    one event says so, and the connection holds no stream."""
    server, client, _, events, clock = serve(window=0)
    stream = client.request("/page")
    clock.advance(STALL - 0.1)
    client.pump()
    assert client.resets() == []
    clock.advance(0.1)
    client.pump()
    assert client.resets() == [(stream, ErrorCodes.INTERNAL_ERROR)]
    assert server.streams == {}
    assert [(e.stream, e.reason) for e in events] == [
        (stream, f"its client read nothing of it for {STALL:g}s")]


def test_a_stream_still_producing_is_left_to_its_producer() -> None:
    """A stream with a producer of its own (a relayed body: its StallGuard
    rules) is not reset by the connection while its request is unfinished."""
    server, client, root, _, clock = serve(window=0)
    stream = client.request("/slow")
    request = root.held[0]

    class Producer:
        def pauseProducing(self) -> None: ...
        def resumeProducing(self) -> None: ...
        def stopProducing(self) -> None: ...

    request.registerProducer(Producer(), True)
    clock.advance(STALL * 3)
    client.pump()
    assert client.resets() == [] and stream in server.streams
    request.unregisterProducer()
    request.finish()
    clock.advance(STALL)
    client.pump()
    assert client.resets() == [(stream, ErrorCodes.INTERNAL_ERROR)]


@pytest.mark.parametrize("cls", [BoundedH2Connection, TrackedH2Connection])
def test_a_stream_the_proxy_cuts_is_reset_with_internal_error(cls: type) -> None:
    """abortConnection on a stream (how web/cutoff cuts an answer whose
    engine died): RST_STREAM INTERNAL_ERROR, where Twisted said NO_ERROR."""
    _, client, root, _, _ = serve(cls)
    stream = client.request("/slow")
    assert client.data[stream] == b"part"
    root.held[0].channel.abortConnection()
    client.pump()
    code = ErrorCodes.INTERNAL_ERROR if cls is BoundedH2Connection else ErrorCodes.NO_ERROR
    assert client.resets() == [(stream, code)]


@pytest.mark.parametrize("count,size,refused", [
    (499, 10, False), (500, 1, True), (10, 2000, True), (5, 2000, False)])
def test_http2_headers_are_held_to_the_http11_limits(count: int, size: int,
                                                     refused: bool) -> None:
    """More than 500 headers (the Host header, `:authority`, is one), or
    more than 16384 bytes of them (as an HTTP/1.1 head counts them): a 431
    with the proxy's JSON error, the request never made; within them,
    answered as usual."""
    _, client, _, _, _ = serve()
    headers = [(f"x-h{i}", "v" * size) for i in range(count)]
    stream = client.request("/page", headers)
    if refused:
        assert client.status[stream] == 431 and stream in client.ended
        error = json.loads(client.data[stream])["error"]
        assert error["code"] == "request_header_fields_too_large"
    else:
        assert client.status[stream] == 200


def test_a_refused_upload_is_told_to_stop() -> None:
    """A refused request whose body was to follow: its 431, then RST_STREAM
    NO_ERROR (RFC 9113 8.1: the answer is complete, stop sending)."""
    _, client, _, _, _ = serve()
    stream = client.request("/page", [(f"x-h{i}", "v") for i in range(501)], end=False,
                            method="POST")
    assert client.status[stream] == 431
    assert client.resets() == [(stream, ErrorCodes.NO_ERROR)]


def test_priority_for_too_many_streams_closes_the_connection() -> None:
    """PRIORITY frames for 1,001 idle streams (Twisted's priority tree
    raised): GOAWAY ENHANCE_YOUR_CALM, one event, nothing read after."""
    server, client, _, events, _ = serve()
    client.send_raw(b"".join(PriorityFrame(2 * i + 1, depends_on=0, stream_weight=15).serialize()
                         for i in range(1001)))
    assert client.goaway_codes() == [ErrorCodes.ENHANCE_YOUR_CALM]
    assert server.dropping and [type(e) for e in events] == [Http2Closed]
    assert "TooManyStreamsError" in events[0].reason


def test_frames_for_an_answered_stream_are_ignored() -> None:
    """A stream answered before its body ended (an early refusal): its later
    DATA is dropped with its window given back, its END_STREAM and its
    RST_STREAM ignored; no traceback, the connection serves on."""
    server, client, _, _, _ = serve()
    requests: list[Request] = []
    factory = server.requestFactory

    def recorded(*args: Any, **kwargs: Any) -> Request:
        requests.append(factory(*args, **kwargs))
        return requests[-1]

    server.requestFactory = recorded
    stream = client.request("/upload", end=False, method="POST")
    requests[0].setResponseCode(413)
    requests[0].write(b"too big")
    requests[0].finish()
    client.pump()
    assert client.status[stream] == 413 and stream not in server.streams
    for _ in range(4):
        client.h2.send_data(stream, b"x" * 16000)
    client.pump()
    assert client.h2.outbound_flow_control_window > 40000     # given back (else 1535)
    client.h2.end_stream(stream)
    client.pump()
    client.send_raw(RstStreamFrame(stream, error_code=ErrorCodes.CANCEL).serialize())
    later = client.request("/after")
    assert client.status[later] == 200 and not server.dropping


class Inner:
    """What a negotiated connection hands its bytes to."""

    def __init__(self) -> None:
        self.got: list[bytes] = []

    def makeConnection(self, transport: Any) -> None: ...

    def dataReceived(self, data: bytes) -> None:
        self.got.append(data)

    def connectionLost(self, reason: Any) -> None: ...


def test_negotiation_drops_bytes_once_its_protocol_asked_to_close() -> None:
    """Over TLS a close waits for the client's close_notify; what the client
    sends meanwhile never reaches the protocol that asked for the close."""
    inner = Inner()
    factory = NegotiatingFactory(None, lambda: inner, Clock(), 10.0)  # type: ignore[arg-type]
    connection = NegotiatedConnection(factory, None)
    transport = StringTransport()
    transport.negotiatedProtocol = b"h2"  # type: ignore[attr-defined]
    connection.makeConnection(transport)
    connection.handshakeCompleted()
    connection.dataReceived(b"one")
    transport.loseConnection()
    connection.dataReceived(b"two")
    assert inner.got == [b"one"]
