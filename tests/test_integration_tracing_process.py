"""Tracing in a real `twistd llmproxy` process (issue 49, item 2), in front of
a simulated engine process, exporting to the OTLP/HTTP receiver of
tests/otlpreceiver.py in this test: the spans of a streamed request arrive with
the client's trace id (all of them by the end of a SIGTERM stop, which sends
what is queued), the engine got the engine call's span as `traceparent`, and a
collector that refuses connections costs one warning line in the log while
requests are answered."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest

from llmproxy.config.tracing import installed
from tests import needs
from tests.procs import Proxy, SimEngine, one_host, refusing_port

needs.module("otel", None if installed() is None else f"{installed()} is not installed")

from tests.otlpreceiver import start_receiver  # noqa: E402

pytestmark = pytest.mark.integration

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
WARNING = "tracing: the collector at"


def stream(port: int, headers: dict[str, str]) -> bytes:
    """A streamed chat completion of 3 tokens; its whole body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json", "X-Sim-Tokens": "3", **headers})
    response = conn.getresponse()
    assert response.status == 200
    data = response.read()
    conn.close()
    return data


def test_a_twistd_process_sends_its_spans_and_the_engine_its_traceparent(
        engine: SimEngine, tmp_path: Path) -> None:
    """The request's span continues the client's trace, the engine call is its
    child, the engine received that call's traceparent; after SIGTERM every
    span has arrived and the log has no tracing warning."""
    receiver = start_receiver()
    proxy = Proxy(one_host(engine, tracing={"otlp_endpoint": receiver.endpoint}), tmp_path)
    try:
        body = stream(proxy.port, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        assert body.rstrip().endswith(b"data: [DONE]")
        assert proxy.stop() == 0
        spans = {s.name: s for s in receiver.wait_for(2)}
    finally:
        proxy.stop()
        receiver.close()
    root, call = spans["POST /v1/chat/completions"], spans["chat m"]
    assert (root.trace_id, root.parent_id) == (TRACE_ID, CLIENT_SPAN)
    assert (call.trace_id, call.parent_id) == (TRACE_ID, root.span_id)
    assert call.events == ["gen_ai.first_token"]
    (record,) = [r for r in engine.requests() if r["path"] == "/v1/chat/completions"][-1:]
    sent = {k.lower(): v for k, v in record["headers"].items()}
    assert sent["traceparent"].startswith(f"00-{TRACE_ID}-{call.span_id}-")
    assert WARNING not in proxy.output()


def test_a_collector_that_refuses_costs_one_warning_line(engine: SimEngine,
                                                        tmp_path: Path) -> None:
    """Every request is answered whole while the collector refuses; the log
    says once that spans are dropped, however many exports failed."""
    with refusing_port() as port:
        proxy = Proxy(one_host(engine, tracing={"otlp_endpoint": f"http://127.0.0.1:{port}"}),
                      tmp_path)
        try:
            for _ in range(3):
                assert stream(proxy.port, {}).rstrip().endswith(b"data: [DONE]")
            proxy.wait_for(WARNING, timeout=20)
            assert stream(proxy.port, {}).rstrip().endswith(b"data: [DONE]")
        finally:
            proxy.stop()
    assert proxy.output().count(WARNING) == 1
