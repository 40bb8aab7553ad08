"""Forwarding one `POST /v1/*` to the engine that serves its model, streaming.

The response is relayed chunk by chunk as the engine sends it: the upstream's
transport is registered as the client request's producer, so a slow client
pauses the upstream (backpressure) instead of growing a buffer here. A client
that goes away cancels the upstream at once. An upstream that fails after the
headers were sent ends the client's connection without the final chunk, so the
client can see the answer is incomplete; nothing is ever made to look finished.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, cast
from typing import Protocol as TypingProtocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from llmproxy.core.failures import describe
from llmproxy.hosts.catalog import Catalog, Route
from llmproxy.hosts.manager import HostManager, Lease, SwitchFailed
from llmproxy.observe.requests import CLIENT_GONE, COMPLETED, UPSTREAM_FAILED, Exchange
from llmproxy.web.errors import write_error

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"proxy-connection", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})


def _hop_by_hop(headers: Headers) -> set[bytes]:
    # Besides the fixed set, a Connection header names more hop-by-hop headers.
    named = {
        token.strip().lower()
        for value in headers.getRawHeaders(b"connection", [])
        for token in value.split(b",") if token.strip()
    }
    return set(HOP_BY_HOP) | named


def upstream_request_headers(incoming: Headers, client_ip: str) -> Headers:
    """The headers to send upstream: end-to-end ones, plus X-Forwarded-For."""
    drop = _hop_by_hop(incoming) | {b"host", b"content-length", b"x-forwarded-for"}
    out = Headers()
    for name, values in incoming.getAllRawHeaders():
        if name.lower() not in drop:
            out.setRawHeaders(name, list(values))
    chain = [v.strip() for v in incoming.getRawHeaders(b"x-forwarded-for", []) if v.strip()]
    out.setRawHeaders(b"x-forwarded-for", [b", ".join([*chain, client_ip.encode()])])
    return out


def client_response_headers(upstream: Headers, length: object) -> Headers:
    """The upstream's response headers minus hop-by-hop ones, plus its length.

    Twisted's client keeps Content-Length out of `headers` (it is in
    `length`), and treq's gzip layer leaves an empty Content-Encoding behind
    on plain responses: neither may reach the client like that.
    """
    drop = _hop_by_hop(upstream)
    out = Headers()
    for name, values in upstream.getAllRawHeaders():
        if name.lower() not in drop:
            out.setRawHeaders(name, list(values))
    if not any(v.strip() for v in out.getRawHeaders(b"content-encoding", [])):
        out.removeHeader(b"content-encoding")
    if isinstance(length, int) and not isinstance(length, bool):
        out.setRawHeaders(b"content-length", [str(length).encode()])
    return out


class HTTPClient(TypingProtocol):
    """The part of treq.HTTPClient the proxy uses."""

    def request(self, method: str, url: str, *, data: bytes, headers: Headers,
                unbuffered: bool, allow_redirects: bool) -> Deferred[Any]: ...

    def get(self, url: str) -> Deferred[Any]: ...


class Relay(Protocol):
    """Writes an upstream body to the client as it arrives; reports how it ended."""

    def __init__(self, request: Request, exchange: Exchange) -> None:
        self.request = request
        self.exchange = exchange
        self.client_gone = False
        self.ended: Deferred[tuple[str, str | None]] = Deferred()

    def connectionMade(self) -> None:
        # Backpressure: while the client's socket is full, the upstream is paused.
        self.request.registerProducer(self.transport, True)

    def dataReceived(self, data: bytes) -> None:
        if self.client_gone:
            return
        self.exchange.bytes_sent += len(data)
        self.request.write(data)

    def stop(self) -> None:
        """The client is gone: close the upstream connection now."""
        self.client_gone = True
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.client_gone:
            self.ended.callback((CLIENT_GONE, None))
            return
        self.request.unregisterProducer()
        if reason.check(ResponseDone, PotentialDataLoss):
            self.request.finish()
            self.ended.callback((COMPLETED, None))
            return
        # Cut short upstream: close without the terminating chunk, after what was
        # already relayed has been flushed, so the client sees a truncated body.
        self.request.channel.loseConnection()
        why = describe(reason.value) if reason.value is not None else "unknown"
        self.ended.callback((UPSTREAM_FAILED, f"upstream ended mid-response: {why}"))


PING_FIRST = 1.0    # a streaming client that waits for an engine hears from us after this,
PING_EVERY = 5.0    # then this often, so idle timeouts in front of the proxy do not fire


class Forwarder:
    """Routes and forwards API requests."""

    def __init__(self, clock: IReactorTime, http: HTTPClient,
                 header_timeout: Callable[[], float],
                 engines: Callable[[], Mapping[str, HostManager]] = dict) -> None:
        self._clock = clock
        self._http = http
        self._header_timeout = header_timeout
        self._engines = engines

    async def handle(self, request: Request, exchange: Exchange, catalog: Catalog) -> str:
        """Answer one `POST /v1/*`; returns the outcome for the access log."""
        if getattr(request, "body_too_large", False):
            # The rest of the body was discarded unread: don't reuse the connection.
            request.setHeader(b"connection", b"close")
            request.channel.persistent = False
            return self._refuse(request, exchange, 413, "request body is larger than "
                                f"{catalog.config.max_body_bytes} bytes (max_body_bytes)",
                                "request_too_large")
        raw = request.content.read() if request.content is not None else b""
        try:
            body = json.loads(raw)
        except ValueError:
            return self._refuse(request, exchange, 400, "request body is not valid JSON",
                                "invalid_json")
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            return self._refuse(request, exchange, 400,
                                'request body has no "model" (a JSON string naming the model)',
                                "missing_model")
        exchange.model = model
        route = catalog.resolve(model)
        if route is None:
            return self._refuse(request, exchange, 404, f"The model '{model}' does not exist",
                                "model_not_found")
        exchange.host = route.host.name
        if route.upstream != model:
            body["model"] = route.upstream
            raw = json.dumps(body).encode("utf-8")
        exchange.streaming = body.get("stream") is True
        manager = self._engines().get(route.host.name) if route.engine else None
        if manager is None or route.engine is None:
            return await self._forward(request, exchange, route, raw)
        exchange.engine = route.engine
        wait = _EngineWait(self._clock, request, exchange, manager, route.engine)
        try:
            lease = await wait.acquire()
        except SwitchFailed as e:
            message = f"model {model}: {e}"
            if wait.committed:
                exchange.detail = message
                return wait.fail(message)
            exchange.detail = message
            return self._refuse(request, exchange, 424, message, 424, UPSTREAM_FAILED,
                                type_="model_unavailable")
        except CancelledError:
            return CLIENT_GONE
        try:
            return await self._forward(request, exchange, route, raw, committed=wait.committed)
        finally:
            lease.release()

    def _refuse(self, request: Request, exchange: Exchange, status: int, message: str,
                code: str | int, outcome: str = COMPLETED, type_: str | None = None) -> str:
        exchange.status = status
        exchange.bytes_sent = write_error(request, status, message, code, type_)
        return outcome

    async def _forward(self, request: Request, exchange: Exchange, route: Route,
                       raw: bytes, committed: bool = False) -> str:
        """Send the request upstream and relay the answer. `committed`: a 200
        event stream was already started (pings while waiting for an engine),
        so failures become an SSE error event instead of an error status."""
        url = route.host.url + request.uri.decode("latin-1")
        client_ip = getattr(request.getClientAddress(), "host", "unknown")
        headers = upstream_request_headers(request.requestHeaders, client_ip)
        headers.setRawHeaders(b"x-request-id", [exchange.id.encode()])
        pending = self._http.request("POST", url, data=raw, headers=headers,
                                     unbuffered=True, allow_redirects=False)
        state = {"gone": False, "timed_out": False}
        relay: list[Relay] = []

        def client_gone(_: object) -> None:
            state["gone"] = True
            if relay:
                relay[0].stop()
            elif not pending.called:
                pending.cancel()

        request.notifyFinish().addErrback(client_gone)
        timeout = self._header_timeout()

        def time_out() -> None:
            state["timed_out"] = True
            pending.cancel()

        timer: IDelayedCall = self._clock.callLater(timeout, time_out)
        try:
            response = await pending
        except Exception as e:  # every way an upstream can fail before its headers
            if state["gone"]:
                return CLIENT_GONE
            if committed:
                why = ("sent no response headers in time" if state["timed_out"]
                       else f"failed: {describe(e)}")
                return sse_error(request, exchange, f"upstream {route.host.name} {why}", 502)
            if state["timed_out"]:
                return self._refuse(request, exchange, 504, f"upstream {route.host.name} sent no "
                                    f"response headers within {timeout:g}s "
                                    "(header_timeout_seconds)", "upstream_timeout",
                                    UPSTREAM_FAILED)
            return self._refuse(request, exchange, 502, f"upstream {route.host.name} failed: "
                                f"{describe(e)}", "upstream_failed", UPSTREAM_FAILED)
        finally:
            if timer.active():
                timer.cancel()
        if state["gone"]:
            # The client left while the headers were on their way.
            response.deliverBody(_Discard())
            return CLIENT_GONE
        if committed and response.code != 200:
            detail = (await response.content()).decode("utf-8", "replace")[:500]
            return sse_error(request, exchange, f"upstream {route.host.name} answered "
                             f"{response.code}: {detail}", response.code)
        if not committed:
            exchange.status = response.code
            request.setResponseCode(response.code, response.phrase)
            out = client_response_headers(response.headers, response.length)
            ctype = b"".join(out.getRawHeaders(b"content-type", [])).lower()
            if exchange.streaming or ctype.startswith(b"text/event-stream"):
                out.setRawHeaders(b"x-accel-buffering", [b"no"])
            for name, values in out.getAllRawHeaders():
                request.responseHeaders.setRawHeaders(name, list(values))
        r = Relay(request, exchange)
        relay.append(r)
        response.deliverBody(r)
        outcome, detail = await r.ended
        exchange.detail = detail
        return outcome


def sse_error(request: Request, exchange: Exchange, message: str, code: int) -> str:
    """End an already started event stream with an error event (its 200 status
    is gone), then close the connection without the final chunk."""
    event = json.dumps({"error": {"message": message, "type": "upstream_error", "code": code}})
    data = f"data: {event}\n\n".encode()
    exchange.bytes_sent += len(data)
    exchange.detail = message
    request.write(data)
    request.channel.loseConnection()
    return UPSTREAM_FAILED


class _EngineWait:
    """A request waiting for its engine on a managed host: the lease, cancelled
    if the client leaves, and SSE comment pings for a streaming client."""

    def __init__(self, clock: IReactorTime, request: Request, exchange: Exchange,
                 manager: HostManager, engine: str) -> None:
        self._clock = clock
        self._request = request
        self._exchange = exchange
        self._manager = manager
        self._engine = engine
        self.committed = False

    async def acquire(self) -> Lease:
        pending = self._manager.acquire(self._engine)
        if pending.called:
            return await pending
        self._request.notifyFinish().addErrback(lambda _: pending.cancel())
        ping: LoopingCall | None = None
        if self._exchange.streaming:
            ping = LoopingCall(self._ping)
            ping.clock = self._clock
            first = self._clock.callLater(PING_FIRST, ping.start, PING_EVERY)
        try:
            return await pending
        finally:
            if ping is not None:
                if first.active():
                    first.cancel()
                if ping.running:
                    ping.stop()

    def _ping(self) -> None:
        request, exchange = self._request, self._exchange
        if getattr(request, "_disconnected", False):
            return
        if not self.committed:
            self.committed = True
            exchange.status = 200
            request.setResponseCode(200)
            request.setHeader(b"content-type", b"text/event-stream")
            request.setHeader(b"cache-control", b"no-cache")
            request.setHeader(b"x-accel-buffering", b"no")
        line = f": waiting for engine {self._engine} on {self._manager.host.name}\n\n".encode()
        exchange.bytes_sent += len(line)
        request.write(line)

    def fail(self, message: str) -> str:
        return sse_error(self._request, self._exchange, message, 424)


class _Discard(Protocol):
    def connectionMade(self) -> None:
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()

