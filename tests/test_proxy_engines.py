"""Requests for models on managed hosts, through the real Site with a fake
agent and a fake upstream: the engine switch before forwarding, the 424 of a
failed switch, pings to a waiting streaming client, and leases released."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.lifecycle.upgrade import Launcher
from llmproxy.testing.agentfakes import FakeAgentTransport
from llmproxy.testing.fakes import (
    Connection,
    FakeHTTPClient,
    FakeResponse,
)
from llmproxy.testing.upgradefakes import ReadyCandidates, hand_over_to

CONFIG = {
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081", "ssh": "llm@10.0.0.5",
               "engines": {"big": {"command": ["llama-server", "-m", "big.gguf"]},
                           "small": {"command": ["llama-server", "-m", "small.gguf"]}}}],
    "models": {"qwen": {"host": "gpu1", "engine": "big"},
               "llama": {"host": "gpu1", "engine": "small"}},
}


def make() -> tuple[LLMProxyService, FakeHTTPClient, FakeAgentTransport, Clock]:
    clock = Clock()
    http = FakeHTTPClient()
    agent = FakeAgentTransport()
    config = parse_config(CONFIG)
    roster = (RosterEntry("qwen"), RosterEntry("llama"))
    # Rosters read when an engine is ready answer at once, off `http` (its calls are the
    # requests forwarded).
    svc = build_service(ServiceInputs(config, clock, http=http, agent=agent,
                                      fetch=lambda host: succeed(roster),
                                      launcher=Launcher(ReadyCandidates())))
    svc.runtime.rosters.record_success("gpu1", 1, roster)
    svc.fleet.managers["gpu1"].controller.assume("big")
    return svc, http, agent, clock


def chat(model: str, stream: bool = True) -> bytes:
    return json.dumps({"model": model, "stream": stream}).encode()


def test_request_for_another_engine_waits_for_the_stream_then_switches() -> None:
    """A request for `small` while a stream runs on `big`: nothing is switched
    until the stream ends; then one start order, then the request is forwarded."""
    svc, http, agent, _ = make()
    manager = svc.fleet.managers["gpu1"]
    a = Connection(svc.site)
    a.send("POST", "/v1/chat/completions", chat("qwen"))
    stream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[0].deferred.callback(stream)
    stream.send(b"data: 1\n\n")
    b = Connection(svc.site)
    b.send("POST", "/v1/chat/completions", chat("llama", stream=False))
    assert agent.calls == [] and len(http.calls) == 1        # waiting for the stream
    stream.send(b"data: [DONE]\n\n")
    stream.finish()
    assert a.response().complete
    [start] = agent.calls
    assert start.order["op"] == "start" and start.order["engine"] == "small"
    assert start.order["command"] == ["llama-server", "-m", "small.gguf"]
    assert start.order["health_url"] == "http://10.0.0.5:8081/health"
    assert start.order["exclusive"] is True  # one engine at a time on this host
    start.answer({"ok": True, "engine": "small", "pid": 7, "healthy": True, "elapsed": 1.0})
    assert len(http.calls) == 2 and json.loads(http.calls[1].body)["model"] == "llama"
    answer = FakeResponse(200, {"Content-Type": "application/json", "Content-Length": "2"})
    http.calls[1].deferred.callback(answer)
    answer.send(b"{}")
    answer.finish()
    assert b.response().status == 200 and manager.running == "small"
    assert manager.in_flight() == 0                           # leases released


def test_failed_switch_is_a_424_naming_model_host_engine_and_reason() -> None:
    """A failed switch: HTTP 424 model_unavailable, with the agent's reason, and the
    host's state is re-read from the agent."""
    svc, http, agent, _ = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.send("POST", "/v1/chat/completions", chat("llama", stream=False))
        agent.calls[0].answer({"ok": False, "error": "small exited with status 1"})
        status = agent.last("status")
        status.answer({"ok": True, "engines": []})
    resp = conn.response()
    assert resp.status == 424
    error = resp.json()["error"]
    assert error["type"] == "model_unavailable" and error["code"] == 424
    assert error["message"].startswith(
        "model llama: switching host gpu1 to engine small failed: small exited with status 1")
    assert not http.calls
    assert any("outcome=upstream-failed" in formatEvent(e) for e in events)


def test_waiting_streaming_client_gets_pings_then_the_stream() -> None:
    """A streaming client waiting for a switch hears `: queued 1st for gpu1, about N s`
    comments (after 1 s, then every 5 s; N counts down what is left of the engine's
    declared start_timeout_seconds, 120, as nothing was measured), then the engine's
    stream itself."""
    svc, http, agent, clock = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat("llama"))
    clock.advance(1)
    first = conn.response()
    assert first.status == 200 and first.headers["content-type"] == "text/event-stream"
    assert first.body == b": queued 1st for gpu1, about 119 s\n\n"
    clock.advance(5)
    assert conn.response().body == (b": queued 1st for gpu1, about 119 s\n\n"
                                    b": queued 1st for gpu1, about 114 s\n\n")
    agent.calls[0].answer({"ok": True, "engine": "small", "pid": 7, "healthy": True})
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[0].deferred.callback(upstream)
    upstream.send(b"data: x\n\n")
    upstream.finish()
    done = conn.response()
    assert done.complete and done.body.endswith(b"data: x\n\n")
    clock.advance(30)
    assert done.body.count(b": queued") == 2                   # pings stopped


def test_waiting_streaming_client_hears_a_failed_switch_as_an_error_event() -> None:
    """After pings, a failed switch ends the stream with an error event (the 200
    is gone) and no clean end."""
    svc, _, agent, clock = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat("llama"))
    clock.advance(1)
    agent.calls[0].fail("ssh: connect to host 10.0.0.5 port 22: No route to host")
    agent.last("status").fail("ssh: no route")
    resp = conn.response()
    assert b'"model_unavailable"' not in resp.body      # type says upstream_error, code 424
    event = json.loads(resp.body.split(b"data: ", 1)[1])
    assert event["error"]["code"] == 424 and "No route to host" in event["error"]["message"]
    assert not resp.complete and conn.closed


def test_client_leaving_while_waiting_gives_up_its_place() -> None:
    """A client that disconnects while waiting for a switch is removed from the
    queue: the switch nobody needs any more never starts."""
    svc, _, agent, _ = make()
    manager = svc.fleet.managers["gpu1"]
    a = Connection(svc.site)
    a.send("POST", "/v1/chat/completions", chat("qwen", stream=False))   # holds big
    b = Connection(svc.site)
    b.send("POST", "/v1/chat/completions", chat("llama", stream=False))
    assert manager.queued() == 1
    b.disconnect()
    assert manager.queued() == 0
    assert agent.calls == []


def test_status_shows_each_managed_host_engine() -> None:
    """/status shows the running engine, in-flight count and idle deadline per host."""
    svc, _, _, _ = make()
    conn = Connection(svc.site)
    conn.send("GET", "/status")
    [host] = conn.response().json()["hosts"]
    engine: dict[str, Any] = host["engine"]
    assert engine["running"] == "big" and engine["in_flight"] == 0
    assert "idle_stop_in_seconds" in engine and "last_switch" in engine


def test_reload_changing_a_model_on_a_running_engine_says_it_keeps_its_preset(
        tmp_path: Any) -> None:
    """An applied reload that changes a model whose engine runs adds that the
    running engine keeps its old preset until it next starts."""
    path = tmp_path / "hosts.json"
    changed = json.loads(json.dumps(CONFIG))
    changed["models"]["qwen"]["ctx"] = 8192
    changed["models"]["llama"]["ctx"] = 4096
    path.write_text(json.dumps(changed))
    clock = Clock()
    config = parse_config(CONFIG)
    svc = build_service(ServiceInputs(config, clock, http=FakeHTTPClient(),
                                      agent=FakeAgentTransport(), config_path=str(path),
                                      fetch=lambda host: succeed(())))
    svc.fleet.managers["gpu1"].controller.assume("big")
    svc._ready = True                 # serving (a reload during start-up waits)
    result = svc.reload()
    assert result is not None
    message = result.result.message
    assert message.startswith("reload: applied models (~qwen, ~llama)")
    assert message.endswith("a running engine keeps its old preset (ctx, options) until it "
                            "next starts (qwen)")


def waiting_behind_a_stream(svc: LLMProxyService, http: FakeHTTPClient,
                            body: bytes) -> tuple[Connection, FakeResponse]:
    """A stream on `big` holds its lease, and a request for `small` waits behind it."""
    a = Connection(svc.site)
    a.send("POST", "/v1/chat/completions", chat("qwen"))
    stream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[0].deferred.callback(stream)
    b = Connection(svc.site)
    b.send("POST", "/v1/chat/completions", body)
    assert len(http.calls) == 1
    return b, stream


def test_after_a_hand_over_a_request_waiting_for_a_switch_goes_to_the_new_process() -> None:
    """Nothing of a request that waits for a switch has reached an engine: when an
    upgrade's hand-over closes the hosts, it is re-sent as the client sent it (its
    public model name) to the new process, and that answer is relayed."""
    svc, http, agent, _ = make()
    original = json.dumps({"model": "llama", "stream": False, "temperature": 0.5}).encode()
    waiting, stream = waiting_behind_a_stream(svc, http, original)
    assert hand_over_to(svc.upgrade, "http://127.0.0.1:4711").called
    with capturedLogs() as events:
        svc.fleet.close()
        assert len(http.calls) == 2
        resend = http.calls[1]
        assert resend.url == "http://127.0.0.1:4711/v1/chat/completions"
        assert resend.body == original
        answer = FakeResponse(200, {"Content-Type": "application/json"})
        resend.deferred.callback(answer)
        answer.send(b'{"answered": "by the new process"}')
        answer.finish()
    resp = waiting.response()
    assert resp.status == 200 and resp.json() == {"answered": "by the new process"}
    assert agent.calls == []
    assert any("re-sent to the new process at http://127.0.0.1:4711" in formatEvent(e)
               for e in events)
    stream.finish()


def test_a_plain_stop_answers_a_request_waiting_for_a_switch_503() -> None:
    """Without a successor, a request whose switch will not come gets 503
    proxy_stopping with Retry-After (nothing failed: the proxy stops), never 424."""
    svc, http, agent, _ = make()
    waiting, stream = waiting_behind_a_stream(svc, http, chat("llama", stream=False))
    svc.fleet.close()
    resp = waiting.response()
    assert resp.status == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "proxy_stopping"
    assert len(http.calls) == 1 and agent.calls == []
    stream.finish()
