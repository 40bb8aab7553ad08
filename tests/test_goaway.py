"""llmproxy.compat.goaway: HTTP/2 connections (Twisted's) drained with a
two-phase GOAWAY, driven by a real h2 client over a memory transport on a
task.Clock; its guard, and the fallback (one GOAWAY, Twisted's own) when the
guard fails. Also: the speedups' request classes step aside on an HTTP/2
stream (the public path serves it)."""

from __future__ import annotations

from typing import Any

import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import RstStreamFrame
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

import twisted
from llmproxy import compat
from llmproxy.compat import goaway
from llmproxy.compat.goaway import MAX_STREAM_ID, GracefulH2Connection, TrackedH2Connection
from llmproxy.core.events import Http2Goaway
from llmproxy.speedups import Selection
from llmproxy.speedups.site import site_class
from llmproxy.web.site import ProxyRequest, ProxySite
from tests.h2client import Client


class Slow(Resource):
    """/slow is held open until the test finishes it; anything else answers at once."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Request] = []

    def render(self, request: Request) -> bytes | int:
        if request.path == b"/slow":
            self.held.append(request)
            return NOT_DONE_YET
        return b"fast " + request.path


def serve(cls: type, site_cls: type[ProxySite] = ProxySite) -> tuple[Any, Client, Slow,
                                                                        list[Any], Clock]:
    clock, root, events = Clock(), Slow(), []
    site = site_cls(root, 1 << 20, reactor=clock)
    connection = cls(clock, site, events.append)
    return site, Client(connection, clock), root, events, clock


def finish(request: Request, client: Client) -> None:
    request.write(b"slow done")
    request.finish()
    client.pump()


def test_the_guard_passes_on_the_twisted_it_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the pinned Twisted the entry is on; another version, or a changed
    method, turns it off with the reason (and the class is Twisted's own)."""
    assert compat.select().on("h2_goaway") and goaway.guard() is None
    assert goaway.connection_class(True) is GracefulH2Connection
    assert goaway.connection_class(False) is TrackedH2Connection
    monkeypatch.setattr(twisted, "__version__", "27.1.0")
    assert "Twisted 27.1.0 is not 26.10" in compat.select().off["h2_goaway"]
    monkeypatch.setattr(twisted, "__version__", "26.10.0")
    name = "twisted.web._http2.H2Connection._requestDone"
    monkeypatch.setitem(goaway.SOURCES, name, "0" * 16)
    assert f"{name} changed" in compat.select().off["h2_goaway"]


def test_two_goaways_around_a_ping_and_a_stream_opened_between_is_served() -> None:
    """The drain: GOAWAY 2^31-1 and a PING; a stream opened before the ack is
    served; the ack brings the GOAWAY with the real last stream id; a stream
    past it is refused; the in-flight stream ends whole, then the connection
    closes; each phase is an event."""
    site, client, root, events, _ = serve(GracefulH2Connection)
    slow = client.get(b"/slow")
    assert len(root.held) == 1 and site.multiplexed
    client.hold_pings = True
    site.start_closing()
    client.pump()
    assert client.goaways() == [(MAX_STREAM_ID, 0)]
    assert client.held                           # the PING came after the GOAWAY
    between = client.get(b"/between")
    assert client.data[between] == b"fast /between" and between in client.ended
    client.answer_pings()
    assert client.goaways() == [(MAX_STREAM_ID, 0), (between, 0)]
    late = client.get(b"/late")
    assert [(f.stream_id, f.error_code) for f in client.frames
            if isinstance(f, RstStreamFrame)] == [(late, ErrorCodes.REFUSED_STREAM)]
    assert not client.transport.disconnecting
    finish(root.held[0], client)
    assert client.data[slow] == b"slow done" and slow in client.ended
    assert client.transport.disconnecting
    assert [(e.stage, e.last_stream_id, e.streams) for e in events] == [
        ("first", MAX_STREAM_ID, 1), ("final", between, 1), ("closed", None, 0)]
    assert events[1].reason == "the PING's ack"
    assert all(isinstance(e, Http2Goaway) and e.line() for e in events)


def test_without_the_ack_the_final_goaway_comes_after_one_second() -> None:
    """A client that never answers the PING gets the final GOAWAY at 1 s; an
    idle connection then closes at once."""
    site, client, _, events, clock = serve(GracefulH2Connection)
    client.hold_pings = True
    site.start_closing()
    client.pump()
    clock.advance(0.9)
    client.pump()
    assert client.goaways() == [(MAX_STREAM_ID, 0)]
    clock.advance(0.1)
    client.pump()
    assert client.goaways() == [(MAX_STREAM_ID, 0), (0, 0)]
    assert client.transport.disconnecting
    assert events[1].reason == "1s without the PING's ack"


def test_a_connection_made_during_a_stop_drains_at_once() -> None:
    """A connection whose handshake ends after the stop began drains as it starts."""
    site, client, _, events, _ = serve(GracefulH2Connection)
    site.closing = True
    late = Client(GracefulH2Connection(client.clock, site, events.append), client.clock)
    assert late.goaways() == [(MAX_STREAM_ID, 0), (0, 0)] and late.transport.disconnecting
    assert client.goaways() == []


def test_the_fallback_sends_one_goaway_once_idle() -> None:
    """Guard off: the stop says nothing until no request is in flight, then
    one GOAWAY (Twisted's, with the last stream id) and the close; the site's
    drain waits for it; the event says why the two phases are off."""
    site, client, root, events, _ = serve(TrackedH2Connection)
    slow = client.get(b"/slow")
    site.start_closing()
    client.pump()
    assert client.goaways() == [] and not client.transport.disconnecting
    finish(root.held[0], client)
    assert slow in client.ended
    done: list[None] = []
    Deferred.fromCoroutine(site.drained(lambda: succeed(None), 0.0)).addCallback(done.append)
    client.pump()
    assert client.goaways() == [(slow, 0)] and client.transport.disconnecting
    assert [e.stage for e in events] == ["single"] and events[0].line()[0] == "warn"
    assert done == [None]        # finished: the drain does not wait for the close itself


@pytest.mark.parametrize("names", [(), ("response_writes",)])
def test_the_speedups_step_aside_on_an_http2_stream(
        names: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """Over HTTP/2 a request is served by the public path whatever speedups
    are on: the same answer, through Twisted's own Request.process (the
    reference ProxyRequest.process)."""
    public = []
    original = ProxyRequest.process

    def spy(self: ProxyRequest) -> None:
        public.append(type(self))
        original(self)

    monkeypatch.setattr(ProxyRequest, "process", spy)
    site_cls = site_class(Selection(True, names))
    _, client, _, _, _ = serve(GracefulH2Connection, site_cls)
    stream = client.get(b"/a")
    assert client.data[stream] == b"fast /a" and stream in client.ended
    assert public == [site_cls.requestFactory]
