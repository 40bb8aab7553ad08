"""OpenTelemetry traces reach a real OTLP/HTTP collector (issue 49, item 2): a
proxy in this process on the real reactor, on both paths (the reference engine
client, treq, and the fast one), a scripted engine on 127.0.0.1 and the
receiver of tests/otlpreceiver.py decoding the protobuf. The request's span
continues the client's `traceparent`; the engine call is its child and is what
the engine is sent as `traceparent`; a stalled collector holds no request
back, and a collector that is down costs one warning."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.threads import deferToThread

from llmproxy.config import parse_config
from llmproxy.config.tracing import installed
from llmproxy.core.events import Event, RequestEnded
from llmproxy.core.hub import Hub
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.accessfiles import load_access_files
from llmproxy.lifecycle.assemble import ServiceInputs, build_service, upstream_client
from llmproxy.speedups import select
from tests import needs
from tests.differential import Client, EngineFactory, Script, reactor

needs.module("otel", None if installed() is None else f"{installed()} is not installed")

from llmproxy.core.traces import TraceExport  # noqa: E402
from tests.otlpreceiver import start_receiver  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("on_both_paths")]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(doc: object) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


TOKEN = event({"choices": [{"delta": {"content": "tok"}}]})
STREAM = [HEAD + chunk(TOKEN), chunk(TOKEN), chunk(event({
    "choices": [{"delta": {}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 2}})),
    chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"]


class Rig:
    """The engine, one proxy with `tracing` to `endpoint`, and what its hub said."""

    def __init__(self, endpoint: str) -> None:
        self.engine = EngineFactory()
        self.engine_port = reactor().listenTCP(0, self.engine, interface="127.0.0.1")
        config = parse_config({
            "listen": "127.0.0.1:0", "tracing": {"otlp_endpoint": endpoint},
            "hosts": [{"name": "gpu1",
                       "url": f"http://127.0.0.1:{self.engine_port.getHost().port}"}]})
        files = load_access_files(config, {})
        selection = select(os.environ)
        http, self.pool = upstream_client(config, reactor(), files, selection)
        self.heard: list[Event] = []
        hub = Hub()
        hub.subscribe(self.heard.append)
        self.service = build_service(ServiceInputs(config, reactor(), http=http, pool=self.pool,
                                                   hub=hub, access_files=files,
                                                   speedups=selection))
        self.service.runtime.rosters.record_success("gpu1", 1, (RosterEntry("m", 4096),))
        self.port = reactor().listenTCP(0, self.service.site, interface="127.0.0.1")
        tracing = self.service.parts.tracing
        assert tracing is not None
        self.tracing = tracing

    async def ask(self, headers: bytes = b"") -> bytes:
        """A streamed chat request with `headers`; what the client read."""
        self.engine.script = Script(list(STREAM), close=True)
        body = json.dumps({"model": "m", "stream": True}).encode()
        client = Client([b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Connection: close\r\n%sContent-Length: %d\r\n\r\n%s"
                         % (headers, len(body), body)])
        endpoint = TCP4ClientEndpoint(reactor(), "127.0.0.1", self.port.getHost().port)
        await connectProtocol(endpoint, client)
        received = await client.done.addTimeout(10, reactor())
        await self.service.inflight.idle().addTimeout(10, reactor())
        return received

    async def close(self) -> None:
        self.service.forwarder.stop()
        await deferToThread(self.tracing.provider.shutdown)
        await self.pool.closeCachedConnections()
        await self.port.stopListening()
        for connection in list(self.engine.connections):
            if connection.transport is not None:
                connection.transport.abortConnection()  # type: ignore[attr-defined]
        await self.engine_port.stopListening()


def engine_header(request: bytes, name: bytes) -> list[str]:
    """The values of header `name` in a raw request the engine received."""
    head = request.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
    return [line.split(b":", 1)[1].strip().decode() for line in head
            if line.split(b":", 1)[0].strip().lower() == name]


@pytest_twisted.ensureDeferred
async def test_spans_reach_the_collector_with_their_parents_and_the_clients_trace() -> None:
    """The request's SERVER span is in the client's trace under the client's
    span; the engine call, a CLIENT span `chat m` with the GenAI attributes and
    its first token, is its child; the engine got that span as traceparent."""
    receiver = start_receiver()
    rig = Rig(receiver.endpoint)
    try:
        traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
        received = await rig.ask(b"traceparent: %s\r\n" % traceparent.encode())
        assert b"200 OK" in received.split(b"\r\n", 1)[0] and b"[DONE]" in received
        await deferToThread(rig.tracing.provider.force_flush)
        spans = {s.name: s for s in await deferToThread(receiver.wait_for, 2)}
    finally:
        await rig.close()
        receiver.close()
    root, call = spans["POST /v1/chat/completions"], spans["chat m"]
    assert (root.trace_id, root.parent_id, root.kind) == (TRACE_ID, CLIENT_SPAN, 2)
    assert (call.trace_id, call.parent_id, call.kind) == (TRACE_ID, root.span_id, 3)
    assert root.service == "llmproxy"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.request.model"] == "m"
    assert call.attributes["gen_ai.operation.name"] == "chat"
    assert call.attributes["gen_ai.request.model"] == "m"
    assert call.attributes["gen_ai.usage.input_tokens"] == 12
    assert call.attributes["gen_ai.usage.output_tokens"] == 2
    assert call.attributes["server.address"] == "127.0.0.1"
    assert call.events == ["gen_ai.first_token"]
    assert root.start <= call.start <= call.end <= root.end
    (sent,) = rig.engine.requests
    assert engine_header(sent, b"traceparent") == [f"00-{TRACE_ID}-{call.span_id}-01"]


@pytest_twisted.ensureDeferred
async def test_a_request_without_traceparent_starts_a_trace() -> None:
    """No traceparent from the client: a new trace, its root without a parent,
    still carried to the engine."""
    receiver = start_receiver()
    rig = Rig(receiver.endpoint)
    try:
        await rig.ask()
        await deferToThread(rig.tracing.provider.force_flush)
        spans = {s.name: s for s in await deferToThread(receiver.wait_for, 2)}
    finally:
        await rig.close()
        receiver.close()
    root, call = spans["POST /v1/chat/completions"], spans["chat m"]
    assert root.parent_id == "" and call.parent_id == root.span_id
    assert root.trace_id != TRACE_ID
    (sent,) = rig.engine.requests
    (carried,) = engine_header(sent, b"traceparent")
    assert carried.startswith(f"00-{root.trace_id}-{call.span_id}-")
    assert int(carried[-2:], 16) & 1          # sampled (the SDK may set its random-id flag)


@pytest_twisted.ensureDeferred
async def test_a_stalled_collector_holds_no_request_back() -> None:
    """While the collector holds its answer to an export, requests are answered
    whole (the export runs on the SDK's thread, never the reactor's); the spans
    arrive once it answers."""
    receiver = start_receiver()
    receiver.hold.clear()
    rig = Rig(receiver.endpoint)
    try:
        await rig.ask()
        flushing = deferToThread(rig.tracing.provider.force_flush)  # an export under way
        for _ in range(3):
            received = await rig.ask()
            assert received.rstrip().endswith(b"0") and b"[DONE]" in received
        assert receiver.spans == []
        receiver.hold.set()
        await flushing
        await deferToThread(rig.tracing.provider.force_flush)
        spans = await deferToThread(receiver.wait_for, 8)
    finally:
        await rig.close()
        receiver.close()
    assert [s.name for s in spans].count("chat m") == 4


@pytest_twisted.ensureDeferred
async def test_a_collector_that_is_down_costs_one_warning() -> None:
    """A collector that refuses connections: every request is answered, and
    the log has one warning that spans are dropped (not one per export)."""
    from tests.procs import refusing_port

    with refusing_port() as port:
        rig = Rig(f"http://127.0.0.1:{port}")
        try:
            for _ in range(2):
                received = await rig.ask()
                assert b"[DONE]" in received
                await deferToThread(rig.tracing.provider.force_flush)
            ended = [e for e in rig.heard if isinstance(e, RequestEnded)]
            assert [e.status for e in ended] == [200, 200]
        finally:
            await rig.close()
    warnings: list[Any] = [e for e in rig.heard if isinstance(e, TraceExport)]
    assert [(w.ok, w.line()[0]) for w in warnings] == [(False, "warn")]
