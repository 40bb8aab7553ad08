"""The door and the dispatch: what answers each path of the table in web/paths.py.

A path with a dot segment (`.` or `..`, raw or percent-encoded, between `/` or
`\\`) is refused with 400 before anything else looks at it: the proxy never
forwards a path an engine could resolve to another of its routes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from llmproxy.config.keys import ApiKey
from llmproxy.core.redact import redact_doc
from llmproxy.core.text import shown
from llmproxy.hosts.catalog import Catalog
from llmproxy.hosts.fleet import Fleet
from llmproxy.observe.capture import CaptureRing
from llmproxy.observe.eventstream import EventLog
from llmproxy.observe.inflight import CLIENT_GONE, COMPLETED, Exchange, InFlight
from llmproxy.observe.metrics import CONTENT_TYPE, Metrics
from llmproxy.web import captures
from llmproxy.web.access import Access, Admitted, Refusal
from llmproxy.web.admin import admin, cross_site_refusal
from llmproxy.web.cutoff import abort_client, cut_short
from llmproxy.web.energybudget import CODE as ENERGY_CODE
from llmproxy.web.energybudget import ENERGY
from llmproxy.web.errors import not_allowed, write_error
from llmproxy.web.forward import Forwarder
from llmproxy.web.hostlog import PATH as HOST_LOG_PATH
from llmproxy.web.hostlog import HostLogs
from llmproxy.web.origin import CROSS_SITE, api_cross_site_refusal
from llmproxy.web.paths import GET, Answer, Page, Route, route
from llmproxy.web.requeststate import client_host
from llmproxy.web.site import ProxyRequest
from llmproxy.web.turns import Turns
from llmproxy.web.unread import dotted, refused_unread
from llmproxy.web.usage import estimate

# How long a standby's refused model request is asked to wait before it retries.
STANDBY_RETRY_AFTER = 5
# How long a refused event-stream subscriber is asked to wait before it retries.
EVENTS_RETRY_AFTER = 5


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
    clock: IReactorTime
    captures: CaptureRing | None        # None: capture is off
    turns: Turns                        # new requests' set-ups, a slice per loop turn

    @property
    def catalog(self) -> Catalog: ...

    @property
    def ready(self) -> bool: ...

    @property
    def standby(self) -> bool:
        """Whether the proxy waits, as a standby, for the hosts' leases."""

    def status(self) -> dict[str, Any]: ...

    def reload(self) -> Deferred[Any] | None:
        """A reload's ReloadOutcome, or None while the proxy stops."""

    def upgrade_requested(self) -> Deferred[dict[str, Any]]:
        """Start an upgrade; its record once handed over, failed or ignored."""


def _json(request: ProxyRequest, status: int, doc: Any) -> str:
    body = json.dumps(doc, indent=None).encode("utf-8") + b"\n"
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"cache-control", b"no-store")
    request.write(body)
    request.finish()
    return COMPLETED


@dataclass(frozen=True)
class Asked:
    """A request let in by the door, as its route's handler gets it."""

    request: ProxyRequest
    exchange: Exchange
    path: str
    verdict: Admitted
    catalog: Catalog        # one snapshot for the whole request, as its key sees it


Handler = Callable[[Asked], str | Coroutine[Any, Any, str]]


class Root(Resource):
    """The door and the dispatch: every path is looked up in the path table
    (web/paths.py) and answered by its route's handler; a method the route
    does not take is a 405 whose Allow lists those it does; an unknown path an
    OpenAI-style 404. Its requests are ProxyRequests (its site's
    requestFactory): their `state` is the record the modules past the door read."""

    isLeaf = True
    log = Logger()

    def __init__(self, app: App, page: Page | None = None) -> None:
        super().__init__()
        self.app = app
        self.host_logs = HostLogs(app.clock)
        self.page = page if page is not None else Page.load()
        self._handlers: dict[Answer, Handler] = {
            Answer.PAGE: self._page,
            Answer.HEALTH: lambda asked: _json(asked.request, 200, {"status": "alive"}),
            Answer.READY: self._ready, Answer.STATUS: self._status,
            Answer.METRICS: self._metrics, Answer.MODELS: self._models,
            Answer.MODEL: self._model, Answer.RELOAD: self._reload,
            Answer.UPGRADE: self._upgrade,
            Answer.ACTION: lambda asked: admin(asked.request, asked.path, self.app.fleet),
            Answer.API: self._api, Answer.CAPTURES: self._captures,
        }

    def render(self, request: ProxyRequest) -> int:
        if not isinstance(request, ProxyRequest):
            raise TypeError(f"Root answers ProxyRequests, not {type(request).__name__}")
        method = request.method.decode("latin-1")
        path = request.path.decode("latin-1")
        found = route(path)
        if found is not None and found.streamed and not request.state.body_too_large \
                and not dotted(request.path):
            return self._streamed(request, method, path, found)
        exchange = self.app.inflight.begin(method, path, client_host(request))
        request.state.exchange = exchange
        # At a drain deadline: drop the connection, never finish(): the client
        # must see a truncated response, not a clean end.
        exchange.on_abort(lambda: abort_client(request))
        request.responseHeaders.setRawHeaders(b"X-Request-Id", [exchange.id.encode()])
        ring = self.app.captures
        if ring is not None and found is not None and found.answer is Answer.API \
                and not request.state.body_too_large:
            captures.start(ring, request, method, path)
        d = Deferred.fromCoroutine(self._dispatch(request, exchange, method, path, found))
        d.addErrback(self._bug, request, exchange)
        d.addCallback(lambda outcome: self.app.inflight.end(exchange, outcome))
        if ring is not None:
            d.addCallback(lambda _: captures.finish(ring, request, exchange))
        return NOT_DONE_YET

    def _streamed(self, request: ProxyRequest, method: str, path: str, found: Route) -> int:
        """The event stream or an engine's log: let in by the door, then served
        outside the requests in flight."""
        verdict = self.app.access.check(request, path)
        if isinstance(verdict, Refusal):
            _refuse(request, verdict)
        elif method not in found.methods:
            not_allowed(request, shown(path), found.methods)
        elif found.answer is Answer.HOST_LOG:
            self._host_log(request, path, verdict.key is not None)
        else:
            self._events(request, self.app.access.sees_logs(request, verdict))
        return NOT_DONE_YET

    async def _dispatch(self, request: ProxyRequest, exchange: Exchange, method: str,
                        path: str, found: Route | None) -> str:
        await self.app.turns.take()     # a burst of arrivals yields to the running streams
        if self.app.access.cors.mark(request, path) and method == "OPTIONS":
            self.app.access.cors.preflight(request)     # before the door: it has no key
            return COMPLETED
        if refused_unread(request, path, self.app.catalog.config.max_body_bytes):
            return COMPLETED
        verdict = self.app.access.check(request, path)
        if isinstance(verdict, Refusal):
            return _refuse(request, verdict)
        if verdict.key is not None:
            exchange.authenticated(verdict.key.name, verdict.key.priority)
        request.state.credentials = verdict.credentials
        if found is None:
            return _error(request, 404, f"no such path: {shown(path)}", "not_found")
        if found.admin and method not in GET:
            refused = self._cross_site(request, method, path, verdict.key is not None)
            if refused is not None:
                return refused
        if method not in found.methods:
            not_allowed(request, shown(path), found.methods)
            return COMPLETED
        answer = self._handlers[found.answer](
            Asked(request, exchange, path, verdict, verdict.scoped(self.app.catalog)))
        return answer if isinstance(answer, str) else await answer

    async def _api(self, asked: Asked) -> str:
        """An API request (POST), under its key's rate limits, forwarded."""
        request, exchange, path = asked.request, asked.exchange, asked.path
        key, catalog = asked.verdict.key, asked.catalog
        if self.app.standby:
            request.setHeader(b"retry-after", str(STANDBY_RETRY_AFTER).encode())
            return _error(request, 503, "this llmproxy is a standby: it serves no model "
                          "until it holds every managed host's lease", "standby")
        cors = self.app.access.cors.allowed(request, path) is not None
        foreign = api_cross_site_refusal(request.requestHeaders, request.isSecure(), cors)
        if foreign is not None:
            exchange.note(foreign)
            return _error(request, 403, f"POST {shown(path)} refused: {foreign}", CROSS_SITE)
        settling = None if key is None else self.app.access.settling(key)
        if settling is not None:     # an upgrade's successor: the key's use so far is coming
            await settling
        budgets = self.app.access.energy
        wait = None if key is None or budgets is None else budgets.refuse(key, exchange.id)
        if key is not None and wait is not None:
            message = (f"Energy budget spent for key {key.name}: {key.wh_per_day:g} Wh per day. "
                       f"Please try again in {wait}s (at 00:00 UTC).")
            exchange.note(message)
            request.setHeader(b"retry-after", str(wait).encode())
            write_error(request, 429, message, ENERGY_CODE, ENERGY)
            return COMPLETED
        if key is None or (key.rpm is None and key.tpm is None):
            return await self.app.forwarder.handle(request, exchange, catalog)
        return await self.app.forwarder.handle(
            request, exchange, catalog,
            lambda body, size: self._over_limit(request, exchange, key, body, size),
            metered=key.tpm is not None)

    def _over_limit(self, request: ProxyRequest, exchange: Exchange, key: ApiKey,
                    body: dict[str, Any], size: int) -> bool:
        """Count the request (its `body`, `size` bytes) against its key's rate
        limits (web/ratelimit.py), reserving its estimated tokens under a `tpm`,
        and set their headers; refuse it (429, Retry-After) when over one."""
        limits = self.app.access.limits
        verdict = limits.admit(key, exchange.id, estimate(body, size)) \
            if limits is not None else None
        if verdict is None:
            return False
        for name, value in verdict.headers:
            request.responseHeaders.setRawHeaders(name, [value])
        if verdict.refused is None:
            return False
        per = "requests" if verdict.refused == "requests" else "tokens"
        message = (f"Rate limit reached for key {key.name} on {per} per minute: limit "
                   f"{key.rpm if per == 'requests' else key.tpm}. Please try again in "
                   f"{verdict.retry_after}s.")
        exchange.note(message)
        request.setHeader(b"retry-after", str(verdict.retry_after).encode())
        write_error(request, 429, message, "rate_limit_exceeded", verdict.refused)
        return True

    def _ready(self, asked: Asked) -> str:
        ready = self.app.ready
        doc: dict[str, Any] = {"ready": ready}
        if self.app.standby:
            doc |= {"code": "standby", "waiting_for": self.app.fleet.leases.waiting_for()}
        return _json(asked.request, 200 if ready else 503, doc)

    def _status(self, asked: Asked) -> str:
        doc = self.app.status()
        sees_logs = self.app.access.sees_logs(asked.request, asked.verdict)
        return _json(asked.request, 200, doc if sees_logs else redact_doc(doc))

    def _metrics(self, asked: Asked) -> str:
        request = asked.request
        request.setHeader(b"content-type", CONTENT_TYPE.encode())
        request.setHeader(b"cache-control", b"no-store")
        request.write(self.app.metrics.exposition())
        request.finish()
        return COMPLETED

    def _models(self, asked: Asked) -> str:
        return _json(asked.request, 200, asked.catalog.model_list(self.app.fleet.model_state))

    def _model(self, asked: Asked) -> str:
        name = asked.path[len("/v1/models/"):]
        found = asked.catalog.resolve(name)
        if found is None:
            return _error(asked.request, 404, f"The model '{shown(name)}' does not exist",
                          "model_not_found")
        return _json(asked.request, 200, found.describe(self.app.fleet.model_state(found)))

    def _cross_site(self, request: ProxyRequest, method: str, path: str,
                    keyed: bool) -> str | None:
        """No admin action is taken (whatever its method, before its 405) for
        another site's page or through a name that is not the proxy's (see
        `admin`); who may ask at all is the door's rule (`access`)."""
        refusal = cross_site_refusal(request.requestHeaders, request.isSecure(), keyed,
                                     self.app.catalog.config.server_names)
        if refusal is None:
            return None
        code, reason = refusal
        # path is one of the admin paths; the method is the client's word
        plain = method.isascii() and method.isalpha() and len(method) <= 16
        what = f"{method} {path}" if plain else path
        self.log.warn("refused {what} from {client}: {reason}",
                      what=what, client=client_host(request), reason=reason)
        write_error(request, 403, f"{what} refused: {reason}", code)
        return COMPLETED

    async def _reload(self, asked: Asked) -> str:
        """`llmproxy reload`'s endpoint: reload and say what happened."""
        pending = self.app.reload()
        if pending is None:
            return _error(asked.request, 503, "the proxy is stopping", "stopping")
        result: ReloadOutcome = await pending
        return _json(asked.request, 200 if result.applied else 409, result.as_dict())

    async def _upgrade(self, asked: Asked) -> str:
        """`llmproxy upgrade`'s endpoint: upgrade, and answer once this process has
        handed over (200) or the candidate failed or was not started (409)."""
        result = await self.app.upgrade_requested()
        return _json(asked.request, 200 if result.get("outcome") == "handed over" else 409,
                     result)

    def _events(self, request: ProxyRequest, sees_logs: bool) -> None:
        """The event stream: not a request in flight, so it never holds a drain."""
        if self.app.events.closed:
            write_error(request, 503, "the proxy is stopping", "stopping")
        elif self.app.events.streams >= (cap := self.app.catalog.config.max_event_subscribers):
            request.setHeader(b"retry-after", str(EVENTS_RETRY_AFTER).encode())
            write_error(request, 503, "too many event-stream subscribers: this proxy "
                        f"serves at most {cap} at once (max_event_subscribers); retry later",
                        "too_many_subscribers")
        else:
            self.app.events.attach(request, lambda: abort_client(request), sees_logs)

    def _host_log(self, request: ProxyRequest, path: str, keyed: bool) -> None:
        """An engine's log (web/hostlog.py): like the event stream, not a request in
        flight. A read, yet refused like an admin action when a web page may have sent it
        (see `admin`): a log may quote prompts, and a rebound DNS name is same-origin."""
        m = HOST_LOG_PATH.fullmatch(path)
        assert m is not None        # its route says so
        refusal = cross_site_refusal(request.requestHeaders, request.isSecure(), keyed,
                                     self.app.catalog.config.server_names)
        if refusal is not None:
            self.log.warn("refused GET {path} from {client}: {reason}", path=shown(path),
                          client=client_host(request), reason=refusal[1])
            write_error(request, 403, f"GET {shown(path)} refused: {refusal[1]}", refusal[0])
        elif self.app.events.closed:
            write_error(request, 503, "the proxy is stopping", "stopping")
        else:
            self.host_logs.serve(request, self.app.fleet, m.group(1))

    def _captures(self, asked: Asked) -> str:
        """The captures (web/captures.py): a read, yet refused like an admin action
        when a web page may have sent it (a capture quotes prompts; see `admin`)."""
        request, path = asked.request, asked.path
        refusal = cross_site_refusal(request.requestHeaders, request.isSecure(),
                                     asked.verdict.key is not None,
                                     self.app.catalog.config.server_names)
        if refusal is not None:
            return _error(request, 403, f"GET {shown(path)} refused: {refusal[1]}", refusal[0])
        return captures.serve(request, path, self.app.captures)

    def _page(self, asked: Asked) -> str:
        """The status page or one of its assets, from memory."""
        self.page.serve(asked.request, asked.path)
        return COMPLETED

    def _bug(self, failure: Failure, request: ProxyRequest, exchange: Exchange) -> str:
        self.log.failure("bug while answering {id}", failure, id=exchange.id)
        gone = request.state.client_gone
        if request.startedWriting or gone:
            cut_short(request)
            return CLIENT_GONE if gone else "failed"
        write_error(request, 500, "internal error in llmproxy (logged)", "internal_error")
        return "failed"


def _refuse(request: ProxyRequest, refusal: Refusal) -> str:
    if refusal.challenge:
        request.setHeader(b"www-authenticate", b'Basic realm="llmproxy", charset="UTF-8"')
    write_error(request, refusal.status, refusal.message, refusal.code, refusal.type_)
    return COMPLETED


def _error(request: ProxyRequest, status: int, message: str, code: str) -> str:
    write_error(request, status, message, code)
    return COMPLETED
