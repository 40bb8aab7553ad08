"""The pool of idle engine connections and the client over it (speedups/engineclient.py), with
fake endpoints that connect at once on StringTransports and a task.Clock;
send_now, on a StringTransport and on a real TCP transport over a socket pair;
TCP_NODELAY on real TCP connections on 127.0.0.1; an engine connection made
through Twisted's endpoint on the real reactor."""

from __future__ import annotations

import socket
from collections.abc import Hashable
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import tcp
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.web.client import URI, RequestNotSent
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from zope.interface import implementer

from llmproxy.speedups import socketwrites
from llmproxy.speedups.engineclient import UpstreamClient, UpstreamPool, _OneConnection
from llmproxy.speedups.engineconnection import H1Connection
from llmproxy.speedups.enginemessage import UpstreamResponse
from llmproxy.speedups.socketwrites import send_now
from llmproxy.testing.fakes import read_body
from llmproxy.web.engineclient import EngineEndpoints
from llmproxy.web.site import ProxySite
from tests.test_h1client import collector_off

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Transport(StringTransport):
    """A StringTransport with a handle, as TCP and TLS transports have (without
    one, closed_by_peer takes the connection for lost); a real socket to peek
    at when given one, else an object that is not a socket."""

    def __init__(self, handle: object) -> None:
        super().__init__()
        self.handle = handle

    def getHandle(self) -> object:
        return self.handle


@implementer(IStreamClientEndpoint)
class Endpoint:
    """Connects at once: the factory's protocol on a fresh Transport (already
    closing on this side when `closing`; its handle the next of `sockets`)."""

    def __init__(self, closing: bool = False, sockets: list[socket.socket] | None = None) -> None:
        self.closing = closing
        self.sockets = sockets or []
        self.transports: list[Transport] = []
        self.protocols: list[IProtocol] = []

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:
        protocol = protocolFactory.buildProtocol(IPv4Address("TCP", "10.0.0.5", 8080))
        assert protocol is not None
        transport = Transport(self.sockets.pop(0) if self.sockets else object())
        protocol.makeConnection(transport)
        self.protocols.append(protocol)
        if self.closing:
            transport.loseConnection()
        self.transports.append(transport)
        return succeed(protocol)


def take(pool: UpstreamPool, key: Hashable, endpoint: Endpoint) -> H1Connection:
    """An idle connection the pool hands out, else a fresh one (as the client asks)."""
    idle = pool.idle_connection(key)
    if idle is not None:
        return idle
    got: list[H1Connection] = []
    pool.fresh(key, endpoint).addCallback(got.append)
    [connection] = got
    return connection


def serve(connection: H1Connection) -> None:
    """One whole keep-alive exchange: the connection offers itself back (on_idle)."""
    responses: list[UpstreamResponse] = []
    connection.request(b"GET", b"/", b"h", Headers(), None).addCallback(responses.append)
    connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert [r.code for r in responses] == [200] and connection.state == "QUIESCENT"


def idle_one(pool: UpstreamPool, key: Hashable, endpoint: Endpoint) -> H1Connection:
    connection = take(pool, key, endpoint)
    serve(connection)
    return connection


def test_idle_connection_is_reused_for_its_key_only() -> None:
    """A connection back from a response is the next one for the same key (the
    same object, no new connect); another key gets a connection of its own."""
    pool, endpoint = UpstreamPool(Clock()), Endpoint()
    first = idle_one(pool, "a", endpoint)
    assert len(endpoint.transports) == 1
    assert take(pool, "a", endpoint) is first and len(endpoint.transports) == 1
    serve(first)
    other = take(pool, "b", endpoint)
    assert other is not first and len(endpoint.transports) == 2
    assert take(pool, "a", endpoint) is first


def test_reuse_is_last_in_first_out_and_skips_unusable_ones() -> None:
    """The most recently idle connection goes first; one closing on this side is
    closed and passed over, never handed out."""
    pool, endpoint = UpstreamPool(Clock()), Endpoint()
    older, newer = take(pool, "a", endpoint), take(pool, "a", endpoint)
    serve(older)
    serve(newer)
    assert take(pool, "a", endpoint) is newer
    serve(newer)
    newer.transport.loseConnection()
    assert take(pool, "a", endpoint) is older
    assert len(endpoint.transports) == 2
    assert take(pool, "a", endpoint) not in (older, newer)


def test_idle_connection_the_engine_closed_is_not_reused() -> None:
    """On real sockets: the engine closed an idle connection (EOF waiting, not
    yet read): it is closed and a fresh connection is made; one still open is
    reused."""
    sockets = [socket.socketpair() for _ in range(3)]
    endpoint = Endpoint(sockets=[ours for ours, _ in sockets])
    pool = UpstreamPool(Clock())
    try:
        first = idle_one(pool, "a", endpoint)
        assert take(pool, "a", endpoint) is first
        serve(first)
        sockets[0][1].close()                     # the engine's end
        second = take(pool, "a", endpoint)
        assert second is not first and first.transport.disconnecting
        serve(second)
        assert take(pool, "a", endpoint) is second and len(endpoint.transports) == 2
    finally:
        for pair in sockets:
            for sock in pair:
                sock.close()


def test_more_idle_than_max_persistent_are_closed() -> None:
    """Only maxPersistentPerHost idle connections are kept per key; the next
    one back is closed, and a pool that is not persistent keeps none."""
    pool, endpoint = UpstreamPool(Clock()), Endpoint()
    pool.maxPersistentPerHost = 2
    connections = [take(pool, "a", endpoint) for _ in range(3)]
    for connection in connections:
        serve(connection)
    assert [t.disconnecting for t in endpoint.transports] == [False, False, True]
    assert {take(pool, "a", endpoint), take(pool, "a", endpoint)} == set(connections[:2])
    lone = UpstreamPool(Clock(), persistent=False)
    connection = idle_one(lone, "a", endpoint)
    assert connection.transport.disconnecting
    assert take(lone, "a", endpoint) is not connection


def test_idle_connection_expires_after_cached_connection_timeout() -> None:
    """Idle for cachedConnectionTimeout: closed and forgotten, and its own close
    teaches nothing about the engine; one reused before is not closed. One timer
    serves every idle connection, and none is left once none is idle."""
    clock, endpoint = Clock(), Endpoint()
    pool = UpstreamPool(clock)
    pool.cachedConnectionTimeout = 100.0
    connection = idle_one(pool, "a", endpoint)
    clock.advance(99)
    assert not connection.transport.disconnecting
    clock.advance(1)
    assert connection.transport.disconnecting and clock.getDelayedCalls() == []
    connection.connectionLost(Failure(ConnectionDone()))
    assert pool.engine_idle_close == {}
    fresh = take(pool, "a", endpoint)
    assert fresh is not connection and len(endpoint.transports) == 2
    serve(fresh)
    clock.advance(50)
    assert take(pool, "a", endpoint) is fresh
    clock.advance(100)
    assert not fresh.transport.disconnecting and clock.getDelayedCalls() == []


def test_idle_connections_expire_each_at_its_own_time() -> None:
    clock, endpoint = Clock(), Endpoint()
    pool = UpstreamPool(clock)
    pool.cachedConnectionTimeout = 100.0
    first = idle_one(pool, "a", endpoint)
    clock.advance(30)
    second = idle_one(pool, "b", endpoint)
    clock.advance(70)
    assert first.transport.disconnecting and not second.transport.disconnecting
    assert len(clock.getDelayedCalls()) == 1
    clock.advance(29)
    assert not second.transport.disconnecting
    clock.advance(1)
    assert second.transport.disconnecting and clock.getDelayedCalls() == []


def test_lost_while_idle_is_forgotten_and_the_shortest_idle_close_learned() -> None:
    """An idle connection the engine closed leaves the pool (its expiry with it),
    and engine_idle_close keeps the shortest idle time seen per key."""
    clock, endpoint = Clock(), Endpoint()
    pool = UpstreamPool(clock)
    for idle_for in (30.0, 10.0, 20.0):
        connection = idle_one(pool, "a", endpoint)
        clock.advance(idle_for)
        connection.connectionLost(Failure(ConnectionDone()))
        assert take(pool, "a", endpoint) is not connection     # fresh, and not idle
    assert pool.engine_idle_close == {"a": 10.0}
    assert len(endpoint.transports) == 6
    clock.advance(pool.cachedConnectionTimeout)
    assert not any(t.disconnecting for t in endpoint.transports)
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize(("idle_for", "reused"), [(7.0, True), (7.5, False), (8.0, False)])
def test_idle_longer_than_reuse_fraction_is_not_reused(idle_for: float, reused: bool) -> None:
    """The engine was seen closing connections after 10 s idle: one idle for less
    than REUSE_FRACTION of that is reused, one idle longer is closed and a fresh
    connection made; other keys are not affected."""
    clock, endpoint = Clock(), Endpoint()
    pool = UpstreamPool(clock)
    assert pool.REUSE_FRACTION == 0.75
    pool.engine_idle_close["a"] = 10.0
    connection = idle_one(pool, "a", endpoint)
    other = idle_one(pool, "b", endpoint)
    clock.advance(idle_for)
    got = take(pool, "a", endpoint)
    assert (got is connection) is reused
    assert connection.transport.disconnecting is not reused
    assert take(pool, "b", endpoint) is other


def test_close_cached_connections_closes_all_and_fires_once_they_are_gone() -> None:
    """Every idle connection is closed; the Deferred fires once each one's
    `lost` has; the pool is empty after, and nothing is learned from it."""
    pool, endpoint = UpstreamPool(Clock()), Endpoint()
    busy = take(pool, "a", endpoint)
    idle = [idle_one(pool, key, endpoint) for key in ("a", "b")]
    assert busy not in idle
    done: list[object] = []
    pool.closeCachedConnections().addCallback(done.append)
    assert [c.transport.disconnecting for c in idle] == [True, True]
    assert not busy.transport.disconnecting
    idle[0].connectionLost(Failure(ConnectionDone()))
    assert done == []
    idle[1].connectionLost(Failure(ConnectionDone()))
    assert done == [[None, None]]
    assert pool.engine_idle_close == {}
    assert take(pool, "a", endpoint) not in idle
    empty: list[object] = []
    UpstreamPool(Clock()).closeCachedConnections().addCallback(empty.append)
    assert empty == [[]]


class Endpoints:
    """Stands for the client's endpoint factory: one fake endpoint per URI."""

    def __init__(self, closing: bool = False) -> None:
        self.closing = closing
        self.made: dict[tuple[bytes, bytes, int], Endpoint] = {}

    def endpointForURI(self, uri: URI) -> Endpoint:
        key = (uri.scheme, uri.host, uri.port)
        return self.made.setdefault(key, Endpoint(self.closing))


def client(monkeypatch: pytest.MonkeyPatch, closing: bool = False,
           clock: Clock | None = None) -> tuple[UpstreamClient, Endpoints]:
    http = UpstreamClient(MemoryReactorClock(), UpstreamPool(clock or Clock()), 5.0)
    endpoints = Endpoints(closing)
    monkeypatch.setattr(http, "_endpoints", endpoints)
    return http, endpoints


def sent(endpoints: Endpoints, key: tuple[bytes, bytes, int]) -> bytes:
    return b"".join(t.value() for t in endpoints.made[key].transports)


def test_client_request_head_path_query_and_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The URL is split into where to connect and the path with its query; Host
    names the port unless it is the scheme's default; every header value goes
    out; a GET with no data has no Content-Length, a POST always has one."""
    http, endpoints = client(monkeypatch)
    http.request("POST", "http://h:8080/v1/x?y=1", data=b"{}",
                 headers=Headers({b"X-A": [b"1", b"2"]}))
    assert sent(endpoints, (b"http", b"h", 8080)) == (
        b"POST /v1/x?y=1 HTTP/1.1\r\nHost: h:8080\r\nX-A: 1\r\nX-A: 2\r\n"
        b"Content-Length: 2\r\n\r\n{}")
    http.get("http://h:80/v1/models")
    assert sent(endpoints, (b"http", b"h", 80)) == b"GET /v1/models HTTP/1.1\r\nHost: h\r\n\r\n"
    http.request("POST", "https://s:443")
    assert sent(endpoints, (b"https", b"s", 443)) == (
        b"POST / HTTP/1.1\r\nHost: s\r\nContent-Length: 0\r\n\r\n")
    http.get("https://s:80/a")
    assert sent(endpoints, (b"https", b"s", 80)) == b"GET /a HTTP/1.1\r\nHost: s:80\r\n\r\n"


def test_client_response_and_reuse_of_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request's Deferred fires with the engine's response, its body reads
    whole, and the next request to that engine goes on the same connection."""
    http, endpoints = client(monkeypatch)
    responses: list[UpstreamResponse] = []
    http.get("http://h:8080/v1/models").addCallback(responses.append)
    [endpoint] = endpoints.made.values()
    [transport] = endpoint.transports
    assert responses == []
    endpoint.protocols[0].dataReceived(OK)
    [response] = responses
    bodies: list[bytes] = []
    read_body(response).addCallback(bodies.append)
    assert response.code == 200 and bodies == [b"ok"]
    transport.clear()
    http.request("POST", "http://h:8080/v1/y", data=b"z")
    assert len(endpoint.transports) == 1
    assert transport.value().startswith(b"POST /v1/y HTTP/1.1\r\nHost: h:8080\r\n")


def test_client_request_not_sent_on_an_unusable_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection closing before the request went out: RequestNotSent, and not
    one byte was written."""
    http, endpoints = client(monkeypatch, closing=True)
    failures: list[Failure] = []
    http.request("POST", "http://h:8080/v1/x", data=b"{}").addErrback(failures.append)
    [failure] = failures
    assert failure.check(RequestNotSent)
    assert sent(endpoints, (b"http", b"h", 8080)) == b""


def test_endpoints_are_made_once_per_scheme_host_and_port() -> None:
    """The real endpoint factory hands back the same endpoint for the same
    scheme, host and port, and a new one for another port."""
    endpoints = EngineEndpoints(MemoryReactorClock(), 5.0)
    first = endpoints.endpointForURI(URI.fromBytes(b"http://h:8080/a"))
    assert endpoints.endpointForURI(URI.fromBytes(b"http://h:8080/b")) is first
    assert endpoints.endpointForURI(URI.fromBytes(b"http://h:8081/a")) is not first


def test_send_now_falls_back_to_write_on_other_transports() -> None:
    """Not a plain TCP transport (here a StringTransport): the bytes are written."""
    transport = StringTransport()
    send_now(transport, b"abc")
    send_now(transport, b"def")
    assert transport.value() == b"abcdef"


def test_send_now_sends_at_once_on_tcp_and_keeps_order_behind_a_buffer() -> None:
    """On a real TCP transport with nothing buffered the bytes are on the socket
    before any reactor turn; with bytes buffered they queue behind them."""
    ours, peer = socket.socketpair()
    reactor = MemoryReactorClock()
    try:
        transport = tcp.Server(ours, Protocol(), ("127.0.0.1", 1),
                               None, 1, reactor)  # type: ignore[arg-type]
        peer.setblocking(False)
        send_now(transport, b"now")
        assert peer.recv(10) == b"now"
        assert transport.dataBuffer == b"" and transport._tempDataLen == 0
        assert len(reactor.getWriters()) == 0
        transport.write(b"queued")
        send_now(transport, b"after")
        with pytest.raises(BlockingIOError):
            peer.recv(10)
        assert b"".join(transport._tempDataBuffer) == b"queuedafter"
    finally:
        ours.close()
        peer.close()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a real TCP connection on 127.0.0.1."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def _nodelay(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_client_and_engine_connections_send_small_writes_without_nagle() -> None:
    """Nagle's algorithm is off on both sides of the relay (as nginx's
    tcp_nodelay): a client's connection once accepted (Twisted's HTTPChannel
    does it), an engine's once made (engineconnection: Twisted's HTTP client did it
    before engineconnection replaced it). A transport without TCP (a test double here,
    a UNIX socket) is left alone."""
    reactor = MemoryReactorClock()
    client_end, accepted = _tcp_pair()
    engine_end, connected = _tcp_pair()
    try:
        assert not _nodelay(accepted) and not _nodelay(connected)
        site = ProxySite(Resource(), 1 << 20, reactor=reactor)
        channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
        assert channel is not None
        channel.makeConnection(tcp.Server(accepted, channel, ("127.0.0.1", 1),
                                          None, 1, reactor))  # type: ignore[arg-type]
        assert _nodelay(accepted)

        connection = H1Connection(lambda _: None, lambda _: None)
        transport = tcp.Server(connected, connection, ("127.0.0.1", 2),
                               None, 2, reactor)  # type: ignore[arg-type]
        connection.makeConnection(transport)
        assert _nodelay(connected)

        other = H1Connection(lambda _: None, lambda _: None)
        other.makeConnection(StringTransport())
        assert other.transport is not None
    finally:
        for sock in (client_end, accepted, engine_end, connected):
            sock.close()


def _ok_engine() -> tuple[Any, list[Protocol]]:
    """An engine on the real reactor (127.0.0.1) that answers OK to each request
    head; its listening port, and its connections as they come."""
    from twisted.internet import reactor

    engines: list[Protocol] = []

    class Engine(Protocol):
        def connectionMade(self) -> None:
            engines.append(self)

        def dataReceived(self, data: bytes) -> None:
            if data.endswith(b"\r\n\r\n"):
                self.transport.write(OK)  # type: ignore[union-attr]

    port = reactor.listenTCP(0, Factory.forProtocol(Engine),  # type: ignore[attr-defined]
                             interface="127.0.0.1")
    return port, engines


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_an_engine_connection_hears_its_tcp_transport_directly() -> None:
    """Over a real TCP connection made through Twisted's endpoint (the reactor,
    127.0.0.1), the connection is its transport's protocol once connected: the
    endpoint's wrapper, which only passed reads and the close on, is out of the
    way. A response is read whole, and the engine's close reaches it."""
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ClientEndpoint

    port, engines = _ok_engine()
    try:
        idle: list[H1Connection] = []
        connection = H1Connection(idle.append, lambda _: None)
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        assert await endpoint.connect(_OneConnection(connection)) is connection
        assert type(connection.transport) is tcp.Client
        assert connection.transport.protocol is connection
        # Its reads come straight to it (engineconnection._read), as Twisted's would go.
        assert socketwrites.READ_AS_KNOWN
        assert connection.transport.doRead == connection._read
        response = await connection.request(b"GET", b"/v1/models", b"h", Headers(), None)
        assert await read_body(response) == b"ok" and idle == [connection]
        engines[0].transport.loseConnection()  # type: ignore[union-attr]
        await connection.lost
        assert not connection.usable()
    finally:
        await port.stopListening()


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_an_engine_that_resets_mid_body_cuts_the_body_with_connection_lost() -> None:
    """Over a real TCP connection, the connection's own read hears a reset (the
    engine's RST after part of a chunked body) as Twisted's read would: the
    connection is lost with ConnectionLost, and the body is cut, not whole."""
    import struct

    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ClientEndpoint
    from twisted.internet.error import ConnectionLost
    from twisted.web.client import ResponseFailed

    class Engine(Protocol):
        def dataReceived(self, data: bytes) -> None:
            if data.endswith(b"\r\n\r\n"):
                transport = self.transport
                transport.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"  # type: ignore[union-attr]
                                b"5\r\nhello\r\n")
                reactor.callLater(0.05, self.reset)  # type: ignore[attr-defined]

        def reset(self) -> None:
            sock = self.transport.getHandle()  # type: ignore[union-attr]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abortConnection()  # type: ignore[union-attr]

    port = reactor.listenTCP(0, Factory.forProtocol(Engine),  # type: ignore[attr-defined]
                             interface="127.0.0.1")
    try:
        connection = H1Connection(lambda _: None, lambda _: None)
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        await endpoint.connect(_OneConnection(connection))
        assert connection.transport.doRead == connection._read
        response = await connection.request(b"GET", b"/v1/x", b"h", Headers(), None)
        reasons: list[Failure] = []
        got: list[bytes] = []

        class Body(Protocol):
            def dataReceived(self, data: bytes) -> None:
                got.append(data)

            def connectionLost(self, reason: Failure = connectionDone) -> None:
                reasons.append(reason)

        response.deliverBody(Body())
        await connection.lost
        assert got == [b"hello"]
        [reason] = reasons
        assert reason.check(ResponseFailed)
        [inner] = reason.value.reasons
        assert inner.check(ConnectionLost), inner
    finally:
        await port.stopListening()


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_closed_engine_connection_goes_without_the_collector() -> None:
    """Over a real TCP connection made through Twisted's endpoint, once the engine
    closes it, the connection and its TCP transport are freed by their reference
    counts: Twisted's connector keeps the factory and its transport, and they
    kept the connection (a cycle per engine connection, freed only by a full
    collection after it had lived through the younger ones). The factory builds
    its connection once: a second connection of the same attempt gets none."""
    import weakref

    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ClientEndpoint
    from twisted.internet.task import deferLater

    port, engines = _ok_engine()
    try:
        with collector_off():
            connection = H1Connection(lambda _: None, lambda _: None)
            factory = _OneConnection(connection)
            endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
            assert await endpoint.connect(factory) is connection
            assert factory.buildProtocol(None) is None
            response = await connection.request(b"GET", b"/v1/models", b"h", Headers(), None)
            assert await read_body(response) == b"ok"
            del response
            engines.pop().transport.loseConnection()  # type: ignore[union-attr]
            await connection.lost
            # The connector hears of the close right after the connection does.
            await deferLater(reactor, 0, lambda: None)  # type: ignore[arg-type]
            gone = weakref.ref(connection), weakref.ref(connection.transport)
            del connection, factory, endpoint
            assert [ref() for ref in gone] == [None, None]
    finally:
        await port.stopListening()
