"""Hostile engine heads against both engine clients: the reference one
(web/engineclient.py, Twisted's parser behind web.enginehead's watch) and the
fast one (speedups/engineconnection.py). The same bytes give the same outcome
either way: a bare LF, a lone CR or a NUL in a head, a 101, more than 32
interim heads or one that closes the connection, a bad status line, a folded
header, a control character in a value, an ambiguous framing (a repeated or
listed Content-Length, one beside Transfer-Encoding, a Transfer-Encoding that
is not one `chunked`) fail the request with BadResponse (its text what the
proxy's 502 says) and close the connection; a header the engine's Connection
header names is dropped by either relay. In
memory (a MemoryReactorClock, the engine's side fed by hand, split at every
byte), then over real TCP with a raw-socket engine on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseFailed, ResponseNeverReceived
from twisted.web.http_headers import Headers

from llmproxy.core.failures import describe
from llmproxy.speedups.engineclient import UpstreamClient, UpstreamPool
from llmproxy.speedups.relaychunks import raw_response_headers
from llmproxy.testing.fakes import read_body
from llmproxy.web.engineclient import EngineClient, EnginePool
from llmproxy.web.enginehead import MAX_INTERIM, BadResponse, HeadWatch
from llmproxy.web.relay import client_response_headers

pytestmark = pytest.mark.filterwarnings(
    "ignore:Using readBody with a transport:DeprecationWarning")

URL = "http://10.0.0.5:8080/v1/chat/completions"
CLIENTS = ["reference", "fast"]
OK = b"Content-Length: 2\r\n\r\nok"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# Heads each client refuses, and a word of why (in BadResponse's text).
REFUSED = {
    "lf-status": (b"HTTP/1.1 200 OK\nSet-Cookie: pwned=1\r\n" + OK, "bare LF"),
    "lf-all": (b"HTTP/1.1 200 OK\nSet-Cookie: pwned=1\nContent-Length: 2\n\nok", "bare LF"),
    "lf-value": (b"HTTP/1.1 200 OK\r\nX-A: a\nSet-Cookie: pwned=1\r\n" + OK, "bare LF"),
    "cr-status": (b"HTTP/1.1 200 OK\rSet-Cookie: pwned=1\r\n" + OK, "a CR"),
    "cr-value": (b"HTTP/1.1 200 OK\r\nX-A: a\rSet-Cookie: pwned=1\r\n" + OK, "a CR"),
    "nul-value": (b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\n" + OK, "NUL"),
    "nul-name": (b"HTTP/1.1 200 OK\r\nX\x00A: ab\r\n" + OK, "NUL"),
    "101": (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n"
            b"HTTP/1.1 200 OK\r\n" + OK, "101 Switching Protocols"),
    "interim-5000": (CONTINUE * 5000 + b"HTTP/1.1 200 OK\r\n" + OK,
                     f"more than {MAX_INTERIM} interim"),
    "interim-33": (CONTINUE * (MAX_INTERIM + 1) + b"HTTP/1.1 200 OK\r\n" + OK,
                   f"more than {MAX_INTERIM} interim"),
    "code-600": (b"HTTP/1.1 600 Beyond\r\n" + OK, "bad status line"),
    "code-099": (b"HTTP/1.1 099 Below\r\n" + OK, "bad status line"),
    "code-1000": (b"HTTP/1.1 1000 Long\r\n" + OK, "bad status line"),
    "http-2": (b"HTTP/2.0 200 OK\r\n" + OK, "bad status line"),
    "http-1.2": (b"HTTP/1.2 200 OK\r\n" + OK, "bad status line"),
    "folded": (b"HTTP/1.1 200 OK\r\nX-A: a\r\n Set-Cookie: pwned=1\r\n" + OK, "folded"),
    "bad-name": (b"HTTP/1.1 200 OK\r\nX A: b\r\n" + OK, "bad header line"),
    "value-control": (b"HTTP/1.1 200 OK\r\nX-A: a\x01b\r\n" + OK, "control character"),
    "value-del": (b"HTTP/1.1 200 OK\r\nX-A: a\x7fb\r\n" + OK, "control character"),
    "length-list": (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok", "Content-Length"),
    "length-twice": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + OK, "Content-Length"),
    "length-19-digits": (b"HTTP/1.1 200 OK\r\nContent-Length: 0000000000000000002\r\n\r\nok",
                         "Content-Length"),
    "length-and-chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n" + OK,
                           "beside Transfer-Encoding"),
    "coding-gzip": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nok",
                    "Transfer-Encoding"),
    "coding-list": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n"
                    b"0\r\n\r\n", "Transfer-Encoding"),
    "coding-twice": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: "
                     b"chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", "Transfer-Encoding"),
    "interim-http10": (b"HTTP/1.0 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n" + OK,
                       "interim (1xx) response that closes"),
    "interim-close": (b"HTTP/1.1 103 Early Hints\r\nConnection: x, Close\r\n\r\n"
                      b"HTTP/1.1 200 OK\r\n" + OK, "interim (1xx) response that closes"),
    "interim-two-lengths": (b"HTTP/1.1 100 Continue\r\nContent-Length: 1\r\nContent-Length: 2"
                            b"\r\n\r\nHTTP/1.1 200 OK\r\n" + OK, "Content-Length"),
}


class Side:
    """One engine client on a MemoryReactorClock, and the engine's side of its
    connection: `connect()` makes the attempt the client asked for."""

    def __init__(self, kind: str) -> None:
        self.reactor = MemoryReactorClock()
        self.http: Any
        if kind == "reference":
            self.http = EngineClient(self.reactor, EnginePool(self.reactor), 5.0)
        else:
            self.http = UpstreamClient(self.reactor, UpstreamPool(self.reactor), 5.0)
        self.transports: list[StringTransport] = []

    def connect(self) -> Protocol:
        host, port, factory, _, _ = self.reactor.tcpClients[len(self.transports)]
        protocol = factory.buildProtocol(IPv4Address("TCP", host, port))
        transport = StringTransport()
        protocol.makeConnection(transport)
        self.transports.append(transport)
        return protocol  # type: ignore[no-any-return]

    def answer(self, *parts: bytes) -> list[Any]:
        """A request, answered by the engine with `parts` (one read each): what
        the request's Deferred gave, if it fired."""
        got: list[Any] = []
        self.http.request("POST", URL, data=b"{}").addBoth(got.append)
        protocol = self.connect()
        assert self.transports[-1].value().startswith(b"POST /v1/chat/completions ")
        for part in parts:
            protocol.dataReceived(part)
        return got


def refused(got: list[Any]) -> str:
    """The request failed around BadResponse: its text, as the 502 says it."""
    [failure] = got
    assert isinstance(failure, Failure), failure
    assert failure.check(ResponseNeverReceived, ResponseFailed), failure
    [reason] = failure.value.reasons
    assert reason.check(BadResponse), reason
    return describe(failure.value)


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_hostile_head_fails_the_request_and_closes_the_connection(
        client: str, case: str) -> None:
    """Each hostile head, in one read: the request fails with BadResponse, whose
    text says what was wrong, and the engine connection is aborted."""
    raw, word = REFUSED[case]
    side = Side(client)
    why = refused(side.answer(raw))
    assert word in why, why
    assert side.transports[-1].disconnected


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("case", ["lf-status", "cr-value", "nul-value", "101", "folded",
                                  "value-control", "length-and-chunked", "interim-close"])
def test_a_hostile_head_is_refused_wherever_its_bytes_are_cut(client: str, case: str) -> None:
    """The same heads in two reads, cut at every byte: refused each time (a
    bare LF or a CR is seen whether its neighbour came in the same read or not)."""
    raw, _ = REFUSED[case]
    for at in range(1, len(raw)):
        side = Side(client)
        refused(side.answer(raw[:at], raw[at:]))


@pytest.mark.parametrize("client", CLIENTS)
def test_a_head_without_crlf_is_refused_before_the_engine_ends_it(client: str) -> None:
    """An engine whose head has bare LFs and never a CRLFCRLF is not waited for
    (until the header timeout): the first bare LF refuses it."""
    side = Side(client)
    why = refused(side.answer(b"HTTP/1.1 200 OK\n"))
    assert "bare LF" in why


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("split", [False, True])
def test_up_to_32_interim_heads_are_passed_over(client: str, split: bool) -> None:
    """MAX_INTERIM 100 Continue heads (in one read, or one read each) are
    passed over; the final response is the request's, its body whole."""
    side = Side(client)
    heads = [CONTINUE] * MAX_INTERIM + [b"HTTP/1.1 200 OK\r\n" + OK]
    got = side.answer(*heads) if split else side.answer(b"".join(heads))
    [response] = got
    assert response.code == 200
    body: list[Any] = []
    read_body(response).addBoth(body.append)
    assert body == [b"ok"]


@pytest.mark.parametrize("client", CLIENTS)
def test_the_engines_phrase_is_not_kept_in_anything_the_proxy_relays(client: str) -> None:
    """An unknown code with any phrase is a response (the proxy writes its own
    status line); a status line without a phrase is one too."""
    side = Side(client)
    [response] = side.answer(b"HTTP/1.1 299 Quite <b>fine</b>\r\n" + OK)
    assert response.code == 299
    [response] = Side(client).answer(b"HTTP/1.1 404\r\n" + OK)
    assert response.code == 404


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("relay", ["plain", "raw"])
def test_headers_the_connection_header_names_are_not_relayed(client: str, relay: str) -> None:
    """The engine's Connection header reaches the relay on either client
    (Twisted's parser sets it apart; the watch puts it back), and either relay
    drops it and every header it names, however they are spelled; the others pass."""
    side = Side(client)
    [response] = side.answer(
        b"HTTP/1.1 200 OK\r\nX-Secret: 1\r\nConnection: x-secret, X-Other\r\n"
        b"x-other: 2\r\nConnection: keep-alive\r\nX-Kept: 3\r\n" + OK)
    assert response.headers.getRawHeaders(b"Connection") == [b"x-secret, X-Other",
                                                             b"keep-alive"]
    out = Headers()
    copy = client_response_headers if relay == "plain" else raw_response_headers
    copy(response.headers, response.length, out, False)
    names = {name.lower() for name, _ in out.getAllRawHeaders()}
    assert names == {b"x-kept", b"content-length"}


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("relay", ["plain", "raw"])
@pytest.mark.parametrize("spelled", [b"Vary", b"vary"])
def test_an_engines_vary_is_added_to_the_proxys_own(client: str, relay: str,
                                                    spelled: bytes) -> None:
    """The proxy's `Vary: Origin` (an allowed CORS origin) stays when the engine
    sends a Vary of its own, on either client and either relay; the engine's
    Access-Control-* headers never pass."""
    [response] = Side(client).answer(
        b"HTTP/1.1 200 OK\r\n" + spelled + b": Accept-Encoding\r\n"
        b"Access-Control-Allow-Origin: *\r\n" + OK)
    out = Headers()
    out.setRawHeaders(b"vary", [b"Origin"])
    copy = client_response_headers if relay == "plain" else raw_response_headers
    copy(response.headers, response.length, out, False)
    assert out.getRawHeaders(b"vary") == [b"Origin", b"Accept-Encoding"]
    assert out.getRawHeaders(b"access-control-allow-origin") is None


OWNED_BY_THE_ENGINE = (b"X-Request-Id: engine-7\r\nRetry-After: 99999\r\n"
                      b"x-ratelimit-remaining-requests: 1000000\r\n"
                      b"X-RateLimit-Limit-Tokens: 1\r\nX-LLMProxy-Model: other\r\n"
                      b"x-llmproxy-anything: 1\r\nX-Kept: 3\r\n")


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("relay", ["plain", "raw"])
def test_the_proxys_own_headers_are_never_taken_from_an_engine(client: str,
                                                               relay: str) -> None:
    """X-Request-Id, Retry-After, x-ratelimit-* and X-LLMProxy-* are the proxy's
    (web.relay.PROXY_OWNED): on either client and either relay, the values the
    proxy set stand, those it did not set stay unset, and the engine's other
    headers pass."""
    [response] = Side(client).answer(b"HTTP/1.1 200 OK\r\n" + OWNED_BY_THE_ENGINE + OK)
    out = Headers()
    out.setRawHeaders(b"X-Request-Id", [b"req-1"])
    out.setRawHeaders(b"x-ratelimit-remaining-requests", [b"4"])
    copy = client_response_headers if relay == "plain" else raw_response_headers
    copy(response.headers, response.length, out, False)
    assert sorted((n.lower(), v) for n, vs in out.getAllRawHeaders() for v in vs) == [
        (b"content-length", b"2"), (b"x-kept", b"3"),
        (b"x-ratelimit-remaining-requests", b"4"), (b"x-request-id", b"req-1")]


def test_the_watch_checks_each_byte_once_and_stops_at_the_final_head() -> None:
    """HeadWatch byte by byte: a CR at the end of a read is checked again with
    the LF that follows; after the final head nothing is looked at (a body may
    hold anything), and `expect` starts over."""
    watch = HeadWatch()
    watch.expect()
    for byte in CONTINUE + b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n":
        assert watch.feed(bytes([byte])) is None
    assert not watch.watching and watch.connection == [b"close"]
    assert watch.feed(b"\n\x00\r") is None            # body bytes: not watched
    watch.expect()
    assert watch.watching and watch.connection == []
    assert watch.feed(b"HTTP/1.1 200 OK\r") is None
    assert watch.feed(b"X") is not None


def _engine(answer: bytes) -> tuple[Any, Deferred[None]]:
    """A raw-socket engine on 127.0.0.1 that answers each request with `answer`
    and keeps the connection open; its port, and a Deferred that fires when
    the proxy's side closes a connection of its."""
    from twisted.internet import reactor

    lost: Deferred[None] = Deferred()

    class Hostile(Protocol):
        def dataReceived(self, data: bytes) -> None:
            self.transport.write(answer)  # type: ignore[union-attr]

        def connectionLost(self, reason: Failure = connectionDone) -> None:
            if not lost.called:
                lost.callback(None)

    port = reactor.listenTCP(0, Factory.forProtocol(Hostile),  # type: ignore[attr-defined]
                             interface="127.0.0.1")
    return port, lost


@pytest.fixture(params=CLIENTS)
def tcp_client(request: pytest.FixtureRequest) -> Iterator[Any]:
    from twisted.internet import reactor

    if request.param == "reference":
        pool: Any = EnginePool(reactor)
        yield EngineClient(reactor, pool, 5.0)
    else:
        pool = UpstreamPool(reactor)
        yield UpstreamClient(reactor, pool, 5.0)
    pool.closeCachedConnections()


@pytest.mark.integration
@pytest.mark.parametrize("case", ["lf-all", "cr-value", "nul-value", "101", "interim-5000"])
@pytest_twisted.ensureDeferred
async def test_over_tcp_a_hostile_head_fails_at_once_and_its_connection_closes(
        tcp_client: Any, case: str) -> None:
    """A raw-socket engine on 127.0.0.1 that answers a hostile head and keeps its
    connection open: the request fails with BadResponse at once (no wait for
    a timeout) and the engine sees its connection closed."""
    from twisted.internet import reactor

    raw, word = REFUSED[case]
    port, lost = _engine(raw)
    try:
        d = tcp_client.request("POST", f"http://127.0.0.1:{port.getHost().port}/v1/x",
                               data=b"{}")
        got: list[Any] = []
        await d.addBoth(got.append).addTimeout(5, reactor)
        assert word in refused(got)
        await lost.addTimeout(5, reactor)
    finally:
        await port.stopListening()
