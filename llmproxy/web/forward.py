"""Forwarding one API request to the engine that serves its model, streaming.

The request's model is resolved through the catalog snapshot it started with; it first takes
a lease in its host's queue (a slot, and on a managed host its engine: it may wait for a
switch), with SSE comment pings for a streaming client while it waits (see `queuewait`). The
answer is relayed chunk by chunk (see `relay`). A client that goes away cancels the upstream
at once: before the headers by cancelling the request, after them by closing the upstream
connection.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from typing import Protocol as TypingProtocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from llmproxy.core.deadlines import Deadlines
from llmproxy.core.failures import describe
from llmproxy.core.text import shown
from llmproxy.hosts.catalog import Catalog, fallback_chain
from llmproxy.hosts.choose import Chooser
from llmproxy.hosts.host import Host
from llmproxy.hosts.queueerrors import ProxyStopping, QueueFull, QueueTimeout, SwitchFailed
from llmproxy.observe.inflight import CLIENT_GONE, COMPLETED, UPSTREAM_FAILED, Exchange
from llmproxy.observe.queueview import QueueView
from llmproxy.web.attempt import (
    Attempt,
    NotSent,
    Unavailable,
    Upstream,
    nothing_sent,
    session_of,
    upstream_body,
)
from llmproxy.web.energyhead import say_energy
from llmproxy.web.enginesilence import SilenceWatches
from llmproxy.web.errorbody import error_text
from llmproxy.web.errors import write_error
from llmproxy.web.multipart import Form, FormError, is_multipart
from llmproxy.web.queuewait import (
    RETRY_CORDONED,
    RETRY_QUEUE_FULL,
    RETRY_QUEUE_TIMEOUT,
    QueueWait,
    refuse,
)
from llmproxy.web.relay import Discard, Relay, sse_error
from llmproxy.web.requeststate import client_host
from llmproxy.web.site import ProxyRequest
from llmproxy.web.upstreamcall import UpstreamCall
from llmproxy.web.usage import with_usage

if TYPE_CHECKING:
    from llmproxy.observe.tracing import Tracing  # needs the [otel] extra


class HTTPClient(TypingProtocol):
    """What the proxy asks of its HTTP client to the engines (web.engineclient's
    EngineClient, or the engine_client speedup's UpstreamClient)."""

    def request(self, method: str, url: str, *, data: Any, headers: Headers,
                unbuffered: bool, allow_redirects: bool) -> Deferred[Any]: ...

    def get(self, url: str) -> Deferred[Any]: ...


class _Refused(Exception):
    """A request answered with an error before anything went upstream."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


Body = bytes | Form   # what goes upstream: JSON bytes, or a multipart form

# A model name is short: a longer `model` is refused (400), and shown cut.
MODEL_BYTES = 256           # of its UTF-8
MODEL_SHOWN = 64            # characters of it quoted in the refusal


class _Repeated(dict[str, Any]):
    """A JSON object that names a key more than once (`repeated`: the first such
    key), holding the last value as json does. Another parser (an engine's) may
    keep the first: the proxy would route and authorize by one value and the
    engine serve the other, so a body whose top level is one is refused."""

    repeated = ""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: a dict, or a _Repeated for a repeated key."""
    doc = dict(pairs)
    if len(doc) < len(pairs):
        doc = _Repeated(doc)
        doc.repeated = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
    return doc


_raw_decode = json.JSONDecoder(object_pairs_hook=_object).raw_decode


def _json(raw: bytes) -> Any:
    """json.loads(raw, object_pairs_hook=_object) (every object a dict; one that
    repeats a key, a _Repeated), without json.loads' encoding detection and
    whitespace scans for what a client sends nearly always: one JSON object in
    UTF-8, nothing around it. Anything else (whitespace, a BOM, another
    encoding, bad JSON) is json.loads' to read or to refuse, as before."""
    if raw[:1] == b"{" and raw[-1:] == b"}":
        try:
            text = raw.decode("utf-8")
            doc, end = _raw_decode(text)
        except ValueError:          # UnicodeDecodeError is one
            pass
        else:
            if end == len(text):
                return doc
    return json.loads(raw, object_pairs_hook=_object)


def _json_body(request: Request) -> tuple[dict[str, Any], bytes, str]:
    """The JSON body, its bytes and its model; _Refused if it is not JSON, its
    top level repeats a key, or it has no model."""
    raw = request.content.read() if request.content is not None else b""
    try:
        body = _json(raw)
    except ValueError:
        raise _Refused(400, "request body is not valid JSON", "invalid_json") from None
    except RecursionError:
        raise _Refused(400, "request body is not valid JSON: nested too deeply",
                       "invalid_json") from None
    if isinstance(body, _Repeated):
        raise _Refused(400, f'request body names "{shown(body.repeated, MODEL_SHOWN)}" more '
                       "than once (a key repeated in its top-level JSON object)",
                       "duplicate_key")
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise _Refused(400, 'request body has no "model" (a JSON string naming the model)',
                       "missing_model")
    return body, raw, model


def _parse(request: Request) -> tuple[dict[str, Any], Body, str]:
    """The JSON body, its bytes and its model (a multipart form: its `stream`,
    the form, its `model` field); _Refused if it has none of them, names its
    model twice, or names one over MODEL_BYTES (the refusal quotes at most a
    shown prefix of it). (A body over max_body_bytes never gets here: the site
    answers 413 before reading it.)"""
    body: dict[str, Any]
    raw: Body
    if is_multipart(request):
        try:
            form = Form.read(request)
        except FormError as e:
            raise _Refused(400, str(e), e.code) from None
        body, raw, model = {"stream": form.streaming}, form, form.model
    else:
        body, raw, model = _json_body(request)
    size = len(model.encode("utf-8", "surrogatepass"))
    if size > MODEL_BYTES:
        raise _Refused(400, "Invalid 'model': string too long. Expected a string with maximum "
                       f"length {MODEL_BYTES} bytes (UTF-8), but got a string of {size} bytes: "
                       f"'{shown(model, MODEL_SHOWN)}'", "string_above_max_length")
    return body, raw, model


class Forwarder:
    """Routes and forwards API requests."""

    def __init__(self, clock: IReactorTime, http: HTTPClient,
                 header_timeout: Callable[[], float],
                 chooser: Chooser | None = None,
                 successor: Callable[[], str | None] = lambda: None,
                 relay: type[Relay] = Relay, queues: QueueView | None = None,
                 energy: Callable[[str], float | None] = lambda request_id: None,
                 read_timeout: Callable[[], float] = lambda: 0.0,
                 tracing: Tracing | None = None) -> None:
        self._clock = clock
        self._energy = energy     # a request's joules so far (observe/energy.py), if measured
        self._tracing = tracing   # the requests' spans (config `tracing`), when on
        self._queues = queues     # positions and ETAs for waiting clients
        self._http = http
        self._header_timeout = header_timeout
        # Answers whose engine may fall silent (engine_read_timeout_seconds).
        self._silences = SilenceWatches(clock, read_timeout)
        self._deadlines = Deadlines(clock)  # every request's header timeout, on one timed call
        self._chooser = chooser
        # After an upgrade's hand-over: the new process's URL, where a request that waited
        # here for an engine switch is re-sent (nothing of it reached an engine).
        self._successor = successor
        self._relay = relay       # what relays an answer, and the headers that pass each way

    def stop(self) -> None:
        """The proxy stops: no header timeout or silence sweep is left on the reactor."""
        self._deadlines.stop()
        self._silences.stop()

    async def handle(self, request: ProxyRequest, exchange: Exchange, catalog: Catalog,
                     over_limit: Callable[[dict[str, Any], int], bool] | None = None,
                     metered: bool = False) -> str:
        """Answer one API request; returns the outcome for the access log.
        `over_limit`: its key's rate limits, asked with the parsed body and its
        size once the body is read (True: it answered the request, a 429).
        `metered`: its key has a `tpm`, so a stream's usage is asked of the
        engine (web/usage.py)."""
        if self._tracing is not None:
            headers = request.requestHeaders
            self._tracing.begin(exchange, *(next(iter(headers.getRawHeaders(name, ())), None)
                                            for name in (b"traceparent", b"tracestate")))
        try:
            body, raw, model = _parse(request)
        except _Refused as e:
            write_error(request, e.status, e.message, e.code)
            return COMPLETED
        if over_limit is not None and over_limit(body, len(raw) if isinstance(raw, bytes) else 0):
            return COMPLETED
        original = raw
        counted = with_usage(request.path.decode("latin-1"), body) if metered else None
        if counted is not None and isinstance(raw, bytes):
            exchange.add_usage()
            body, raw = counted, json.dumps(counted).encode("utf-8")
        exchange.asked_for(model, streaming=body.get("stream") is True)
        route = catalog.resolve(model)
        if route is None:
            write_error(request, 404, f"The model '{shown(model)}' does not exist",
                        "model_not_found")
            return COMPLETED
        chain = fallback_chain(catalog, route) if self._chooser is not None else [route]
        committed = False
        for n, step in enumerate(chain):
            attempt = Attempt(request, exchange, step,
                              upstream_body(body, raw, model, step.upstream), original,
                              session_of(step, request, body), committed, n + 1 < len(chain))
            try:
                return await self._on_route(attempt, catalog)
            except Unavailable as e:    # nothing was sent: the next model may take it
                committed, after = attempt.committed, chain[n + 1].name
                exchange.fell_back(after, str(e))
                if not committed:
                    request.setHeader(b"x-llmproxy-model", after.encode("utf-8"))
        raise AssertionError("the last model never falls back")

    async def _on_route(self, attempt: Attempt, catalog: Catalog) -> str:
        """Try the hosts of the attempt's model in turn. Unavailable (when a
        fallback follows, `attempt.more`): none could take it, nothing was sent."""
        request, exchange, route = attempt.request, attempt.exchange, attempt.route
        if self._chooser is None:
            exchange.bound_for(route.host.name)
            return await self._forward(request, exchange, attempt.raw,
                                       Upstream(route.host.url, route.host.name, routed=True))
        gates = self._chooser.choose(route, catalog, attempt.session, exchange.id)
        if not gates:
            names = ", ".join(h.name for h in route.hosts)
            if attempt.more:
                raise Unavailable(f"cordoned: {names}")
            exchange.bound_for(route.host.name)
            return refuse(request, exchange, attempt.committed, 503, f"model {exchange.model}: "
                          f"cordoned: {names} (no new requests)", "host_cordoned", RETRY_CORDONED)
        for i, gate in enumerate(gates):
            exchange.bound_for(gate.host.name)
            last = i == len(gates) - 1
            try:
                return await self._on_host(attempt, gate, last)
            except NotSent as e:    # nothing reached an engine: the next host may have it
                if last:
                    raise Unavailable(str(e)) from None
                self._chooser.unreachable(gate, route, gates[i + 1], str(e), exchange.id)
        raise AssertionError("the last host never fails over")

    async def _on_host(self, attempt: Attempt, gate: Host, last: bool) -> str:
        """Wait in the host's queue for a lease, then forward under it. NotSent
        (unless `last` and no fallback follows): nothing of it reached this
        host's engine; Unavailable (a fallback follows): the queue is full."""
        request, exchange = attempt.request, attempt.exchange
        moves = not last or attempt.more
        wait = QueueWait(self._clock, request, exchange, gate, attempt.route.engine,
                         committed=attempt.committed, queues=self._queues)
        try:
            lease = await wait.acquire()
        except ProxyStopping:
            return await self._stopping(request, exchange, attempt.original, wait.committed)
        except SwitchFailed as e:
            attempt.committed = wait.committed
            if self._chooser is not None:
                self._chooser.start_failed(gate, attempt.route)
            message = f"model {exchange.model}: {e}"
            if moves:
                raise NotSent(str(e)) from None
            if wait.committed:
                return sse_error(request, exchange, message, 424)
            exchange.note(message)
            write_error(request, 424, message, 424, "model_unavailable")
            return UPSTREAM_FAILED
        except QueueFull as e:
            self._left(gate, attempt)
            attempt.committed = wait.committed
            if attempt.more:
                raise Unavailable(str(e)) from None
            return refuse(request, exchange, wait.committed, 429, f"model {exchange.model}: {e}",
                          "queue_full", RETRY_QUEUE_FULL, "rate_limit_error")
        except QueueTimeout as e:
            self._left(gate, attempt)
            return refuse(request, exchange, wait.committed, 503,
                          f"model {exchange.model}: {e}", "queue_timeout", RETRY_QUEUE_TIMEOUT)
        except CancelledError:
            self._left(gate, attempt)
            return CLIENT_GONE
        attempt.committed = wait.committed
        try:
            if self._chooser is not None:
                self._chooser.served(attempt.route, attempt.session, gate.host.name)
            return await self._forward(request, exchange, attempt.raw, Upstream(
                gate.host.engine_url(lease.engine), gate.host.name, lease.engine, routed=True,
                committed=wait.committed, failover=moves))
        finally:
            lease.release()

    def _left(self, gate: Host, attempt: Attempt) -> None:
        """The request left `gate`'s queue unserved: room placed for it is free again."""
        if self._chooser is not None:
            self._chooser.left(gate, attempt.route)

    async def _stopping(self, request: ProxyRequest, exchange: Exchange, original: Body,
                        committed: bool) -> str:
        """A request that waited for a switch this process will not make: re-sent,
        as the client sent it, to the process that took over, or a 503."""
        successor = self._successor()
        if successor is not None:
            exchange.note(f"re-sent to the new process at {successor}")
            return await self._forward(request, exchange, original, Upstream(
                successor, "the new process", committed=committed, successor=True))
        message = "the proxy is stopping; retry (another instance may serve it)"
        if committed:
            return sse_error(request, exchange, message, 503)
        request.setHeader(b"retry-after", b"1")
        write_error(request, 503, message, "proxy_stopping")
        return COMPLETED

    async def _forward(self, request: ProxyRequest, exchange: Exchange, raw: Body,
                       to: Upstream) -> str:
        """Send the request (`raw`, its body) to `to` and relay the answer; a
        routed one's exchange hears of it once it is on its way (the events
        it publishes wait for the send). NotSent (when `to.failover`):
        nothing of it was sent."""
        headers = self._relay.request_headers(request.requestHeaders, client_host(request),
                                              exchange.id)
        if to.successor:
            for name, values in request.state.credentials:
                headers.setRawHeaders(name, list(values))
        url = to.base + request.uri.decode("latin-1")
        if self._tracing is not None:     # the engine call's span, carried to the engine
            for key, value in self._tracing.engine_call(exchange, url, to.host,
                                                        to.engine).items():
                headers.setRawHeaders(key.encode(), [value.encode("latin-1")])
        # A fresh body each time: a request never sent goes out once more.
        call = UpstreamCall(self._deadlines, self._header_timeout(), lambda: self._http.request(
            "POST", url, data=raw.producer(self._clock) if isinstance(raw, Form) else raw,
            headers=headers, unbuffered=True, allow_redirects=False))
        if to.routed:
            exchange.forwarded(to.engine)
        request.notifyFinish().addErrback(lambda _: call.client_gone())
        try:
            response = await call.headers()
        except Exception as e:  # every way an upstream can fail before its headers
            if to.failover and not call.gone and not call.timed_out and nothing_sent(e):
                raise NotSent(describe(e)) from None
            return call.failed(request, exchange, to.host, e, to.committed)
        if call.gone:
            # The client left while the headers were on their way.
            response.deliverBody(Discard())
            return CLIENT_GONE
        if to.committed and response.code != 200:
            text = (await error_text(response, self._clock)).decode("utf-8", "replace")[:500]
            return sse_error(request, exchange, f"upstream {to.host} answered "
                             f"{response.code}: {text}", response.code)
        if not to.committed:
            # The proxy's own status line: the code's standard phrase (Twisted's
            # default for an unknown code), never the engine's bytes.
            request.setResponseCode(response.code)
            self._relay.response_headers(response.headers, response.length,
                                         request.responseHeaders, exchange.streaming)
            say_energy(request, exchange, self._energy)
        relay = call.relay = self._relay(request, exchange)
        response.deliverBody(relay)
        watch = self._silences.add(lambda: exchange.bytes_sent, relay.paused, relay.silent)
        try:
            outcome, detail = await relay.ended
        finally:
            self._silences.remove(watch)
        if detail is not None:
            exchange.note(detail)
        return outcome

