"""The HTTP face: the Site, its request class, and the path dispatch."""

from __future__ import annotations

import json
from typing import Any
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from llmproxy.hosts.catalog import Catalog
from llmproxy.lifecycle.reload import APPLIED, ReloadResult
from llmproxy.observe.requests import CLIENT_GONE, COMPLETED, Exchange, InFlight
from llmproxy.web.errors import write_error
from llmproxy.web.forward import Forwarder


class App(TypingProtocol):
    """What the web layer needs of the running service."""

    inflight: InFlight
    forwarder: Forwarder

    @property
    def catalog(self) -> Catalog: ...

    @property
    def ready(self) -> bool: ...

    def status(self) -> dict[str, Any]: ...

    def reload_requested(self) -> Deferred[ReloadResult] | None: ...


class ProxyRequest(Request):
    """A request that stops keeping its body once it passes max_body_bytes, and
    says `Connection: close` on a response that starts while the proxy stops."""

    body_too_large = False
    _received = 0

    def process(self) -> None:
        # The whole request is in: from now on it is an exchange in flight.
        if isinstance(self.channel, ProxyChannel):
            self.channel.dispatched += 1
        super().process()

    def write(self, data: bytes) -> None:
        if not self.startedWriting and getattr(self.channel, "closing", False):
            self.setHeader(b"connection", b"close")
            self.channel.persistent = False
        super().write(data)

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self._limit():
            self.body_too_large = True
            length = 0
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        self._received += len(data)
        if self._received > self._limit():
            self.body_too_large = True
        if not self.body_too_large:
            super().handleContentChunk(data)

    def _limit(self) -> int:
        site = getattr(self.channel, "site", None)
        return int(getattr(site, "max_body_bytes", 1 << 62))


class ProxyChannel(http.HTTPChannel):
    """An HTTP/1.1 connection the site keeps track of, so a stop can close the
    idle ones and make the busy ones close after their current response."""

    site: ProxySite
    dispatched = 0      # requests on this connection handed to the resource so far

    @property
    def closing(self) -> bool:
        return self.site.closing

    @property
    def idle(self) -> bool:
        """A keep-alive connection between requests: it served one, and nothing
        of the next has arrived."""
        return self.dispatched > 0 and not self.requests

    @property
    def unserved(self) -> bool:
        """Accepted, but its first request is not in yet: closing it would lose
        a request the client has probably already sent."""
        return self.dispatched == 0

    def connectionMade(self) -> None:
        super().connectionMade()
        self.site.channels.add(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.site.channels.discard(self)
        super().connectionLost(reason)

    def checkPersistence(self, request: Any, version: bytes) -> bool:
        if self.site.closing:
            # The header alone would not do: Twisted would read the next request.
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        return bool(super().checkPersistence(request, version))


class ProxySite(Site):
    """The Site; our own access log replaces Twisted's."""

    requestFactory = ProxyRequest
    # Plain HTTP/1.1 channels (no TLS here, so no h2 negotiation to lose).
    protocol = ProxyChannel  # type: ignore[assignment]
    noisy = False
    displayTracebacks = False

    def __init__(self, root: Resource, max_body_bytes: int, reactor: Any = None) -> None:
        super().__init__(root, reactor=reactor)
        self.max_body_bytes = max_body_bytes
        self.channels: set[ProxyChannel] = set()
        self.closing = False

    def log(self, request: http.Request) -> None:
        pass

    def unserved(self) -> list[ProxyChannel]:
        """Connections whose first request has not arrived yet."""
        return [c for c in self.channels if c.unserved]

    def start_closing(self) -> int:
        """From now on every response closes its connection; idle keep-alive
        connections are closed now (a connection still waiting for its first
        request is not: its request is served, with `Connection: close`).
        Returns how many were closed."""
        self.closing = True
        idle = [c for c in self.channels if c.idle]
        for channel in self.channels:
            # A connection busy with a request closes once it is answered. Not a
            # fresh one: HTTPChannel drops every byte that arrives on a
            # non-persistent connection between requests, its first request
            # included; its checkPersistence says close when that request comes.
            if channel.requests:
                channel.persistent = False
        for channel in idle:
            channel.loseConnection()
        return len(idle)


def _json(request: Request, status: int, doc: Any) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"cache-control", b"no-store")
    return json.dumps(doc, indent=None).encode("utf-8") + b"\n"


class Root(Resource):
    """Dispatches every path; unknown ones get an OpenAI-style 404."""

    isLeaf = True
    log = Logger()

    def __init__(self, app: App) -> None:
        super().__init__()
        self.app = app

    def render(self, request: Request) -> bytes | int:
        method = request.method.decode("latin-1")
        path = request.path.decode("latin-1")
        client = getattr(request.getClientAddress(), "host", "unknown")
        exchange = self.app.inflight.begin(method, path, client)
        # At a drain deadline: drop the connection, never finish(): the client
        # must see a truncated response, not a clean end.
        exchange.abort = request.channel.transport.abortConnection  # type: ignore[union-attr]
        request.setHeader(b"x-request-id", exchange.id.encode())
        d = Deferred.fromCoroutine(self._dispatch(request, exchange, method, path))
        d.addErrback(self._bug, request, exchange)
        d.addCallback(lambda outcome: self.app.inflight.end(exchange, outcome, exchange.detail))
        return NOT_DONE_YET

    async def _dispatch(self, request: Request, exchange: Exchange, method: str,
                        path: str) -> str:
        catalog = self.app.catalog          # one snapshot for the whole request
        get_only = {"/healthz", "/readyz", "/status", "/v1/models"}
        if path in get_only or path.startswith("/v1/models/"):
            if method not in ("GET", "HEAD"):
                return self._error(request, exchange, 405, f"{path} takes GET",
                                   "method_not_allowed")
            if path.startswith("/v1/models/"):
                name = path[len("/v1/models/"):]
                if catalog.resolve(name) is None:
                    return self._error(request, exchange, 404,
                                       f"The model '{name}' does not exist", "model_not_found")
            exchange.status, body = self._get(request, catalog, path)
            exchange.bytes_sent = len(body)
            request.write(body)
            request.finish()
            return COMPLETED
        if path == "/admin/reload":
            return await self._reload(request, exchange, method)
        if path.startswith("/v1/"):
            if method != "POST":
                return self._error(request, exchange, 405, f"{path} takes POST",
                                   "method_not_allowed")
            return await self.app.forwarder.handle(request, exchange, catalog)
        return self._error(request, exchange, 404, f"no such path: {path}", "not_found")

    async def _reload(self, request: Request, exchange: Exchange, method: str) -> str:
        """`llmproxy reload`'s endpoint: reload and say what happened, to loopback only."""
        if method != "POST":
            return self._error(request, exchange, 405, "/admin/reload takes POST",
                               "method_not_allowed")
        client = getattr(request.getClientAddress(), "host", "")
        if not _loopback(client):
            return self._error(request, exchange, 403, "/admin/reload answers loopback only",
                               "forbidden")
        pending = self.app.reload_requested()
        if pending is None:
            return self._error(request, exchange, 503, "the proxy is stopping", "stopping")
        result = await pending
        status = 200 if result.outcome == APPLIED else 409
        exchange.status = status
        body = _json(request, status, result.as_dict())
        exchange.bytes_sent = len(body)
        request.write(body)
        request.finish()
        return COMPLETED

    def _get(self, request: Request, catalog: Catalog, path: str) -> tuple[int, bytes]:
        if path == "/healthz":
            return 200, _json(request, 200, {"status": "alive"})
        if path == "/readyz":
            ready = self.app.ready
            status = 200 if ready else 503
            return status, _json(request, status, {"ready": ready})
        if path == "/status":
            return 200, _json(request, 200, self.app.status())
        if path == "/v1/models":
            return 200, _json(request, 200, catalog.model_list())
        route = catalog.resolve(path[len("/v1/models/"):])
        assert route is not None
        return 200, _json(request, 200, route.describe())

    def _error(self, request: Request, exchange: Exchange, status: int, message: str,
               code: str) -> str:
        exchange.status = status
        exchange.bytes_sent = write_error(request, status, message, code)
        return COMPLETED

    def _bug(self, failure: Failure, request: Request, exchange: Exchange) -> str:
        self.log.failure("bug while answering {id}", failure, id=exchange.id)
        if request.startedWriting or getattr(request, "_disconnected", False):
            request.channel.loseConnection()
            return CLIENT_GONE if getattr(request, "_disconnected", False) else "failed"
        exchange.status = 500
        write_error(request, 500, "internal error in llmproxy (logged)", "internal_error")
        return "failed"



def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host.removeprefix("::ffff:")).is_loopback
    except ValueError:
        return False
