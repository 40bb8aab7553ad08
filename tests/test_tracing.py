"""The spans of a request (observe/tracing.py), made from what the forwarder
tells and from hub events on a task.Clock, into the SDK's in-memory exporter:
the queue wait and the engine switch it waited for as children of the
request's span, with the events' times; the engine call's first token; a
failover's first call ended; a refused request's error; the config block."""

from __future__ import annotations

import threading

import pytest
import pytest_twisted
from twisted.internet.task import Clock

from llmproxy.config import ConfigError, parse_config
from llmproxy.config.tracing import installed
from llmproxy.core.capacity import Queued, QueueLeft, QueueRejected
from llmproxy.core.events import EngineSwitch, RequestEnded
from llmproxy.core.hub import Hub
from llmproxy.core.tokens import GAP_BUCKETS, TokensTimed
from llmproxy.observe.inflight import InFlight
from tests import needs

needs.module("otel", None if installed() is None else f"{installed()} is not installed")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode  # noqa: E402

from llmproxy.observe.tracing import Tracing, TracingService  # noqa: E402

HOSTS = [{"name": "a", "url": "http://127.0.0.1:1"}]


def made() -> tuple[Tracing, InMemorySpanExporter, Clock, InFlight, Hub]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    clock = Clock()
    hub = Hub()
    hub.subscribe(tracing)
    return tracing, exporter, clock, InFlight(clock, hub), hub


def ended(exchange_id: str, at: float, status: int = 200, outcome: str = "completed",
          host: str = "gpu1") -> RequestEnded:
    return RequestEnded(at, request_id=exchange_id, method="POST",
                        path="/v1/chat/completions", client="127.0.0.1", model="m", host=host,
                        engine="big", status=status, bytes=10, duration=at, outcome=outcome,
                        prompt_tokens=7, completion_tokens=3)


def test_queue_wait_and_engine_switch_are_children_with_their_times() -> None:
    """A request that waited 2 s for a switch begun 0.5 s after it queued:
    `queue wait` covers the wait, `engine switch` the switch while it waited,
    both children of the request's span; the engine call has its first token
    and the engine's usage."""
    tracing, exporter, clock, inflight, hub = made()
    clock.advance(100)
    exchange = inflight.begin("POST", "/v1/chat/completions", "127.0.0.1")
    exchange.asked_for("m", streaming=True)
    tracing.begin(exchange, None, None)
    hub.publish(Queued(100.0, "gpu1", exchange.id, "big", "switch", 1))
    hub.publish(EngineSwitch(100.5, "gpu1", "begun", "big", "small"))
    hub.publish(EngineSwitch(102.0, "gpu1", "done", "big", "small", elapsed=1.5))
    hub.publish(QueueLeft(102.0, "gpu1", exchange.id, "served", 2.0, 0))
    carrier = tracing.engine_call(exchange, "http://10.0.0.5:8081/v1/chat/completions",
                                  "gpu1", "big")
    hub.publish(TokensTimed(104.0, exchange.id, "m", "gpu1", True, first_token=2.5,
                            engine_first_token=0.5, tokens=3, output_tokens=3,
                            decode_seconds=1.0, gaps=(0,) * (len(GAP_BUCKETS) + 1),
                            gap_sum=0.0, output_per_second=2.0, prompt_per_second=None))
    hub.publish(ended(exchange.id, 104.5))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["POST /v1/chat/completions"]
    assert root.parent is None
    for name in ("queue wait", "engine switch", "chat m"):
        assert spans[name].parent is not None
        assert spans[name].parent.span_id == root.context.span_id
    s = 1_000_000_000
    assert (spans["queue wait"].start_time, spans["queue wait"].end_time) == (100 * s, 102 * s)
    assert (spans["engine switch"].start_time, spans["engine switch"].end_time) == \
        (int(100.5 * s), 102 * s)
    assert spans["engine switch"].attributes["llmproxy.engine.previous"] == "small"
    assert spans["queue wait"].attributes["llmproxy.queue.reason"] == "switch"
    call = spans["chat m"]
    assert call.end_time == 104 * s and root.end_time == int(104.5 * s)
    assert [(e.name, e.timestamp) for e in call.events] == [("gen_ai.first_token",
                                                             int(102.5 * s))]
    assert call.attributes["gen_ai.usage.input_tokens"] == 7
    assert call.attributes["gen_ai.usage.output_tokens"] == 3
    assert (call.attributes["server.address"], call.attributes["server.port"]) == \
        ("10.0.0.5", 8081)
    assert carrier["traceparent"].split("-")[1:3] == [
        f"{root.context.trace_id:032x}", f"{call.context.span_id:016x}"]


def test_a_failover_ends_the_first_call_and_a_refusal_is_an_error() -> None:
    """Two engine calls (the first host failed before anything was sent): two
    call spans, both ended. A queue that refused: its span and the request's
    are errors."""
    tracing, exporter, _clock, inflight, hub = made()
    exchange = inflight.begin("POST", "/v1/chat/completions", "127.0.0.1")
    exchange.asked_for("m")
    tracing.begin(exchange, b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None)
    tracing.engine_call(exchange, "http://127.0.0.1:1/v1/chat/completions", "a", None)
    tracing.engine_call(exchange, "http://127.0.0.1:2/v1/chat/completions", "b", None)
    hub.publish(ended(exchange.id, 1.0))
    calls = [s for s in exporter.get_finished_spans() if s.name == "chat m"]
    assert len(calls) == 2
    assert {s.context.trace_id for s in exporter.get_finished_spans()} == {
        0x4bf92f3577b34da6a3ce929d0e0e4736}
    exporter.clear()
    refused = inflight.begin("POST", "/v1/chat/completions", "127.0.0.1")
    tracing.begin(refused, b"not a traceparent", None)
    hub.publish(Queued(0.0, "gpu1", refused.id, None, "capacity", 3))
    hub.publish(QueueRejected(5.0, "gpu1", refused.id, None, "queue_timeout", 3, 5.0))
    hub.publish(ended(refused.id, 5.0, status=503))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["queue wait"].status.status_code is StatusCode.ERROR
    assert spans["POST /v1/chat/completions"].status.status_code is StatusCode.ERROR
    assert spans["POST /v1/chat/completions"].parent is None     # a bad traceparent: new trace


def test_events_of_requests_not_traced_change_nothing() -> None:
    """Events for a request it never began (not an API request) make no span,
    and a switch nobody waited for none either."""
    _tracing, exporter, _clock, _inflight, hub = made()
    hub.publish(Queued(0.0, "gpu1", "x-1", None, "switch", 1))
    hub.publish(EngineSwitch(0.0, "gpu1", "begun", "big"))
    hub.publish(EngineSwitch(1.0, "gpu1", "done", "big", elapsed=1.0))
    hub.publish(ended("x-1", 1.0))
    assert exporter.get_finished_spans() == ()


def test_the_tracing_block_is_checked_by_name() -> None:
    """The endpoint gets /v1/traces unless it names it; bad values name their field."""
    config = parse_config({"hosts": HOSTS, "tracing": {"otlp_endpoint": "http://c:4318",
                                                       "service_name": "edge"}})
    assert config.tracing is not None
    assert (config.tracing.endpoint, config.tracing.service_name) == \
        ("http://c:4318/v1/traces", "edge")
    assert parse_config({"hosts": HOSTS}).tracing is None
    for block, field in [({"otlp_endpoint": "ftp://c"}, "tracing.otlp_endpoint"),
                         ({}, "tracing.otlp_endpoint"),
                         ({"otlp_endpoint": "http://c", "x": 1}, "tracing.x"),
                         ({"otlp_endpoint": "http://c", "service_name": ""},
                          "tracing.service_name"),
                         ("http://c", "tracing")]:
        with pytest.raises(ConfigError) as raised:
            parse_config({"hosts": HOSTS, "tracing": block})
        assert any(e.startswith(field + ":") for e in raised.value.errors), raised.value.errors


def test_without_the_sdk_the_block_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without the [otel] extra: `tracing` is refused, naming the extra."""
    from llmproxy.config import tracing

    monkeypatch.setattr(tracing, "NEEDS", ("llmproxy_no_such_module.trace",))
    with pytest.raises(ConfigError) as raised:
        parse_config({"hosts": HOSTS, "tracing": {"otlp_endpoint": "http://c:4318"}})
    assert raised.value.errors == (
        "tracing: needs the OpenTelemetry SDK and its OTLP exporter "
        "(llmproxy_no_such_module.trace is missing): pip install 'llmproxy[otel]'",)


@pytest_twisted.ensureDeferred
async def test_the_stop_sends_the_last_spans_from_a_thread_of_its_own() -> None:
    """The tracing service's stop shuts the provider down (its last export) on
    a thread of its own: the reactor runs on while it does, and the stop ends
    once the provider is down."""
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    release = threading.Event()
    threads: list[int] = []

    class Provider:
        def shutdown(self) -> None:
            threads.append(threading.get_ident())
            release.wait(10)

    tracing, *_ = made()
    service = TracingService(Provider(), reactor)  # type: ignore[arg-type]
    service.startService()
    stopped = service.stopService()
    assert stopped is not None
    await deferLater(reactor, 0.05, lambda: None)      # the reactor turns meanwhile
    assert not stopped.called
    release.set()
    await stopped
    assert threads and threads[0] != threading.get_ident()
    assert tracing.service(reactor).name == "tracing"
