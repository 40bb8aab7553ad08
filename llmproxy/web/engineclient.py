"""The reference HTTP client to the engines, on public Twisted and treq:
`treq.HTTPClient` over `Agent.usingEndpointFactory` with `EnginePool`, an
`HTTPConnectionPool` that checks a cached connection before it hands it out.
The speedup `llmproxy.speedups.engineclient` keeps the same promises, cheaper.

What it promises, as the proxy uses it (web/forward.py, web/relay.py):

- Streaming: `request(..., unbuffered=True)` fires with the response at its
  headers; `deliverBody` hands the body on as it arrives, and the body
  protocol's transport pauses, resumes and stops (closes) the engine connection.
- Cancelling the request before the headers closes its connection (it fails
  with ResponseNeverReceived or CancelledError).
- No redirects are followed, and no cookie is kept: an engine's Set-Cookie
  never reaches another request (the cookie jar reads none, and its policy
  stores nothing); it is relayed to its own client like any other header.
- No content decoding: treq wraps every request in Twisted's
  ContentDecoderAgent (no public way leaves it out), which would ask for gzip
  and inflate an answer without bound; web.treqlayers' IdentityAgent, under
  it, asks engines for `Accept-Encoding: identity` and keeps an answer's
  Content-Encoding from it, so an encoded answer is relayed as the engine sent
  it (its coding and length), as by the fast client.
- Each response head is held to web.enginehead's rules before Twisted's
  parser reads it (no bare LF, no CR or NUL in it, at most 32 interim 1xx
  heads, no 101, an unambiguous framing...), and a chunked body's framing to
  llhttp's (web.enginewatch.WatchedConnection): a head they refuse fails the
  request with BadResponse, a framing they refuse ends the body so. The
  response's headers keep the engine's Connection header (Twisted's parser
  sets it apart), so the relay can drop what it names.
- The request target goes as the client sent it, percent-encoded where a URI
  needs it (`request_target`).
- A bytes body goes out at once, its length known (`BytesBody`), not through
  FileBodyProducer's cooperator.
- A cached connection the engine closed (EOF waiting), or with bytes nobody
  asked for waiting, is never used: the pool drops it and takes the next.
- A request written to an engine is never sent again unless it is
  idempotent and bodiless (GET, HEAD: RESENDABLE), or the engine never read
  it: an engine that read a POST whole and closed unanswered looks, from here,
  like an idle close that crossed the request, so a POST goes again only where
  nothing of it was written (Twisted's RequestNotSent), or where the engine
  closed and then reset the connection on the bytes sent, unread
  (enginewatch.refused_after_close: the common form of an idle close crossing
  a request). A GET or HEAD on a REUSED connection that ended (closed or
  reset by the engine, not aborted here) before one byte of an answer, or a
  POST the engine so refused unread, goes once more on a fresh connection. A fresh
  connection's failure is never retried here. Twisted's own retry is off
  (`retryAutomatically`).
"""

from __future__ import annotations

import re
import select
import socket
from collections.abc import Hashable
from http.cookiejar import CookiePolicy
from typing import Any

from treq.client import HTTPClient as TreqClient
from treq.cookies import IndexableCookieJar
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    wrapClientTLS,
)
from twisted.internet.error import ConnectError, ConnectionAborted, ConnectionDone, ConnectionLost
from twisted.internet.interfaces import (
    IConsumer,
    IProtocolFactory,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.python.failure import Failure
from twisted.web.client import (
    URI,
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    RequestTransmissionFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer, IPolicyForHTTPS
from zope.interface import implementer

from llmproxy.web.enginewatch import WatchedConnection, WatchedFactory
from llmproxy.web.treqlayers import IdentityAgent, restore_coding

RESENDABLE = frozenset({b"GET", b"HEAD"})   # sent again after an idle close crossed them


class CrossedClose(ResponseNeverReceived):
    """The request went out on a reused connection as the engine closed it (an
    engine closes a keep-alive connection idle for its own timeout): the
    connection ended, cleanly or reset, before a byte of an answer. The close
    and the request crossed, and an engine closing a connection takes no
    request from it; the request may go once more, on a fresh connection. An
    engine that failed on the request looks the same here: the second try, on
    a fresh connection, then fails as the engine does (refused, or closed
    unanswered: a 502), and is not sent a third time."""


def closed_by_peer(connection: Any) -> bool:
    """Whether an idle pooled connection can no longer carry a request: the peer
    closed it (EOF waits), it failed, or bytes nobody asked for wait on it."""
    if getattr(connection, "state", None) != "QUIESCENT":
        return False          # the pool skips it itself (its connection was lost)
    try:
        sock = connection.transport.getHandle()
    except AttributeError:    # a lost connection has no socket any more
        return True
    if not isinstance(sock, socket.socket):
        return False          # not a socket (TLS, a test double): nothing to check
    fd = sock.fileno()
    if fd < 0:
        return True           # closed on this side
    # Anything to read (data, or EOF: b"" from an idle server is no better) or an
    # error or hang-up: it cannot carry a request. One poll(0), consuming nothing.
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


@implementer(IAgentEndpointFactory)
class EngineEndpoints:
    """One endpoint per scheme, host and port, made once, each with the connect
    timeout; https ones verified by `tls` (lifecycle.upstreamtls). An IP address
    is connected to directly; only a name goes through the resolver."""

    def __init__(self, reactor: Any, connect_timeout: float,
                 tls: IPolicyForHTTPS | None = None) -> None:
        self._reactor = reactor
        self._timeout = connect_timeout
        self._tls = tls or BrowserLikePolicyForHTTPS()
        self._made: dict[tuple[bytes, bytes, int], IStreamClientEndpoint] = {}

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        key = (uri.scheme, uri.host, uri.port)
        endpoint = self._made.get(key)
        if endpoint is None:
            endpoint = self._made[key] = self._make(uri)
        return endpoint

    def _make(self, uri: URI) -> IStreamClientEndpoint:
        host = uri.host.decode("ascii")
        endpoint: IStreamClientEndpoint
        if isIPAddress(host):
            endpoint = TCP4ClientEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        elif isIPv6Address(host):
            endpoint = TCP6ClientEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        else:
            endpoint = HostnameEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        if uri.scheme == b"https":
            return wrapClientTLS(self._tls.creatorForNetloc(uri.host, uri.port), endpoint)
        return endpoint


@implementer(IBodyProducer)
class BytesBody:
    """A request body of bytes, written whole in `startProducing` (again on each
    call: a request sent once more writes it again)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.length = len(data)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        if self.data:
            consumer.write(self.data)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


@implementer(IStreamClientEndpoint)
class _Connecting:
    """The endpoint EnginePool hands HTTPConnectionPool.getConnection: `asked`
    once the pool connects through it (a new connection: that is the only
    reason HTTPConnectionPool calls an endpoint's connect). Each connection is
    made under a `WatchedConnection`; the pool gets the HTTP protocol itself. Without an
    endpoint it refuses to connect (EnginePool.drop_idle)."""

    def __init__(self, endpoint: IStreamClientEndpoint | None,
                 clock: IReactorTime | None = None) -> None:
        self.endpoint = endpoint
        self.clock = clock
        self.asked = False

    def connect(self, factory: IProtocolFactory) -> Deferred[Any]:
        self.asked = True
        # No "Starting factory" / "Stopping factory" log lines per engine
        # connection (Factory.noisy, public).
        factory.noisy = False     # type: ignore[attr-defined]
        if self.endpoint is None:
            return fail(ConnectError("only cached connections were wanted"))
        made: Deferred[Any] = self.endpoint.connect(WatchedFactory(factory, self.clock))
        return made.addCallback(lambda watched: watched.wrappedProtocol)


def _crossed(failure: Failure) -> bool:
    """The request failed because its connection ended (closed or reset by
    the peer, not aborted here) before the whole exchange was over."""
    if not failure.check(ResponseNeverReceived, RequestTransmissionFailed):
        return False
    return any(reason.check(ConnectionDone, ConnectionLost) is not None and
               reason.check(ConnectionAborted) is None for reason in _reasons(failure))


def _reasons(failure: Failure) -> list[Failure]:
    """The failures a Twisted client exception (ResponseFailed and the like) wraps."""
    reasons: list[Failure] = getattr(failure.value, "reasons", [])
    return reasons


class _Watched:
    """A connection as EnginePool hands it to the Agent, which calls `request`
    on it at once: its answer's head is held to enginehead's rules (see
    WatchedConnection), and the response's headers get the engine's Connection
    header back (see HeadWatch.connection_header)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def request(self, request: Any) -> Deferred[Any]:
        watched: WatchedConnection = self.connection.transport
        watched.expect(request.method == b"HEAD")
        d: Deferred[Any] = self.connection.request(request)
        return d.addCallback(watched.watch.connection_header)


class _Reused(_Watched):
    """A cached connection as EnginePool hands it out: a request whose answer
    never began because the engine's idle close crossed it goes once more on a
    fresh connection, or fails with CrossedClose when its body streams."""

    def __init__(self, connection: Any, pool: EnginePool, key: Hashable,
                 endpoint: IStreamClientEndpoint) -> None:
        super().__init__(connection)
        self.pool, self.key, self.endpoint = pool, key, endpoint

    def request(self, request: Any) -> Deferred[Any]:
        d = super().request(request)
        return d.addErrback(self._again, request, self.connection.transport)

    def _again(self, failure: Failure, request: Any, watched: WatchedConnection) -> Any:
        if watched.heard or not _crossed(failure) or \
                (request.method not in RESENDABLE and not watched.unread):
            return failure     # (a POST the engine may have read is never sent twice)
        body = request.bodyProducer
        if body is not None and not isinstance(body, BytesBody):
            self.pool.drop_idle(self.key)    # the caller's second try finds a fresh one
            return Failure(CrossedClose(_reasons(failure)))
        again: Deferred[Any] = self.pool.fresh(self.key, self.endpoint)
        return again.addCallback(lambda connection: _Watched(connection).request(request))


class EnginePool(HTTPConnectionPool):
    """HTTPConnectionPool that never hands out a cached connection the engine
    has closed, and resends a request its idle close crossed (see `_Reused`).

    The invariant it rests on: HTTPConnectionPool.getConnection either returns
    a cached connection without touching the endpoint, or connects through the
    endpoint for a new one. So a getConnection that did not connect through
    its `_Connecting` handed out a cached (reused) connection; every
    connection the pool holds was made through a `_Connecting`, so it has a
    `WatchedConnection` as its transport."""

    retryAutomatically = False      # _Reused decides what is sent again

    def __init__(self, reactor: Any, persistent: bool = True) -> None:
        super().__init__(reactor, persistent)
        self.clock: IReactorTime = reactor     # times each connection's wait for a reset

    def getConnection(self, key: Hashable, endpoint: IStreamClientEndpoint) -> Deferred[Any]:
        """A cached connection that can carry a request, else a new one."""
        connecting = _Connecting(endpoint, self.clock)
        d: Deferred[Any] = super().getConnection(key, connecting)
        if connecting.asked:
            return d.addCallback(_Watched)
        return d.addCallback(self._hand_out, key, endpoint)

    def _hand_out(self, connection: Any, key: Hashable,
                  endpoint: IStreamClientEndpoint) -> Any:
        if closed_by_peer(connection):
            connection.transport.loseConnection()
            return self.getConnection(key, endpoint)     # the next one, or a new one
        return _Reused(connection, self, key, endpoint)

    def fresh(self, key: Hashable, endpoint: IStreamClientEndpoint) -> Deferred[Any]:
        """A new connection (the cached ones for `key` are closed first: the
        engine closing one of them under a request may be closing the others)."""
        self.drop_idle(key)
        return super().getConnection(key, _Connecting(endpoint, self.clock))

    def drop_idle(self, key: Hashable) -> None:
        """Close every cached connection for `key`."""
        while True:
            refusing = _Connecting(None)
            d: Deferred[Any] = super().getConnection(key, refusing)
            if refusing.asked:           # none was left: it asked for a new one
                d.addErrback(lambda _: None)
                return
            d.addCallback(lambda connection: connection.transport.loseConnection())


class NoCookies(CookiePolicy):
    """A cookie policy that stores and sends no cookie: what one request's
    engine sets never reaches another request."""

    netscape, rfc2965, hide_cookie2 = True, False, False   # what CookieJar reads

    def set_ok(self, cookie: Any, request: Any) -> bool:
        return False

    def return_ok(self, cookie: Any, request: Any) -> bool:
        return False

    def domain_return_ok(self, domain: str, request: Any) -> bool:
        return False

    def path_return_ok(self, path: str, request: Any) -> bool:
        return False


class NoCookieJar(IndexableCookieJar):
    """treq's cookie jar under NoCookies that does not even read an engine's
    Set-Cookie headers: Twisted's CookieAgent reads them as ASCII, so one with
    another byte would fail the request (the fast client relays it)."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None


def _escaped(found: re.Match[str]) -> str:
    char = found.group()
    return "".join(f"%{byte:02X}" for byte in
                   char.encode("latin-1" if ord(char) < 256 else "utf-8"))


_NOT_AS_IS = re.compile(r"[^\x21-\x7e]|#")


def request_target(url: str) -> str:
    """`url` ready for treq, whose URL handling (hyperlink) percent-encodes
    what a URI may not hold raw: a byte outside printable ASCII (the proxy
    passes a client's request target decoded as latin-1) goes as its own %XX
    here, where hyperlink would encode its character as UTF-8, and `#` as %23,
    where hyperlink would cut a fragment off. The engine is asked for the
    bytes the client sent, percent-encoded where a URI needs it (the fast
    client sends them raw); hyperlink also drops an empty query (`/v1/models?`)."""
    if url.isascii() and "#" not in url and url.isprintable():
        return url
    return _NOT_AS_IS.sub(_escaped, url)


class EngineClient:
    """The proxy's client to its engines: treq over an Agent with `pool`
    (an EnginePool), no redirects, no cookies kept, no content decoding (see
    the module docstring)."""

    def __init__(self, reactor: Any, pool: EnginePool, connect_timeout: float,
                 tls: IPolicyForHTTPS | None = None) -> None:
        self._reactor = reactor
        agent = Agent.usingEndpointFactory(
            reactor, EngineEndpoints(reactor, connect_timeout, tls), pool=pool)
        self.treq = TreqClient(IdentityAgent(agent), cookiejar=NoCookieJar(policy=NoCookies()))

    def request(self, method: str, url: str, *, data: bytes | IBodyProducer = b"",
                headers: Headers | None = None, unbuffered: bool = True,
                allow_redirects: bool = False) -> Deferred[Any]:
        body: IBodyProducer | None = None
        if IBodyProducer.providedBy(data):
            body = data            # a body that streams (a multipart form) is its own producer
        elif data or method == "POST":
            body = BytesBody(bytes(data))
        d: Deferred[Any] = self.treq.request(
            method, request_target(url), data=body, headers=headers, unbuffered=unbuffered,
            allow_redirects=allow_redirects, reactor=self._reactor)
        return d.addCallback(restore_coding)

    def get(self, url: str) -> Deferred[Any]:
        return self.request("GET", url)

