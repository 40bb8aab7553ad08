"""The Anthropic Messages API through the proxy, in memory: routed by model,
relayed unchanged, and every error the proxy itself makes on these paths in
Anthropic's shape with the matching status."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from twisted.internet.task import Clock

from llmproxy.config import parse_config
from llmproxy.config.keys import ApiKey, KeyRing
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.accessfiles import AccessFiles
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.fakes import Connection, FakeHTTPClient, FakeResponse

CONFIG: dict[str, Any] = {
    "listen": "127.0.0.1:0", "max_body_bytes": 2000, "header_timeout_seconds": 30,
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}],
    "models": {"claude-local": {"host": "gpu1", "upstream": "qwen-up"}},
}
KEY = ApiKey("alice", hashlib.sha256(b"sk-a").digest())


def make(keys: bool = False) -> tuple[LLMProxyService, FakeHTTPClient, Clock]:
    clock, http = Clock(), FakeHTTPClient()
    files = AccessFiles(keys=KeyRing((KEY,))) if keys else None
    svc = build_service(ServiceInputs(parse_config(CONFIG), clock, http=http, access_files=files))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen-up", 4096),))
    return svc, http, clock


def message(model: str = "claude-local", stream: bool = True) -> bytes:
    return json.dumps({"model": model, "max_tokens": 16, "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


def anthropic_error(conn: Connection) -> tuple[int, str]:
    resp = conn.response()
    doc = resp.json()
    assert set(doc) == {"type", "error"} and doc["type"] == "error"
    assert set(doc["error"]) == {"type", "message"} and doc["error"]["message"]
    return resp.status, doc["error"]["type"]


def test_a_message_stream_is_routed_and_relayed_unchanged() -> None:
    """/v1/messages goes to the model's host with the upstream name substituted;
    the engine's Anthropic events reach the client byte for byte, and the
    anthropic-version and x-api-key headers pass (keys are off)."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/messages", message(), {"anthropic-version": "2023-06-01",
                                                  "x-api-key": "engine-does-not-care"})
    [call] = http.calls
    assert call.url == "http://10.0.0.5:8081/v1/messages"
    assert json.loads(call.body)["model"] == "qwen-up"
    assert call.headers.getRawHeaders(b"anthropic-version") == [b"2023-06-01"]
    events = (b'event: message_start\ndata: {"type": "message_start"}\n\n'
              b'event: message_stop\ndata: {"type": "message_stop"}\n\n')
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    call.deferred.callback(upstream)
    upstream.send(events)
    upstream.finish()
    resp = conn.response()
    assert resp.status == 200 and resp.body == events and resp.complete


@pytest.mark.parametrize("path, body, status, kind", [
    ("/v1/messages", message("nope"), 404, "not_found_error"),
    ("/v1/messages/count_tokens", message("nope"), 404, "not_found_error"),
    ("/v1/messages", b"{not json", 400, "invalid_request_error"),
    ("/v1/messages", b'{"messages": []}', 400, "invalid_request_error"),
    ("/v1/messages", b"x" * 3000, 413, "request_too_large"),
])
def test_refusals_are_anthropic_shaped(path: str, body: bytes, status: int, kind: str) -> None:
    """A missing model, a bad body, one over the limit: Anthropic errors."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", path, body)
    assert anthropic_error(conn) == (status, kind)


def test_missing_and_wrong_keys_are_authentication_errors() -> None:
    """With keys on: 401 authentication_error; x-api-key (the SDK's header) works."""
    svc, http, _ = make(keys=True)
    for headers in ({}, {"x-api-key": "sk-wrong"}, {"Authorization": "Token x"}):
        conn = Connection(svc.site)
        conn.send("POST", "/v1/messages", message(), headers)
        assert anthropic_error(conn) == (401, "authentication_error")
    Connection(svc.site).send("POST", "/v1/messages", message(), {"x-api-key": "sk-a"})
    [call] = http.calls
    assert call.headers.getRawHeaders(b"x-api-key") is None


def test_upstream_failures_are_api_errors_and_timeouts_too() -> None:
    """An upstream that refuses is 502 api_error; one too slow is 504 api_error."""
    from twisted.internet.error import ConnectionRefusedError

    svc, http, clock = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/messages", message())
    http.calls[-1].deferred.errback(ConnectionRefusedError())
    assert anthropic_error(conn) == (502, "api_error")
    slow = Connection(svc.site)
    slow.send("POST", "/v1/messages", message())
    clock.advance(31)
    assert anthropic_error(slow) == (504, "api_error")


def test_openai_paths_keep_openai_errors() -> None:
    """Only the Anthropic paths change shape: /v1/chat/completions stays OpenAI."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", message("nope"))
    assert conn.response().json()["error"]["code"] == "model_not_found"
