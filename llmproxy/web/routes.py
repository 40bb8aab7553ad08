"""The path dispatch: which paths exist, which methods they take, and who answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from llmproxy.hosts.catalog import Catalog
from llmproxy.hosts.fleet import Fleet
from llmproxy.observe.eventstream import EventLog
from llmproxy.observe.metrics import CONTENT_TYPE, Metrics
from llmproxy.observe.requests import CLIENT_GONE, COMPLETED, Exchange, InFlight
from llmproxy.web.access import Access, Refusal
from llmproxy.web.admin import ADMIN_PATHS, admin
from llmproxy.web.errors import write_error
from llmproxy.web.forward import Forwarder
from llmproxy.web.site import ProxyRequest

# llama-server's own routes outside /v1/ that carry a `model`: routed like /v1/*.
LLAMA_ROUTES = frozenset({"/rerank", "/tokenize", "/detokenize", "/infill", "/embedding"})
GET_ONLY = frozenset({"/healthz", "/readyz", "/status", "/v1/models", "/metrics"})
PAGE_DIR = Path(__file__).resolve().parent.parent / "observe" / "page"
# The status page: path -> (file in observe/page, content type). No CDN, no build step.
PAGE_FILES = {
    "/": ("index.html", b"text/html; charset=utf-8"),
    "/page/app.js": ("app.js", b"text/javascript; charset=utf-8"),
    "/page/style.css": ("style.css", b"text/css; charset=utf-8"),
}


class ReloadOutcome(TypingProtocol):
    """What a reload says of itself."""

    @property
    def applied(self) -> bool: ...

    def as_dict(self) -> dict[str, Any]: ...


class App(TypingProtocol):
    """What the web layer needs of the running proxy."""

    inflight: InFlight
    forwarder: Forwarder
    fleet: Fleet
    events: EventLog
    metrics: Metrics
    access: Access

    @property
    def catalog(self) -> Catalog: ...

    @property
    def ready(self) -> bool: ...

    def status(self) -> dict[str, Any]: ...

    def reload(self) -> Deferred[Any] | None:
        """A reload's ReloadOutcome, or None while the proxy stops."""

    def upgrade_requested(self) -> Deferred[dict[str, Any]]:
        """Start an upgrade; its record once handed over, failed or ignored."""


def _json(request: Request, status: int, doc: Any) -> None:
    body = json.dumps(doc, indent=None).encode("utf-8") + b"\n"
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"cache-control", b"no-store")
    request.write(body)
    request.finish()


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
        if path == "/api/events" and not getattr(request, "body_too_large", False):
            verdict = self.app.access.check(request, path)
            if isinstance(verdict, Refusal):
                _refuse(request, verdict)
                return NOT_DONE_YET
            return self._events(request, method)
        client = getattr(request.getClientAddress(), "host", "unknown")
        exchange = self.app.inflight.begin(method, path, client)
        if isinstance(request, ProxyRequest):
            request.exchange = exchange
        # At a drain deadline: drop the connection, never finish(): the client
        # must see a truncated response, not a clean end.
        exchange.on_abort(request.channel.transport.abortConnection)  # type: ignore[union-attr]
        request.responseHeaders.setRawHeaders(b"X-Request-Id", [exchange.id.encode()])
        d = Deferred.fromCoroutine(self._dispatch(request, exchange, method, path))
        d.addErrback(self._bug, request, exchange)
        d.addCallback(lambda outcome: self.app.inflight.end(exchange, outcome))
        return NOT_DONE_YET

    async def _dispatch(self, request: Request, exchange: Exchange, method: str,
                        path: str) -> str:
        if getattr(request, "body_too_large", False):
            # Answered as soon as the body passed the limit; the channel reads
            # no more of it and closes (see bodylimit.BodyLimitChannel.body_refused).
            request.setHeader(b"connection", b"close")
            return _error(request, 413, "request body is larger than "
                          f"{self.app.catalog.config.max_body_bytes} bytes (max_body_bytes)",
                          "request_too_large")
        verdict = self.app.access.check(request, path)
        if isinstance(verdict, Refusal):
            return _refuse(request, verdict)
        if verdict.key is not None:
            exchange.authenticated(verdict.key.name)
        # One snapshot for the whole request, as the key sees it.
        catalog = verdict.scoped(self.app.catalog)
        if path in PAGE_FILES:
            if method not in ("GET", "HEAD"):
                return _error(request, 405, f"{path} takes GET", "method_not_allowed")
            return _page(request, path)
        if path in GET_ONLY or path.startswith("/v1/models/"):
            if method not in ("GET", "HEAD"):
                return _error(request, 405, f"{path} takes GET", "method_not_allowed")
            return self._get(request, catalog, path)
        if path == "/admin/reload":
            return await self._reload(request, method)
        if path == "/admin/upgrade":
            return await self._upgrade(request, method)
        if path in ADMIN_PATHS:
            return _admin_refusal(request, method, path) or await admin(request, path,
                                                                        self.app.fleet)
        if path.startswith("/v1/") or path in LLAMA_ROUTES:
            if method != "POST":
                return _error(request, 405, f"{path} takes POST", "method_not_allowed")
            return await self.app.forwarder.handle(request, exchange, catalog)
        return _error(request, 404, f"no such path: {path}", "not_found")

    def _get(self, request: Request, catalog: Catalog, path: str) -> str:
        if path == "/healthz":
            _json(request, 200, {"status": "alive"})
        elif path == "/readyz":
            ready = self.app.ready
            _json(request, 200 if ready else 503, {"ready": ready})
        elif path == "/status":
            _json(request, 200, self.app.status())
        elif path == "/metrics":
            body = self.app.metrics.exposition()
            request.setHeader(b"content-type", CONTENT_TYPE.encode())
            request.setHeader(b"cache-control", b"no-store")
            request.write(body)
            request.finish()
        elif path == "/v1/models":
            _json(request, 200, catalog.model_list())
        else:
            name = path[len("/v1/models/"):]
            route = catalog.resolve(name)
            if route is None:
                return _error(request, 404, f"The model '{name}' does not exist",
                              "model_not_found")
            _json(request, 200, route.describe())
        return COMPLETED

    async def _reload(self, request: Request, method: str) -> str:
        """`llmproxy reload`'s endpoint: reload and say what happened, to loopback only."""
        refused = _admin_refusal(request, method, "/admin/reload")
        if refused:
            return refused
        pending = self.app.reload()
        if pending is None:
            return _error(request, 503, "the proxy is stopping", "stopping")
        result: ReloadOutcome = await pending
        _json(request, 200 if result.applied else 409, result.as_dict())
        return COMPLETED

    async def _upgrade(self, request: Request, method: str) -> str:
        """`llmproxy upgrade`'s endpoint: upgrade, and answer once this process has
        handed over (200) or the candidate failed or was not started (409)."""
        refused = _admin_refusal(request, method, "/admin/upgrade")
        if refused:
            return refused
        result = await self.app.upgrade_requested()
        _json(request, 200 if result.get("outcome") == "handed over" else 409, result)
        return COMPLETED

    def _events(self, request: Request, method: str) -> int:
        """The event stream: not a request in flight, so it never holds a drain."""
        if method != "GET":
            write_error(request, 405, "/api/events takes GET", "method_not_allowed")
        elif self.app.events.closed:
            write_error(request, 503, "the proxy is stopping", "stopping")
        else:
            self.app.events.attach(request)
        return NOT_DONE_YET

    def _bug(self, failure: Failure, request: Request, exchange: Exchange) -> str:
        self.log.failure("bug while answering {id}", failure, id=exchange.id)
        gone = getattr(request, "client_gone", False)      # a ProxyRequest's
        if request.startedWriting or gone:
            request.channel.loseConnection()
            return CLIENT_GONE if gone else "failed"
        write_error(request, 500, "internal error in llmproxy (logged)", "internal_error")
        return "failed"


def _admin_refusal(request: Request, method: str, path: str) -> str | None:
    """Admin actions take POST (who may ask is the door's rule, see `access`)."""
    if method != "POST":
        return _error(request, 405, f"{path} takes POST", "method_not_allowed")
    return None


def _refuse(request: Request, refusal: Refusal) -> str:
    if refusal.challenge:
        request.setHeader(b"www-authenticate", b'Basic realm="llmproxy", charset="UTF-8"')
    write_error(request, refusal.status, refusal.message, refusal.code, refusal.type_)
    return COMPLETED


def _page(request: Request, path: str) -> str:
    name, content_type = PAGE_FILES[path]
    body = (PAGE_DIR / name).read_bytes()
    request.setHeader(b"content-type", content_type)
    request.setHeader(b"cache-control", b"no-cache")
    request.write(body)
    request.finish()
    return COMPLETED


def _error(request: Request, status: int, message: str, code: str) -> str:
    write_error(request, status, message, code)
    return COMPLETED
