"""The reference client to the engines (web/engineclient.py: treq over an Agent
with EnginePool), on a MemoryReactorClock whose connections the test makes on
StringTransports and answers by hand (a real socket of a socketpair behind
each, where the stale-connection check looks at one); then over real TCP on
127.0.0.1."""

from __future__ import annotations

import gzip
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.address import IPv4Address
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.web.client import (
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from llmproxy.testing.fakes import read_body
from llmproxy.web.engineclient import CrossedClose, EngineClient, EnginePool
from llmproxy.web.relay import client_response_headers

# Twisted 26.10's readBody warns on every Agent response (its body transport,
# a TransportProxyProducer, has no abortConnection): Twisted's, not ours.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Using readBody with a transport:DeprecationWarning")

URL = "http://10.0.0.5:8080/v1/chat/completions"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Transport(StringTransport):
    """A StringTransport with a handle, as a TCP transport has (a socket)."""

    def __init__(self, handle: object) -> None:
        super().__init__()
        self.handle = handle

    def getHandle(self) -> object:
        return self.handle


class Engine:
    """The client on a MemoryReactorClock, and the engine's side of each
    connection it asks for: `connect()` makes the next one."""

    def __init__(self) -> None:
        self.reactor = MemoryReactorClock()
        self.pool = EnginePool(self.reactor)
        self.http = EngineClient(self.reactor, self.pool, 7.0)
        self.made: list[tuple[Protocol, Transport]] = []
        self.pairs: list[tuple[socket.socket, socket.socket]] = []

    def connect(self, attempt: int | None = None) -> tuple[Protocol, Transport]:
        """The client's next connection attempt (or the one numbered `attempt`)
        succeeds; its protocol (as the reactor sees it) and transport (its
        handle one end of a socketpair, whose other end is `pairs[n][1]`: the
        engine's)."""
        at = len(self.made) if attempt is None else attempt
        host, port, factory, timeout, _ = self.reactor.tcpClients[at]
        assert timeout == 7.0             # the connect timeout reaches the endpoint
        pair = socket.socketpair()
        self.pairs.append(pair)
        protocol = factory.buildProtocol(IPv4Address("TCP", host, port))
        transport = Transport(pair[0])
        protocol.makeConnection(transport)
        self.made.append((protocol, transport))
        return protocol, transport

    def close(self) -> None:
        for pair in self.pairs:
            for sock in pair:
                sock.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.close()


def outcome(d: Deferred[Any]) -> list[Any]:
    got: list[Any] = []
    d.addBoth(got.append)
    return got


class Body(Protocol):
    """A body protocol that records what it got, and how the body ended."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.ended: Failure | None = None

    def dataReceived(self, data: bytes) -> None:
        self.data.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.ended = reason


def answered(engine: Engine, d: Deferred[Any], answer: bytes = OK) -> Any:
    """The response once the engine's last connection answers `answer`."""
    protocol, _ = engine.made[-1]
    got = outcome(d)
    protocol.dataReceived(answer)
    [response] = got
    assert not isinstance(response, Failure), response
    return response


def idle_after_one(engine: Engine) -> tuple[Protocol, Transport]:
    """One whole exchange: its connection is idle in the pool."""
    d = engine.http.request("POST", URL, data=b"{}")
    engine.connect()
    assert outcome(read_body(answered(engine, d))) == [b"ok"]
    return engine.made[-1]


def test_a_bytes_body_goes_out_at_once_and_the_answer_streams_as_it_comes(
        engine: Engine) -> None:
    """The request, head and bytes body, is written as the connection is made
    (no cooperator turn: the clock never moves); the response fires at its
    headers and each piece of its body reaches the body protocol as it comes."""
    d = engine.http.request("POST", URL, data=b'{"a": 1}',
                            headers=Headers({b"X-Test": [b"yes"]}))
    _, transport = engine.connect()
    sent = transport.value()
    assert sent.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"Content-Length: 8\r\n" in sent and b"X-Test: yes\r\n" in sent
    assert sent.endswith(b'\r\n\r\n{"a": 1}')
    response = answered(engine, d, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                                   b"Content-Type: text/event-stream\r\n\r\n5\r\nfirst\r\n")
    body = Body()
    response.deliverBody(body)
    assert response.code == 200 and body.data == [b"first"] and body.ended is None
    engine.made[-1][0].dataReceived(b"6\r\nsecond\r\n")
    assert body.data == [b"first", b"second"] and body.ended is None
    engine.made[-1][0].dataReceived(b"0\r\n\r\n")
    assert body.ended is not None and body.ended.check(ResponseDone)


def test_the_request_target_keeps_the_clients_bytes(engine: Engine) -> None:
    """A byte outside ASCII in a client's request target (passed as latin-1)
    reaches the engine as its own %XX, and a `#` is not cut off as a fragment."""
    engine.http.request("POST", "http://10.0.0.5:8080/v1/\u00e9#x?a=1", data=b"{}")
    _, transport = engine.connect()
    assert transport.value().startswith(b"POST /v1/%E9%23x?a=1 HTTP/1.1\r\n")


def test_no_cookie_an_engine_sets_reaches_the_next_request(engine: Engine) -> None:
    """An engine's Set-Cookie is not kept: the next request (on the same,
    reused connection) carries no Cookie header."""
    d = engine.http.request("POST", URL, data=b"{}")
    _, transport = engine.connect()
    response = answered(engine, d, b"HTTP/1.1 200 OK\r\nSet-Cookie: session=abc; Path=/\r\n"
                                   b"Content-Length: 2\r\n\r\nok")
    assert outcome(read_body(response)) == [b"ok"]
    transport.clear()
    engine.http.request("POST", URL, data=b"{}")
    assert len(engine.made) == 1 and transport.value().startswith(b"POST ")
    assert b"cookie" not in transport.value().lower()


def test_no_redirect_is_followed(engine: Engine) -> None:
    """A 302 is the answer itself: no second request goes anywhere."""
    d = engine.http.request("POST", URL, data=b"{}")
    engine.connect()
    response = answered(engine, d, b"HTTP/1.1 302 Found\r\nLocation: http://10.0.0.9/\r\n"
                                   b"Content-Length: 0\r\n\r\n")
    assert response.code == 302 and len(engine.reactor.tcpClients) == 1


def test_no_coding_is_asked_for_and_a_gzip_answer_is_not_decoded(engine: Engine) -> None:
    """Under treq's content decoder (web/treqlayers.py): the engine is asked for
    `Accept-Encoding: identity` alone, whatever the caller's headers said; a gzip
    answer comes back as the engine sent it, its Content-Encoding in its place
    among the headers and its length known; an engine's own header of the name
    the layer hides the coding under is dropped; an answer without a coding
    keeps no empty Content-Encoding."""
    asked = Headers({b"Accept-Encoding": [b"gzip, br"]})
    d = engine.http.request("POST", URL, data=b"{}", headers=asked)
    _, transport = engine.connect()
    lines = transport.value().lower().split(b"\r\n")
    assert [line for line in lines if line.startswith(b"accept-encoding")] == [
        b"accept-encoding: identity"]
    packed = gzip.compress(b'{"ok": true}')
    response = answered(engine, d, b"HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Encoding: gzip\r\n"
                                   b"X-LLMProxy-Content-Encoding: forged\r\nX-B: 2\r\n"
                                   b"Content-Length: %d\r\n\r\n%b" % (len(packed), packed))
    assert [name.lower() for name, _ in response.headers.getAllRawHeaders()] == [
        b"x-a", b"content-encoding", b"x-b"]
    assert response.headers.getRawHeaders(b"Content-Encoding") == [b"gzip"]
    out = Headers()
    client_response_headers(response.headers, response.length, out, False)
    assert out.getRawHeaders(b"Content-Encoding") == [b"gzip"]
    assert out.getRawHeaders(b"Content-Length") == [b"%d" % len(packed)]
    assert outcome(read_body(response)) == [packed]
    plain = answered(engine, engine.http.request("POST", URL, data=b"{}"))
    out = Headers()
    client_response_headers(plain.headers, plain.length, out, False)
    assert not out.hasHeader(b"Content-Encoding")
    assert out.getRawHeaders(b"Content-Length") == [b"2"]


@pytest.mark.parametrize("peer", ["closed", "sent bytes", "open"])
def test_an_idle_connection_the_engine_closed_is_never_used(engine: Engine, peer: str) -> None:
    """A cached connection whose engine end closed (EOF waits) or sent bytes
    nobody asked for is closed and a new connection carries the request; one
    still open carries it itself."""
    _, first = idle_after_one(engine)
    engine_end = engine.pairs[0][1]
    if peer == "closed":
        engine_end.close()
    elif peer == "sent bytes":
        engine_end.send(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
    first.clear()
    engine.http.request("POST", URL, data=b"{}")
    if peer == "open":
        assert first.value().startswith(b"POST ") and len(engine.reactor.tcpClients) == 1
        return
    assert first.disconnecting and first.value() == b""
    assert len(engine.reactor.tcpClients) == 2
    _, second = engine.connect()
    assert second.value().startswith(b"POST ")


@pytest.mark.parametrize("close", [ConnectionDone, ConnectionLost])
def test_a_post_the_engine_closed_on_unanswered_is_never_sent_again(
        engine: Engine, close: type[Exception]) -> None:
    """A POST went out whole on a reused connection, and the engine closed it
    (cleanly or by a reset) with not a byte of an answer: it may have read it,
    so it is not sent again; the caller hears ResponseNeverReceived."""
    protocol, first = idle_after_one(engine)
    first.clear()
    got = outcome(engine.http.request("POST", URL, data=b'{"n": 2}'))
    assert first.value().endswith(b'{"n": 2}')
    protocol.connectionLost(Failure(close()))
    [failure] = got
    assert failure.check(ResponseNeverReceived) and not failure.check(CrossedClose)
    assert len(engine.reactor.tcpClients) == 1


def test_a_get_crossed_on_a_reused_connection_goes_once_more_on_a_fresh_one(
        engine: Engine) -> None:
    """The engine closes a reused connection as a GET arrives (not a byte of an
    answer): the GET (idempotent) goes once more, whole, on a new connection,
    and its answer is the caller's. A fresh connection closed unanswered in
    turn is the caller's failure: no third try."""
    protocol, first = idle_after_one(engine)
    first.clear()
    d = engine.http.request("GET", URL + "?n=2")
    request = first.value()
    got = outcome(d)
    protocol.connectionLost(Failure(ConnectionDone()))
    assert got == [] and len(engine.reactor.tcpClients) == 2
    again, second = engine.connect()
    assert second.value() == request
    again.connectionLost(Failure(ConnectionDone()))
    [failure] = got
    assert failure.check(ResponseNeverReceived) and not failure.check(CrossedClose)
    assert len(engine.reactor.tcpClients) == 2


def test_a_request_on_a_fresh_connection_is_not_sent_again(engine: Engine) -> None:
    """A fresh connection that ends before an answer fails the request: it was
    not a crossed idle close, and nothing is sent again."""
    d = engine.http.request("POST", URL, data=b"{}")
    protocol, _ = engine.connect()
    got = outcome(d)
    protocol.connectionLost(Failure(ConnectionDone()))
    [failure] = got
    assert failure.check(ResponseNeverReceived) and not failure.check(CrossedClose)
    assert len(engine.reactor.tcpClients) == 1


@pytest.mark.parametrize("body", ["bytes", "streamed"])
def test_a_reused_connection_closed_after_part_of_an_answer_is_not_crossed(
        engine: Engine, body: str) -> None:
    """The engine sent a byte of an answer before it closed (a streamed body:
    while the body was still going out): it took the request, which is not
    sent again, nor handed back as crossed."""
    protocol, _ = idle_after_one(engine)
    got = outcome(engine.http.request("POST", URL,
                                      data=b"{}" if body == "bytes" else Streaming()))
    protocol.dataReceived(b"HTTP/1.1 20")
    protocol.connectionLost(Failure(ConnectionDone()))
    [failure] = got
    assert failure.check(ResponseFailed, RequestTransmissionFailed)
    assert not failure.check(ResponseNeverReceived)
    assert len(engine.reactor.tcpClients) == 1


@implementer(IBodyProducer)
class Streaming:
    """A body that streams (still on its way)."""

    length = 10

    def startProducing(self, consumer: Any) -> Deferred[None]:
        return Deferred()

    def stopProducing(self) -> None:
        pass

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass


def test_a_streamed_post_closed_on_unanswered_is_not_the_callers_to_send_again(
        engine: Engine) -> None:
    """A POST whose body streams, its head written, then the engine's close: it
    fails as Twisted says (its body was still going out), not CrossedClose (the caller would send
    it again); the engine's other idle connection stays."""
    one, two = engine.http.request("POST", URL, data=b"{}"), \
        engine.http.request("POST", URL, data=b"{}")
    engine.connect()
    answered(engine, one)
    engine.connect()
    answered(engine, two)
    (first, _), (_, other) = engine.made
    got = outcome(engine.http.request("POST", URL, data=Streaming()))
    first.connectionLost(Failure(ConnectionDone()))
    [failure] = got
    assert failure.check(ResponseNeverReceived, RequestTransmissionFailed)
    assert not failure.check(CrossedClose) and not other.disconnecting
    assert len(engine.reactor.tcpClients) == 2


def test_cancelling_before_the_headers_closes_the_connection(engine: Engine) -> None:
    """Cancelled while connecting, the connect attempt stops; cancelled once
    the request went out, its connection is aborted. Either way it fails."""
    connecting = engine.http.request("POST", URL, data=b"{}")
    connecting.cancel()
    assert engine.reactor.connectors[0].stoppedConnecting
    d = engine.http.request("POST", URL, data=b"{}")
    _, transport = engine.connect(1)
    got = outcome(d)
    d.cancel()
    [failure] = got
    assert failure.check(ResponseNeverReceived, CancelledError)
    assert transport.disconnected


class Stalled(Body):
    """A body protocol whose client reads slowly: as the relay does, it hands
    its transport to the client's side as a producer (here: keeps it)."""

    def connectionMade(self) -> None:
        self.producer = self.transport


def test_a_slow_client_pauses_the_engine_connection_and_a_gone_one_stops_it(
        engine: Engine) -> None:
    """The body protocol's transport pauses and resumes the engine connection
    itself (backpressure), and stopping it stops the engine connection."""
    d = engine.http.request("POST", URL, data=b"{}")
    _, transport = engine.connect()
    response = answered(engine, d, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    body = Stalled()
    response.deliverBody(body)
    body.producer.pauseProducing()
    assert transport.producerState == "paused"
    body.producer.resumeProducing()
    assert transport.producerState == "producing"
    body.producer.stopProducing()
    assert transport.producerState == "stopped"


def test_close_cached_connections_closes_the_idle_ones(engine: Engine) -> None:
    """The service's stop closes every idle connection; it fires once they are gone."""
    protocol, transport = idle_after_one(engine)
    done = outcome(engine.pool.closeCachedConnections())
    assert transport.disconnecting and done == []
    protocol.connectionLost(Failure(ConnectionDone()))
    assert done == [None]


def _engine(close_reused: bool, answer: bytes = OK) -> tuple[Any, list[bytes], Deferred[None]]:
    """An engine on 127.0.0.1 that answers `answer`, then (with `close_reused`)
    closes a connection when a second request arrives on it, answering
    nothing; its port, the request lines it read, and a Deferred that fires
    when a connection of its is lost."""
    from twisted.internet import reactor

    heads: list[bytes] = []
    lost: Deferred[None] = Deferred()

    class Served(Protocol):
        answered = False

        def dataReceived(self, data: bytes) -> None:
            heads.append(data.split(b"\r\n", 1)[0])
            if self.answered and close_reused:
                self.transport.loseConnection()  # type: ignore[union-attr]
                return
            self.answered = True
            self.transport.write(answer)  # type: ignore[union-attr]

        def connectionLost(self, reason: Failure = connectionDone) -> None:
            if not lost.called:
                lost.callback(None)

    port = reactor.listenTCP(0, Factory.forProtocol(Served),  # type: ignore[attr-defined]
                             interface="127.0.0.1")
    return port, heads, lost


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_over_tcp_every_crossed_request_is_answered_on_a_fresh_connection() -> None:
    """Five GETs in a row to an engine that closes every reused connection as
    the request arrives: every one is answered, each after the first sent
    twice (on the reused connection, then on a fresh one), never more. A POST
    the engine read whole and closed on unanswered is not sent again: the
    caller hears ResponseNeverReceived, and the engine read it once."""
    from twisted.internet import reactor

    port, heads, _ = _engine(close_reused=True)
    pool = EnginePool(reactor)
    http = EngineClient(reactor, pool, 5.0)
    url = f"http://127.0.0.1:{port.getHost().port}/v1/chat/completions"
    try:
        for _ in range(5):
            response = await http.request("GET", url)
            assert (response.code, await read_body(response)) == (200, b"ok")
        assert heads == [b"GET /v1/chat/completions HTTP/1.1"] * 9
        with pytest.raises(ResponseNeverReceived) as raised:
            await http.request("POST", url, data=b"{}")
        assert not isinstance(raised.value, CrossedClose)
        assert heads[9:] == [b"POST /v1/chat/completions HTTP/1.1"]
    finally:
        await pool.closeCachedConnections()
        await port.stopListening()


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_over_tcp_stopping_a_body_closes_the_engine_connection() -> None:
    """A body protocol that stops its transport mid-stream (the relay, when its
    client leaves) closes the engine's TCP connection: the engine sees it go."""
    from twisted.internet import reactor

    port, _, lost = _engine(False, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                                   b"\r\n5\r\nfirst\r\n")
    pool = EnginePool(reactor)
    http = EngineClient(reactor, pool, 5.0)
    try:
        response = await http.get(f"http://127.0.0.1:{port.getHost().port}/v1/models")
        body = Stalled()
        response.deliverBody(body)
        assert not lost.called
        body.producer.stopProducing()
        await lost.addTimeout(5, reactor)
    finally:
        await pool.closeCachedConnections()
        await port.stopListening()
