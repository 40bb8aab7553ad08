"""The HTTP client to the engines: Twisted's Agent directly, endpoints made once
per host, and a pool of persistent connections checked before reuse so a
request never goes out on one the engine has already closed.

An engine closes an idle keep-alive connection after its own timeout. If that
close and the proxy's next request cross, the request is written to a dead
connection and fails; Twisted retries only idempotent requests, and a POST may
not be retried once a byte of it was sent. So a cached connection is checked
first (a non-blocking peek at its socket): one the engine has closed (EOF) or
that has unexpected bytes waiting is dropped and the next one, or a fresh
connection, is used. Nothing was written on the dropped one.
"""

from __future__ import annotations

import socket
from collections.abc import Hashable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.web._newclient import HTTP11ClientProtocol
from twisted.web.client import (
    URI,
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    _HTTP11ClientFactory,
    _StandardEndpointFactory,
    readBody,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer, IPolicyForHTTPS
from zope.interface import implementer


class _WatchedProtocol(HTTP11ClientProtocol):
    """A client connection that says when the engine closes it while it is idle."""

    on_idle_close: Any = None

    def _connectionLost_QUIESCENT(self, reason: Any) -> None:
        super()._connectionLost_QUIESCENT(reason)
        if self.on_idle_close is not None:
            self.on_idle_close()


class _QuietFactory(_HTTP11ClientFactory):
    noisy = False  # no "Starting factory" line per upstream connection

    def buildProtocol(self, addr: Any) -> HTTP11ClientProtocol:
        return _WatchedProtocol(self._quiescentCallback)


def closed_by_peer(connection: Any) -> bool:
    """Whether an idle pooled connection can no longer carry a request: the peer
    closed it (a peek reads EOF), it failed, or bytes nobody asked for wait on it."""
    if getattr(connection, "state", None) != "QUIESCENT":
        return False          # the pool skips it itself (its connection was lost)
    try:
        sock = connection.transport.getHandle()
    except AttributeError:    # a lost connection has no socket any more
        return True
    if not isinstance(sock, socket.socket):
        return False          # not a socket (a test double): nothing to check
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False          # nothing to read: open and idle, as it should be
    except OSError:
        return True
    return True               # b"" is EOF; data from an idle server is no better


class UpstreamPool(HTTPConnectionPool):
    """An HTTPConnectionPool that never hands out a connection the engine closed,
    nor one idle so long that the engine may be closing it right now.

    The peek sees a close that has arrived; a close still on its way when the
    request goes out is the race left. So the pool learns, per engine, after how
    long idle the engine closes connections (it watches pooled connections
    close), and does not reuse one idle for most of that time: it opens a fresh
    connection instead.
    """

    _factory = _QuietFactory
    REUSE_FRACTION = 0.75      # of the shortest idle time after which an engine closed one

    def __init__(self, reactor: Any, persistent: bool = True) -> None:
        super().__init__(reactor, persistent)
        self._idle_since: dict[Any, float] = {}
        self.engine_idle_close: dict[Hashable, float] = {}

    def getConnection(self, key: Hashable, endpoint: IStreamClientEndpoint) -> Deferred[Any]:
        connections = self._connections.get(key)
        limit = self.engine_idle_close.get(key)
        now = self._reactor.seconds()
        while connections and (closed_by_peer(connections[0]) or (
                limit is not None and now - self._idle_since.get(connections[0], now)
                >= limit * self.REUSE_FRACTION)):
            old = connections[0]
            self._timeouts[old].cancel()
            self._removeConnection(key, old)
        return super().getConnection(key, endpoint)

    def _putConnection(self, key: Hashable, connection: Any) -> None:
        super()._putConnection(key, connection)
        if connection in self._timeouts:       # it was cached
            self._idle_since[connection] = self._reactor.seconds()
            connection.on_idle_close = lambda: self._closed(key, connection)

    def _removeConnection(self, key: Hashable, connection: Any) -> None:
        self._idle_since.pop(connection, None)
        super()._removeConnection(key, connection)

    def _closed(self, key: Hashable, connection: Any) -> None:
        """The engine closed a connection idle in the pool after that long idle:
        remember the shortest such time for this engine."""
        since = self._idle_since.pop(connection, None)
        if since is not None and connection in self._connections.get(key, []):
            idle = self._reactor.seconds() - since
            known = self.engine_idle_close.get(key)
            self.engine_idle_close[key] = idle if known is None else min(known, idle)


@implementer(IBodyProducer)
class BytesProducer:
    """A request body that is already whole: written at once, with its length."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer: Any) -> Deferred[None]:
        consumer.write(self._data)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


@implementer(IAgentEndpointFactory)
class _Endpoints:
    """One endpoint per scheme, host and port, made once (making one per request
    costs IDNA encoding and more, every time)."""

    def __init__(self, reactor: Any, connect_timeout: float,
                 tls: IPolicyForHTTPS | None = None) -> None:
        self._standard = _StandardEndpointFactory(reactor, tls or BrowserLikePolicyForHTTPS(),
                                                  connect_timeout, None)
        self._made: dict[tuple[bytes, bytes, int], IStreamClientEndpoint] = {}

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        key = (uri.scheme, uri.host, uri.port)
        endpoint = self._made.get(key)
        if endpoint is None:
            endpoint = self._made[key] = self._standard.endpointForURI(uri)
        return endpoint


class AgentClient:
    """The HTTP client to the engines: Twisted's Agent with no layers on top (no
    redirects, no cookies, no content decoding: a proxy passes bodies through)."""

    def __init__(self, reactor: Any, pool: HTTPConnectionPool, connect_timeout: float,
                 tls: IPolicyForHTTPS | None = None) -> None:
        # `tls`: how https engines are verified (lifecycle.upstreamtls).
        self._agent = Agent.usingEndpointFactory(
            reactor, _Endpoints(reactor, connect_timeout, tls), pool=pool)

    def request(self, method: str, url: str, *, data: bytes | IBodyProducer = b"",
                headers: Headers | None = None, unbuffered: bool = True,
                allow_redirects: bool = False) -> Deferred[Any]:
        # A body that streams (a multipart form, see multipart.py) is its own producer.
        body: IBodyProducer | None = data if IBodyProducer.providedBy(data) else \
            BytesProducer(data) if data or method == "POST" else None
        d: Deferred[Any] = self._agent.request(method.encode("ascii"), url.encode("latin-1"),
                                               headers or Headers(), body)
        return d

    def get(self, url: str) -> Deferred[Any]:
        return self.request("GET", url)


def read_body(response: Any) -> Deferred[bytes]:
    """A response's whole body (for the small ones: rosters, error details)."""
    return readBody(response)
