"""The fast HTTP client to the engines (speedup `engine_client`): one connection
is engineconnection's H1Connection (its responses read by httptools, llhttp),
the pool keeps them checked before reuse, and the relay frames each read's data
as one chunk to the client (relaychunks.ChunkRelay). It keeps every promise of
the reference client (web/engineclient.py), cheaper.

An engine closes an idle keep-alive connection after its own timeout. If that
close and the proxy's next request cross, the request is written to a dead
connection and fails, and a POST may not be retried once a byte of it was sent.
So a cached connection is checked first (a poll of its socket that waits for nothing):
one the engine has closed (EOF) or that has unexpected bytes waiting is dropped
and the next one, or a fresh connection, is used. Nothing was written on the dropped one.

A close still on its way when the request goes out is the race left: the
request and the close cross, and the connection ends with not a byte of an
answer. An engine that read a POST whole and closed unanswered looks the same
from here, so a GET or HEAD goes once more, on a fresh connection
(`CrossedClose`), and a POST only where the engine, after its close, reset the
connection on the request unread (web.enginewatch.refused_after_close); any
other POST fails (it was written: the engine may have read it).
The pool learns from the crossing how long that engine keeps idle connections,
and reuses none idle that long again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from twisted.internet.defer import Deferred, fail, gatherResults
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.python.failure import Failure
from twisted.web.client import URI, RequestNotSent  # type: ignore[attr-defined]
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IPolicyForHTTPS

from llmproxy.speedups import Speedup, socketwrites
from llmproxy.speedups.engineconnection import H1Connection
from llmproxy.speedups.enginemessage import UpstreamResponse
from llmproxy.speedups.guards import changed_sources
from llmproxy.web.engineclient import CrossedClose, EngineEndpoints, closed_by_peer


class UpstreamPool:
    """Idle connections to the engines, per (scheme, host, port), that never hands
    out one the engine closed, nor one idle so long that the engine may be
    closing it right now.

    The check sees a close that has arrived; a close still on its way when the
    request goes out is the race left. So the pool learns, per engine, after how
    long idle the engine closes connections (from a response's `Keep-Alive:
    timeout=N`, which llama-server sends, and from idle connections it watches
    close, and requests the close crossed), and does not reuse one idle for
    most of that time: it opens a fresh connection instead.
    """

    REUSE_FRACTION = 0.75      # of the shortest idle time after which an engine closed one
    maxPersistentPerHost = 2   # idle connections kept per engine
    cachedConnectionTimeout = 240.0

    def __init__(self, reactor: IReactorTime, persistent: bool = True) -> None:
        self._reactor = reactor
        self.persistent = persistent
        self._idle: dict[Hashable, list[H1Connection]] = {}
        self._idle_since: dict[H1Connection, float] = {}
        # One timer for every idle connection's expiry, at the earliest one (a
        # timer set and cancelled per request cost more than the request's
        # own pool work).
        self._sweep: IDelayedCall | None = None
        self.engine_idle_close: dict[Hashable, float] = {}

    def fresh(self, key: Hashable, endpoint: IStreamClientEndpoint) -> Deferred[H1Connection]:
        """A new connection, for the pool once it is idle."""
        connection = H1Connection(lambda c: self._put(key, c), lambda c: self._lost(key, c),
                                  self._reactor)
        made: Deferred[Any] = endpoint.connect(_OneConnection(connection))
        return made

    def idle_connection(self, key: Hashable) -> H1Connection | None:
        """An idle connection that can carry a request, if there is one; the
        others looked at on the way are closed."""
        idle = self._idle.get(key)
        if not idle:
            return None
        limit = self.engine_idle_close.get(key)
        now = self._reactor.seconds()
        while idle:
            connection = idle.pop()             # the most recently used
            since = self._forget(connection)
            if connection.usable() and not closed_by_peer(connection) and (
                    limit is None or now - since < limit * self.REUSE_FRACTION):
                connection.idle_for = now - since
                return connection
            connection.transport.loseConnection()
        return None

    def _put(self, key: Hashable, connection: H1Connection) -> None:
        if connection.keep_alive is not None:
            self._learn(key, connection.keep_alive)
        idle = self._idle.setdefault(key, [])
        if not self.persistent or len(idle) >= self.maxPersistentPerHost:
            connection.transport.loseConnection()
            return
        idle.append(connection)
        self._idle_since[connection] = self._reactor.seconds()
        if self._sweep is None:
            self._sweep = self._reactor.callLater(self.cachedConnectionTimeout, self._expire)

    def _forget(self, connection: H1Connection) -> float:
        """Take `connection` off the idle books; since when it was idle."""
        return self._idle_since.pop(connection, self._reactor.seconds())

    def _expire(self) -> None:
        """Close the connections idle for cachedConnectionTimeout; come back at
        the next one's time, while any is idle."""
        self._sweep = None
        now, timeout = self._reactor.seconds(), self.cachedConnectionTimeout
        next_at: float | None = None
        for key, idle in list(self._idle.items()):
            for connection in list(idle):
                at = self._idle_since.get(connection, now) + timeout
                if at <= now:
                    self._remove(key, connection)
                    connection.transport.loseConnection()
                else:
                    next_at = at if next_at is None else min(next_at, at)
        if next_at is not None:
            self._sweep = self._reactor.callLater(next_at - now, self._expire)

    def _remove(self, key: Hashable, connection: H1Connection) -> float | None:
        idle = self._idle.get(key, [])
        if connection not in idle:
            return None
        idle.remove(connection)
        return self._forget(connection)

    def _lost(self, key: Hashable, connection: H1Connection) -> None:
        """The engine closed a connection idle in the pool after that long idle,
        or one reused after that long idle as the request went out (crossed):
        remember the shortest such time for this engine."""
        since = self._remove(key, connection)
        if since is not None:
            self._learn(key, self._reactor.seconds() - since)
        elif connection.crossed and connection.idle_for is not None:
            self._learn(key, connection.idle_for)

    def _learn(self, key: Hashable, idle: float) -> None:
        """The engine closes connections idle for `idle` seconds (or sooner)."""
        known = self.engine_idle_close.get(key)
        if known is None or idle < known:
            self.engine_idle_close[key] = idle

    def closeCachedConnections(self) -> Deferred[list[None]]:
        """Close every idle connection; fires once they are all gone."""
        if self._sweep is not None and self._sweep.active():
            self._sweep.cancel()
        self._sweep = None
        waits = []
        for key, idle in list(self._idle.items()):
            for connection in list(idle):
                self._remove(key, connection)
                waits.append(connection.lost)
                connection.transport.loseConnection()
        return gatherResults(waits)


class _OneConnection(Factory):
    """Builds the one connection it was made for (Twisted's connectProtocol, but
    without a "Starting factory" log line per engine connection), once: it lets
    go of it then (Twisted's connector keeps this factory, and the connection
    keeps the connector: a cycle only the garbage collector would free), and a
    second connection of the same attempt gets none (Twisted refuses it)."""

    noisy = False

    def __init__(self, connection: H1Connection) -> None:
        self._connection: H1Connection | None = connection

    def buildProtocol(self, addr: Any) -> H1Connection | None:
        connection, self._connection = self._connection, None
        return connection


class _Target:
    """Where a base URL (scheme://host:port) goes: its pool key, endpoint and Host."""

    def __init__(self, base: str, endpoints: EngineEndpoints) -> None:
        uri = URI.fromBytes(base.encode("latin-1") + b"/")
        self.key: Hashable = (uri.scheme, uri.host, uri.port)
        self.endpoint = endpoints.endpointForURI(uri)
        default = {b"http": 80, b"https": 443}.get(uri.scheme)
        self.host = uri.host if uri.port == default else b"%s:%d" % (uri.host, uri.port)


class UpstreamClient:
    """The HTTP client to the engines (see engineconnection): no redirects, no cookies,
    no content decoding (a proxy passes bodies through)."""

    def __init__(self, reactor: Any, pool: UpstreamPool, connect_timeout: float,
                 tls: IPolicyForHTTPS | None = None) -> None:
        # `tls`: how https engines are verified (lifecycle.upstreamtls).
        self._pool = pool
        self._endpoints = EngineEndpoints(reactor, connect_timeout, tls)
        self._targets: dict[str, _Target] = {}

    def request(self, method: str, url: str, *, data: bytes | IBodyProducer = b"",
                headers: Headers | None = None, unbuffered: bool = True,
                allow_redirects: bool = False) -> Deferred[Any]:
        # A body that streams (a multipart form, see multipart.py) is its own producer.
        body: bytes | IBodyProducer | None = data if data or method == "POST" else None
        if not isinstance(data, bytes) and IBodyProducer.providedBy(data):
            body = data
        at = url.find("/", url.find("://") + 3)
        base, path = (url, "/") if at < 0 else (url[:at], url[at:])
        target = self._targets.get(base)
        if target is None:
            target = self._targets[base] = _Target(base, self._endpoints)
        verb, where, sent = method.encode("ascii"), path.encode("latin-1"), headers or Headers()

        def send(connection: H1Connection) -> Deferred[UpstreamResponse]:
            if not connection.usable():
                raise RequestNotSent()       # it went away before a byte was written
            return connection.request(verb, where, target.host, sent, body)

        idle = self._pool.idle_connection(target.key)
        if idle is not None:            # usable: the pool has just checked
            try:
                answer = idle.request(verb, where, target.host, sent, body)
            except Exception:       # as from a callback: the caller's errback hears it
                return fail()
            if body is None or isinstance(body, bytes):
                answer.addErrback(self._again, target, send)
            return answer
        d: Deferred[Any] = self._pool.fresh(target.key, target.endpoint)
        return d.addCallback(send)

    def _again(self, failure: Failure, target: _Target,
               send: Callable[[H1Connection], Deferred[UpstreamResponse]]) -> Deferred[Any]:
        """The engine's idle close crossed the request on a reused connection:
        once more, on a fresh one (any other failure goes on to the caller)."""
        failure.trap(CrossedClose)
        return self._pool.fresh(target.key, target.endpoint).addCallback(send)

    def get(self, url: str) -> Deferred[Any]:
        return self.request("GET", url)



# The Twisted code the fast client copies or rests on, as of Twisted 26.10,
# besides socketwrites's (TCP reads and writes): the endpoint's wrapper it steps
# past, the transport's abort flag, the connector it unties, the Headers
# storage it fills and reads directly (canonical names; values with no CR or
# LF, as web.enginehead's check leaves them), the name encoder and its cache,
# and Request.write, which ChunkRelay stands in for on a chunked response
# under way.
SOURCES = {
    "twisted.internet.endpoints._WrappingProtocol": "f2b6afac24b407ec",
    "twisted.internet.tcp._AbortingMixin": "c077c543c350c2f9",
    "twisted.internet.base.BaseConnector": "fe6c0c84bc7cc002",
    "twisted.internet.tcp.Connector": "e7e902e31a356ab1",
    "twisted.internet.tcp.BaseClient.connectionLost": "0967364629c2cc75",
    "twisted.web.http_headers.Headers": "ebc7ea69e2f2ce3b",
    "twisted.web.http_headers._NameEncoder": "bc4cb5fc115811cd",
    "twisted.web.http.Request.write": "0e547d4f76bd1472",
}


HTTPTOOLS = (0, 6)        # the oldest httptools whose parser the connection uses


def parser_missing() -> str | None:
    """Why the connection's parser (httptools) cannot be used, or None."""
    try:
        import httptools
    except ImportError as e:
        return f"httptools (llhttp), its response parser, is not installed: {e}"
    version = tuple(int(part) for part in httptools.__version__.split(".")[:2]
                    if part.isdigit())
    if version < HTTPTOOLS:
        return f"httptools {httptools.__version__} is older than 0.6"
    return None


def guard() -> str | None:
    """None when httptools is installed and the installed Twisted is the one the
    fast client was written against (Twisted 26.10)."""
    return parser_missing() or socketwrites.guard() or changed_sources(SOURCES)


SPEEDUP = Speedup(
    "engine_client",
    "the engine exchange: responses read by httptools (llhttp) straight from the "
    "socket, each read's data relayed as one chunk, idle connections reused by what "
    "the engine said",
    guard)
