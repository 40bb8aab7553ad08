"""OpenTelemetry traces of the API requests (opt-in: the config's `tracing`),
through the official SDK and its OTLP/HTTP exporter (`pip install 'llmproxy[otel]'`).

Each request is a SERVER span (`POST /v1/chat/completions`) continuing the
client's `traceparent` when it sent one, with children: `queue wait` (its time
in a host's queue), `engine switch` (the switch it waited for) and the engine
call, a CLIENT span named by the GenAI semantic conventions (`chat MODEL`,
`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.usage.input_tokens`,
`gen_ai.usage.output_tokens`, `server.address`) with the first token as an
event (`gen_ai.first_token`); the engine is sent that span's `traceparent`.

The spans are made from what the forwarder tells (`begin`, `engine_call`) and
from hub events (queue, switch, tokens, end), with the times those carry.
Ending a span only queues it: the SDK's BatchSpanProcessor exports from its
own thread, never the reactor's, and drops spans when its queue is full. A
collector that takes nothing costs one warning (`core.traces.TraceExport`),
and one line more when it is back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from llmproxy import __version__
from llmproxy.config.tracing import TracingConfig
from llmproxy.core.capacity import Queued, QueueLeft, QueueRejected
from llmproxy.core.events import EngineSwitch, Event, RequestEnded
from llmproxy.core.hub import Publish
from llmproxy.core.tokens import TokensTimed
from llmproxy.core.traces import TraceExport
from llmproxy.observe.inflight import COMPLETED, Exchange

EXPORT_SECONDS = 5.0       # one export's bound (the exporter retries within it)
SHUTDOWN_SECONDS = 10.0    # what the stop waits for the last spans to go out
_PROPAGATOR = TraceContextTextMapPropagator()
# The GenAI operation of each API path (gen_ai.operation.name).
_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/messages": "chat",
               "/v1/completions": "text_completion", "/v1/embeddings": "embeddings"}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class _Reporting(SpanExporter):
    """The OTLP exporter, telling `report` (from the exporter's thread) each
    change between exporting and failing; an exporter error is a failure."""

    def __init__(self, inner: SpanExporter, report: Callable[[bool], None]) -> None:
        self._inner = inner
        self._report = report
        self._ok = True

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        ok = result is SpanExportResult.SUCCESS
        if ok != self._ok:
            self._ok = ok
            self._report(ok)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


@dataclass
class _Trace:
    """The spans of one request in flight."""

    root: Span
    started: float                 # the request's arrival (clock seconds)
    engine: Span | None = None
    engine_end: float | None = None
    queued: tuple[float, str, str] | None = None    # since, host, reason


class Tracing:
    """The spans of every API request in flight; a hub subscriber, and what the
    forwarder calls when a request begins and when it goes to an engine."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("llmproxy", __version__)
        self._traces: dict[str, _Trace] = {}
        self._switches: dict[str, float] = {}       # host: when its switch began

    @classmethod
    def exporting(cls, config: TracingConfig, reactor: Any, clock: IReactorTime,
                  publish: Publish) -> Tracing:
        """Spans exported to the collector of `config`, off the reactor's thread
        (`reactor`: its callFromThread brings the exporter's news back)."""
        def report(ok: bool) -> None:
            reactor.callFromThread(lambda: publish(
                TraceExport(clock.seconds(), config.endpoint, ok)))

        # The exporter's own retry lines would repeat what TraceExport says once.
        logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.ERROR)
        exporter = _Reporting(OTLPSpanExporter(endpoint=config.endpoint,
                                               timeout=EXPORT_SECONDS), report)
        provider = TracerProvider(resource=Resource.create({
            "service.name": config.service_name, "service.version": __version__}),
            shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
        return cls(provider)

    def begin(self, exchange: Exchange, traceparent: bytes | None,
              tracestate: bytes | None) -> None:
        """An API request began (at `exchange.started`), continuing the
        client's trace when its `traceparent` is valid."""
        carrier = {}
        if traceparent:
            carrier["traceparent"] = traceparent.decode("latin-1")
            if tracestate:
                carrier["tracestate"] = tracestate.decode("latin-1")
        parent: Context = _PROPAGATOR.extract(carrier)
        root = self._tracer.start_span(
            f"{exchange.method} {exchange.path}", context=parent, kind=SpanKind.SERVER,
            start_time=_ns(exchange.started), attributes={
                "http.request.method": exchange.method, "url.path": exchange.path,
                "llmproxy.request_id": exchange.id})
        self._traces[exchange.id] = _Trace(root, exchange.started)

    def engine_call(self, exchange: Exchange, url: str, host: str,
                    engine: str | None) -> dict[str, str]:
        """The request goes to an engine at `url` now: its span begins, and the
        headers that carry it to the engine (`traceparent`, `tracestate`)."""
        trace = self._traces.get(exchange.id)
        if trace is None:
            return {}
        if trace.engine is not None:       # an earlier host's attempt, over
            trace.engine.end()
        path = urlsplit(url)
        operation = _OPERATIONS.get(exchange.path.split("?", 1)[0], exchange.path)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation, "gen_ai.request.model": exchange.model or "",
            "server.address": path.hostname or "", "llmproxy.host": host,
            "llmproxy.streaming": exchange.streaming}
        if path.port is not None:
            attributes["server.port"] = path.port
        if engine is not None:
            attributes["llmproxy.engine"] = engine
        trace.engine = self._tracer.start_span(
            f"{operation} {exchange.model}", context=set_span_in_context(trace.root),
            kind=SpanKind.CLIENT, attributes=attributes)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(trace.engine))
        return carrier

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestEnded):
            self._ended(event)
        elif isinstance(event, Queued):
            trace = self._traces.get(event.request_id or "")
            if trace is not None:
                trace.queued = (event.time, event.host, event.reason)
        elif isinstance(event, (QueueLeft, QueueRejected)):
            self._left_queue(event)
        elif isinstance(event, EngineSwitch):
            self._switch(event)
        elif isinstance(event, TokensTimed):
            self._timed(event)

    def _child(self, trace: _Trace, name: str, start: float,
               attributes: dict[str, Any]) -> Span:
        return self._tracer.start_span(name, context=set_span_in_context(trace.root),
                                       start_time=_ns(start), attributes=attributes)

    def _left_queue(self, event: QueueLeft | QueueRejected) -> None:
        trace = self._traces.get(event.request_id or "")
        if trace is None:
            return
        reason = trace.queued[2] if trace.queued is not None else "capacity"
        trace.queued = None
        outcome = event.outcome if isinstance(event, QueueLeft) else event.reason
        span = self._child(trace, "queue wait", event.time - event.waited, {
            "llmproxy.host": event.host, "llmproxy.queue.reason": reason,
            "llmproxy.queue.outcome": outcome})
        if isinstance(event, QueueRejected):
            span.set_status(Status(StatusCode.ERROR, event.reason))
        span.end(_ns(event.time))

    def _switch(self, event: EngineSwitch) -> None:
        if event.stage == "begun":
            self._switches[event.host] = event.time
            return
        if event.stage not in ("done", "failed"):
            return
        began = self._switches.pop(event.host, event.time - (event.elapsed or 0.0))
        for trace in self._traces.values():
            if trace.queued is None or trace.queued[1:] != (event.host, "switch"):
                continue
            attributes = {"llmproxy.host": event.host, "llmproxy.engine": event.engine,
                          "llmproxy.switch.outcome": event.stage}
            if event.previous is not None:
                attributes["llmproxy.engine.previous"] = event.previous
            span = self._child(trace, "engine switch", max(began, trace.queued[0]), attributes)
            if event.stage == "failed":
                span.set_status(Status(StatusCode.ERROR, event.reason or "failed"))
            span.end(_ns(event.time))

    def _timed(self, event: TokensTimed) -> None:
        trace = self._traces.get(event.request_id)
        if trace is None or trace.engine is None:
            return
        trace.engine_end = event.time
        if event.first_token is not None:
            trace.engine.add_event("gen_ai.first_token", {
                "gen_ai.response.time_to_first_token": event.engine_first_token or 0.0},
                timestamp=_ns(trace.started + event.first_token))
        if event.prompt_per_second is not None:
            trace.engine.set_attribute("llmproxy.prompt_tokens_per_second",
                                       event.prompt_per_second)
        if event.output_per_second is not None:
            trace.engine.set_attribute("llmproxy.output_tokens_per_second",
                                       event.output_per_second)

    def _ended(self, event: RequestEnded) -> None:
        trace = self._traces.pop(event.request_id, None)
        if trace is None:
            return
        failed = event.outcome != COMPLETED or (event.status or 0) >= 500
        if trace.engine is not None:
            if event.prompt_tokens is not None:
                trace.engine.set_attribute("gen_ai.usage.input_tokens", event.prompt_tokens)
            if event.completion_tokens is not None:
                trace.engine.set_attribute("gen_ai.usage.output_tokens", event.completion_tokens)
            if failed:
                trace.engine.set_status(Status(StatusCode.ERROR, event.outcome))
            trace.engine.end(_ns(trace.engine_end if trace.engine_end is not None
                                 else event.time))
        root = trace.root
        if event.status is not None:
            root.set_attribute("http.response.status_code", event.status)
        root.set_attribute("llmproxy.outcome", event.outcome)
        if event.host is not None:
            root.set_attribute("llmproxy.host", event.host)
        if event.model is not None:
            root.set_attribute("gen_ai.request.model", event.model)
        if failed:
            root.set_status(Status(StatusCode.ERROR, event.detail or event.outcome))
        root.end(_ns(event.time))

    def service(self, reactor: Any) -> Service:
        """The service whose stop sends the spans still queued (bounded)."""
        return TracingService(self.provider, reactor)


class TracingService(Service):
    """Stops the exporter when the proxy stops: the spans still queued go out,
    from a thread of its own, for at most SHUTDOWN_SECONDS of the stop."""

    name = "tracing"

    def __init__(self, provider: TracerProvider, reactor: Any) -> None:
        self._provider = provider
        self._reactor = reactor

    def stopService(self) -> Deferred[None] | None:
        if not self.running:
            return None
        super().stopService()
        done: Deferred[None] = Deferred()

        def fire() -> None:
            if not done.called:
                done.callback(None)

        def shut() -> None:
            try:
                self._provider.shutdown()
            finally:
                self._reactor.callFromThread(fire)

        threading.Thread(target=shut, name="llmproxy-tracing-stop", daemon=True).start()
        return done.addTimeout(SHUTDOWN_SECONDS, self._reactor).addErrback(lambda _: None)
