"""An engine's close of an idle keep-alive connection, and the proxy's request
on it (speedups/engineclient.py): a request that crosses the close (the
CrossedClose) is sent once more on a fresh connection, with fakes and a
task.Clock, then over real TCP on 127.0.0.1 against an engine that closes a
connection when its second request arrives; and the idle timeout an engine's
`Keep-Alive` header gives keeps the pool from reusing a connection that old."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionAborted, ConnectionDone, ConnectionLost
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.client import ResponseNeverReceived
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from llmproxy.speedups.engineclient import UpstreamClient, UpstreamPool
from llmproxy.speedups.engineconnection import H1Connection
from llmproxy.speedups.enginemessage import UpstreamResponse, keep_alive_timeout
from llmproxy.testing.fakes import read_body
from llmproxy.web.engineclient import CrossedClose
from tests.test_upstream_client import OK, Endpoint, Endpoints
from tests.test_upstream_client import client as upstream_client

URL = "http://h:8080/v1/chat/completions"
KEY = (b"http", b"h", 8080)


def client(monkeypatch: pytest.MonkeyPatch) -> tuple[UpstreamClient, Endpoints, Clock]:
    clock = Clock()
    http, endpoints = upstream_client(monkeypatch, clock=clock)
    return http, endpoints, clock


def outcome(d: Deferred[Any]) -> list[Any]:
    got: list[Any] = []
    d.addBoth(got.append)
    return got


def idle_after_one_request(http: UpstreamClient, endpoints: Endpoints,
                           clock: Clock, idle_for: float) -> Endpoint:
    """One exchange on a fresh connection, then `idle_for` seconds idle in the pool."""
    first = outcome(http.request("POST", URL, data=b"{}"))
    endpoint = endpoints.made[KEY]
    endpoint.protocols[-1].dataReceived(OK)
    assert isinstance(first[0], UpstreamResponse)
    clock.advance(idle_for)
    for transport in endpoint.transports:
        transport.clear()
    return endpoint


def connection(endpoint: Endpoint, n: int) -> H1Connection:
    protocol = endpoint.protocols[n]
    assert isinstance(protocol, H1Connection)
    return protocol


@pytest.mark.parametrize(("value", "seconds"), [
    (b"timeout=5, max=100", 5.0), (b"max=100,timeout=7", 7.0), (b" Timeout = 3 ", 3.0),
    (b"timeout=0", 0.0), (b"timeout=1.5", None), (b"timeout=-1", None), (b"timeout=", None),
    (b"timeout=9999999999", None), (b"max=5", None), (b"", None), (b"timeout", None)])
def test_keep_alive_timeout_is_whole_seconds_or_none(value: bytes, seconds: float | None) -> None:
    assert keep_alive_timeout(value) == seconds


def test_an_engines_keep_alive_timeout_keeps_older_connections_from_reuse(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer says `Keep-Alive: timeout=4`: the header stays off the response
    the client sees, the pool takes 4 s as the engine's idle close, and reuses a
    connection idle for less than REUSE_FRACTION of it, not one idle longer."""
    http, endpoints, clock = client(monkeypatch)
    first = outcome(http.request("POST", URL, data=b"{}"))
    endpoint = endpoints.made[KEY]
    connection(endpoint, 0).dataReceived(
        b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=4, max=100\r\nContent-Length: 0\r\n\r\n")
    assert first[0].code == 200 and not first[0].headers.hasHeader(b"keep-alive")
    assert connection(endpoint, 0).keep_alive == 4.0
    assert http._pool.engine_idle_close == {KEY: 4.0}
    assert http._pool.REUSE_FRACTION * 4.0 == 3.0
    clock.advance(2.9)
    http.request("POST", URL, data=b"{}")
    assert len(endpoint.protocols) == 1                   # reused
    connection(endpoint, 0).dataReceived(OK)               # no header: the 4 s stay
    clock.advance(3.0)
    http.request("POST", URL, data=b"{}")
    assert len(endpoint.protocols) == 2 and endpoint.transports[0].disconnecting
    assert http._pool.engine_idle_close == {KEY: 4.0}


@pytest.mark.parametrize("close", [ConnectionDone, ConnectionLost])
def test_a_post_the_engine_closed_on_unanswered_is_never_sent_again(
        monkeypatch: pytest.MonkeyPatch, close: type[Exception]) -> None:
    """A POST went out whole on a connection idle for 3 s, and the engine closed
    it (cleanly or by a reset) with not a byte of an answer: it may have read
    it (an idle close crossing it looks the same), so it is not sent again; the
    caller hears ResponseNeverReceived. The pool still learns the 3 s."""
    http, endpoints, clock = client(monkeypatch)
    endpoint = idle_after_one_request(http, endpoints, clock, 3.0)
    got = outcome(http.request("POST", URL, data=b'{"n": 2}'))
    connection(endpoint, 0).connectionLost(Failure(close()))
    [failure] = got
    assert failure.check(ResponseNeverReceived) and not failure.check(CrossedClose)
    assert len(endpoint.protocols) == 1 and http._pool.engine_idle_close == {KEY: 3.0}


@pytest.mark.parametrize("close", [ConnectionDone, ConnectionLost])
def test_a_get_crossed_by_the_engines_idle_close_goes_once_more_on_a_fresh_connection(
        monkeypatch: pytest.MonkeyPatch, close: type[Exception]) -> None:
    """A GET (idempotent) went out on a connection idle for 3 s, and the engine
    closed it (cleanly or by a reset) with not a byte of an answer: the same
    request goes out on a fresh connection, whose answer is the caller's. The
    pool now knows the engine closes connections idle for 3 s."""
    http, endpoints, clock = client(monkeypatch)
    endpoint = idle_after_one_request(http, endpoints, clock, 3.0)
    got = outcome(http.request("GET", URL + "?n=2"))
    reused = connection(endpoint, 0)
    assert reused.idle_for == 3.0 and len(endpoint.protocols) == 1
    first_try = endpoint.transports[0].value()
    assert first_try.startswith(b"GET /v1/chat/completions?n=2 ")
    reused.connectionLost(Failure(close()))
    assert got == [] and len(endpoint.protocols) == 2
    assert endpoint.transports[1].value() == first_try
    assert http._pool.engine_idle_close == {KEY: 3.0}
    connection(endpoint, 1).dataReceived(OK)
    [response] = got
    assert isinstance(response, UpstreamResponse) and response.code == 200
    assert outcome(read_body(response)) == [b"ok"]


def test_a_bodyless_get_crossed_goes_once_more_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET (the roster's poll of /v1/models) crossed by the close: once more."""
    http, endpoints, clock = client(monkeypatch)
    endpoint = idle_after_one_request(http, endpoints, clock, 1.0)
    got = outcome(http.get("http://h:8080/v1/models"))
    connection(endpoint, 0).connectionLost(Failure(ConnectionDone()))
    assert endpoint.transports[1].value().startswith(b"GET /v1/models HTTP/1.1\r\n")
    connection(endpoint, 1).dataReceived(OK)
    assert [r.code for r in got] == [200]


def test_a_connection_closed_after_part_of_an_answer_is_not_crossed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes of an answer came before the close: the engine had the request. It
    fails as ResponseNeverReceived, is not sent again, and nothing is learned."""
    http, endpoints, clock = client(monkeypatch)
    endpoint = idle_after_one_request(http, endpoints, clock, 3.0)
    got = outcome(http.request("POST", URL, data=b"{}"))
    reused = connection(endpoint, 0)
    reused.dataReceived(b"HTTP/1.1 200 OK\r\nContent-")
    reused.connectionLost(Failure(ConnectionDone()))
    [failure] = got
    assert failure.check(ResponseNeverReceived) and not failure.check(CrossedClose)
    assert len(endpoint.protocols) == 1 and http._pool.engine_idle_close == {}


def test_a_fresh_connection_closed_unanswered_is_not_crossed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request on a connection's first use that the engine closes unanswered
    (no idle close could cross it: the engine failed) is not sent again."""
    http, endpoints, _ = client(monkeypatch)
    got = outcome(http.request("POST", URL, data=b"{}"))
    endpoint = endpoints.made[KEY]
    connection(endpoint, 0).connectionLost(Failure(ConnectionDone()))
    [failure] = got
    assert failure.check(ResponseNeverReceived) and not failure.check(CrossedClose)
    assert len(endpoint.protocols) == 1 and http._pool.engine_idle_close == {}


def test_a_second_close_on_the_fresh_connection_reaches_the_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once more, and only once: the fresh connection closed unanswered too, and
    the caller hears ResponseNeverReceived (the engine failed, no crossing)."""
    http, endpoints, clock = client(monkeypatch)
    endpoint = idle_after_one_request(http, endpoints, clock, 3.0)
    got = outcome(http.get(URL))
    connection(endpoint, 0).connectionLost(Failure(ConnectionDone()))
    connection(endpoint, 1).connectionLost(Failure(ConnectionLost()))
    [failure] = got
    assert failure.check(ResponseNeverReceived) and not failure.check(CrossedClose)
    assert len(endpoint.protocols) == 2


def test_a_request_cancelled_by_the_proxy_is_not_sent_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller cancels (its header timeout, its client gone): the connection
    is aborted on this side, and that is no crossing. Cancelled while the second
    try waits, the fresh connection is aborted too."""
    http, endpoints, clock = client(monkeypatch)
    endpoint = idle_after_one_request(http, endpoints, clock, 3.0)
    pending = http.request("POST", URL, data=b"{}")
    got = outcome(pending)
    pending.cancel()
    connection(endpoint, 0).connectionLost(Failure(ConnectionAborted()))
    assert got[0].check(CancelledError) and len(endpoint.protocols) == 1

    endpoint = idle_after_one_request(http, endpoints, clock, 1.0)
    pending = http.get(URL)
    got = outcome(pending)
    connection(endpoint, 1).connectionLost(Failure(ConnectionDone()))
    assert len(endpoint.protocols) == 3 and got == []
    pending.cancel()
    assert got[0].check(CancelledError)
    assert endpoint.transports[2].disconnecting


def test_a_streamed_post_closed_on_unanswered_is_not_sent_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A POST whose body streams (a producer), its head written, then the close:
    the caller hears ResponseNeverReceived, not CrossedClose (forward.py would
    send it again), and the pool learns from it all the same."""
    http, endpoints, clock = client(monkeypatch)
    endpoint = idle_after_one_request(http, endpoints, clock, 2.0)
    got = outcome(http.request("POST", URL, data=_Streaming()))
    connection(endpoint, 0).connectionLost(Failure(ConnectionDone()))
    [failure] = got
    assert failure.check(ResponseNeverReceived) and not failure.check(CrossedClose)
    assert len(endpoint.protocols) == 1 and http._pool.engine_idle_close == {KEY: 2.0}


@implementer(IBodyProducer)
class _Streaming:
    """A body of 10 bytes that streams (and is still on its way)."""

    length = 10

    def startProducing(self, consumer: Any) -> Deferred[None]:
        return Deferred()

    def stopProducing(self) -> None:
        pass

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass


def _closing_engine() -> tuple[Any, list[bytes]]:
    """An engine on 127.0.0.1 that answers the first request on each connection
    and closes the connection when a second one arrives on it, answering
    nothing: an idle close and a request crossing, every time. Its port, and the
    request heads it read."""
    from twisted.internet import reactor

    heads: list[bytes] = []

    class Engine(Protocol):
        answered = False

        def dataReceived(self, data: bytes) -> None:
            heads.append(data.split(b"\r\n", 1)[0])
            if self.answered:
                self.transport.loseConnection()  # type: ignore[union-attr]
                return
            self.answered = True
            self.transport.write(OK)  # type: ignore[union-attr]

    port = reactor.listenTCP(0, Factory.forProtocol(Engine),  # type: ignore[attr-defined]
                             interface="127.0.0.1")
    return port, heads


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_over_tcp_every_crossed_request_is_answered_on_a_fresh_connection() -> None:
    """Five GETs in a row to an engine that closes every reused connection as
    the request arrives: every one is answered (each after the first went out
    twice: on the reused connection, then on a fresh one). A POST the engine
    read whole and closed on unanswered is not sent again: the caller hears
    ResponseNeverReceived, and the engine read it once."""
    from twisted.internet import reactor

    port, heads = _closing_engine()
    pool = UpstreamPool(reactor)  # type: ignore[arg-type]
    http = UpstreamClient(reactor, pool, 5.0)
    url = f"http://127.0.0.1:{port.getHost().port}/v1/chat/completions"
    try:
        codes = []
        for _ in range(5):
            response = await http.request("GET", url)
            assert await read_body(response) == b"ok"
            codes.append(response.code)
            pool.engine_idle_close.clear()       # keep reusing: cross every time
        assert codes == [200] * 5
        assert heads == [b"GET /v1/chat/completions HTTP/1.1"] * 9
        with pytest.raises(ResponseNeverReceived) as raised:
            await http.request("POST", url, data=b"{}")
        assert not isinstance(raised.value, CrossedClose)
        assert heads[9:] == [b"POST /v1/chat/completions HTTP/1.1"]
    finally:
        await pool.closeCachedConnections()
        await port.stopListening()
