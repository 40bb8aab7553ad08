"""Fallback chains (`models.X.fallbacks`), through the real Site with a fake
upstream and task.Clock: the config's rules (known names, no loop), each case
that moves a request to the next model (every host down, cordoned, the queue
full, the engine that will not start) with its `model` substituted,
X-LLMProxy-Model and route.fallback, and every case that must not (anything
reached an engine, a queue timeout, a model out of the key's scope)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.web._newclient import ResponseNeverReceived

from llmproxy.config import parse_config
from llmproxy.config.keys import parse_keys
from llmproxy.config.values import ConfigError
from llmproxy.core.events import RouteFallback
from llmproxy.hosts.catalog import fallback_chain
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.accessfiles import AccessFiles
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.agentfakes import FakeAgentTransport
from llmproxy.testing.fakes import Connection, FakeHTTPClient, FakeResponse

HOSTS = {"10.0.0.5": "gpu1", "10.0.0.6": "gpu2", "10.0.0.7": "gpu3"}
CONFIG: dict[str, Any] = {
    "header_timeout_seconds": 30,
    "server_names": ["proxy"],
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081", "max_concurrent": 1,
               "max_queue": 1, "queue_timeout_seconds": 10},
              {"name": "gpu2", "url": "http://10.0.0.6:8081"},
              {"name": "gpu3", "url": "http://10.0.0.7:8081", "ssh": "llm@gpu3",
               "engines": {"big": {"command": ["llama-server"]}}}],
    "models": {"big": {"host": "gpu3", "engine": "big", "fallbacks": ["mid"]},
               "mid": {"host": "gpu1", "upstream": "mid-up", "fallbacks": ["small"]},
               "small": {"host": "gpu2"},
               "solo": {"host": "gpu1"}},
}


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cordons are saved in the runtime directory: each test has its own."""
    monkeypatch.setitem(CONFIG, "runtime_dir", str(tmp_path / "run"))


def make(config: dict[str, Any] | None = None, keys: Any = None,
         ) -> tuple[LLMProxyService, FakeHTTPClient, FakeAgentTransport, Clock]:
    clock = Clock()
    http = FakeHTTPClient()
    agent = FakeAgentTransport()
    files = AccessFiles(keys=keys) if keys is not None else None
    config = {**(config or CONFIG), "runtime_dir": CONFIG["runtime_dir"]}
    svc = build_service(ServiceInputs(parse_config(config), clock, http=http,
                                      agent=agent, **({"access_files": files} if files else {})))
    for host, models in (("gpu1", ("mid-up", "solo")), ("gpu2", ("small",))):
        svc.runtime.rosters.record_success(host, 1, tuple(RosterEntry(m) for m in models))
    return svc, http, agent, clock


def ask(svc: LLMProxyService, model: str, path: str = "/v1/chat/completions",
        **headers: str) -> Connection:
    conn = Connection(svc.site)
    conn.send("POST", path, json.dumps({"model": model, "messages": [
        {"role": "user", "content": "hi"}]}).encode(), headers)
    return conn


def ok(call: Any, body: bytes = b"{}") -> None:
    response = FakeResponse(200, {"Content-Type": "application/json",
                                  "Content-Length": str(len(body))})
    call.deferred.callback(response)
    response.send(body)
    response.finish()


def host_of(call: Any) -> str:
    return HOSTS[call.url.split("//")[1].split(":")[0]]


def model_of(call: Any) -> str:
    model: str = json.loads(call.body)["model"]
    return model


def refuse(call: Any) -> None:
    call.deferred.errback(Failure(ConnectionRefusedError("Connection refused")))


def fallbacks(events: list[dict[str, Any]]) -> list[RouteFallback]:
    return [e["event"] for e in events if isinstance(e.get("event"), RouteFallback)]


# -- the config ------------------------------------------------------------------
@pytest.mark.parametrize(("models", "aliases", "message"), [
    ({"a": {"host": "gpu2", "fallbacks": ["nope"]}}, {},
     "models.a.fallbacks[0]: no model or alias named 'nope'"),
    ({"a": {"host": "gpu2", "fallbacks": ["a"]}}, {}, "models.a.fallbacks[0]: a loop: a -> a"),
    ({"a": {"host": "gpu2", "fallbacks": ["b"]}, "b": {"host": "gpu2", "fallbacks": ["c"]},
      "c": {"host": "gpu2", "fallbacks": ["a"]}}, {},
     "models.a.fallbacks[0]: a loop: a -> b -> c -> a"),
    ({"a": {"host": "gpu2", "fallbacks": ["b"]}, "b": {"host": "gpu2", "fallbacks": ["al"]}},
     {"al": "a"}, "models.b.fallbacks[0]: a loop: b -> a -> b"),
    ({"a": {"host": "gpu2", "fallbacks": ["b", "b"]}, "b": {"host": "gpu2"}}, {},
     "models.a.fallbacks[1]: duplicate of fallbacks[0]"),
    ({"a": {"host": "gpu2", "fallbacks": "b"}, "b": {"host": "gpu2"}}, {},
     "models.a.fallbacks: must be a list of model names"),
])
def test_unknown_names_loops_and_bad_lists_are_config_errors_naming_the_field(
        models: dict[str, Any], aliases: dict[str, str], message: str) -> None:
    """Every broken `fallbacks` is refused at start (exit 78) naming its field."""
    with pytest.raises(ConfigError) as raised:
        parse_config({**CONFIG, "models": models, "aliases": aliases})
    assert message in str(raised.value)


def test_the_chain_is_depth_first_and_an_alias_is_a_name() -> None:
    """big -> mid -> small (mid's own fallback), each once; an alias works as a name;
    /v1/models and /status show each model's fallbacks."""
    svc, _, _, _ = make({**CONFIG, "aliases": {"tiny": "small"},
                         "models": {**CONFIG["models"],
                                    "big": {**CONFIG["models"]["big"],
                                            "fallbacks": ["mid", "tiny"]}}})
    catalog = svc.runtime.catalog
    big = catalog.resolve("big")
    assert big is not None
    assert [r.name for r in fallback_chain(catalog, big)] == ["big", "mid", "small"]
    conn = Connection(svc.site)
    conn.send("GET", "/v1/models")
    by_id = {m["id"]: m["llmproxy"] for m in conn.response().json()["data"]}
    assert by_id["big"]["fallbacks"] == ["mid", "tiny"] and "fallbacks" not in by_id["small"]


# -- when a request moves on -------------------------------------------------------
def test_the_only_host_down_sends_it_to_the_fallback_with_model_substituted() -> None:
    """mid's host refuses the connection (nothing sent): the same request goes to
    small, whose name replaces mid's upstream name in the body; the answer says
    X-LLMProxy-Model: small; route.fallback is published, logged and counted once."""
    svc, http, _, _ = make()
    with capturedLogs() as events:
        conn = ask(svc, "mid")
        assert [host_of(c) for c in http.calls] == ["gpu1"] and model_of(http.calls[0]) == "mid-up"
        refuse(http.calls[0])
        assert [host_of(c) for c in http.calls] == ["gpu1", "gpu2"]
        assert model_of(http.calls[1]) == "small"
        ok(http.calls[1])
    resp = conn.response()
    assert resp.status == 200 and resp.headers["x-llmproxy-model"] == "small"
    [event] = fallbacks(events)
    assert (event.model, event.fallback) == ("mid", "small")
    assert "Connection refused" in event.reason
    assert any("for mid: no host could take it" in formatEvent(e) and
               "falling back to small" in formatEvent(e) for e in events)
    ended = [formatEvent(e) for e in events if "outcome=completed" in formatEvent(e)]
    assert ended and "model=small host=gpu2" in ended[-1]
    scrape = Connection(svc.site)
    scrape.send("GET", "/metrics")
    assert 'llmproxy_fallbacks_total{fallback="small",model="mid"} 1.0' in \
        scrape.response().body.decode()


def test_no_header_without_a_fallback() -> None:
    """A request its own model serves carries no X-LLMProxy-Model."""
    svc, http, _, _ = make()
    conn = ask(svc, "mid")
    ok(http.calls[0])
    assert "x-llmproxy-model" not in conn.response().headers


def test_an_engine_that_will_not_start_falls_back_then_the_next_host_down_too() -> None:
    """big's engine fails to start on gpu3: mid on gpu1 (its upstream name); gpu1
    refuses: small on gpu2. Two route.fallback events, the header names small."""
    svc, http, agent, _ = make()
    with capturedLogs() as events:
        conn = ask(svc, "big")
        agent.last().answer({"ok": False, "error": "big exited with status 1"})
        agent.last("status").answer({"ok": True, "engines": []})
        assert [(host_of(c), model_of(c)) for c in http.calls] == [("gpu1", "mid-up")]
        refuse(http.calls[0])
        assert [(host_of(c), model_of(c)) for c in http.calls][1] == ("gpu2", "small")
        ok(http.calls[1])
    assert conn.response().headers["x-llmproxy-model"] == "small"
    assert [(e.model, e.fallback) for e in fallbacks(events)] == [("big", "mid"),
                                                                   ("mid", "small")]
    assert "failed: big exited with status 1" in fallbacks(events)[0].reason


def test_a_failed_engine_falls_back_at_once() -> None:
    """An engine the supervisor marked failed (a crash loop) is a refusal before the
    queue: the request goes to mid without asking the agent for a start."""
    svc, http, agent, _ = make()
    supervisor = svc.fleet.managers["gpu3"].supervisor
    record = supervisor.record("big")
    record.failed = True
    starts = len([c for c in agent.calls if c.order.get("op") == "start"])
    conn = ask(svc, "big")
    assert [host_of(c) for c in http.calls] == ["gpu1"]
    assert len([c for c in agent.calls if c.order.get("op") == "start"]) == starts
    ok(http.calls[0])
    assert conn.response().headers["x-llmproxy-model"] == "mid"


def test_a_cordoned_host_sends_it_to_the_fallback_without_trying_it() -> None:
    """gpu1 cordoned: a request for mid goes straight to small."""
    svc, http, _, _ = make()
    cordon = Connection(svc.site, "127.0.0.1")
    cordon.send("POST", "/admin/cordon?host=gpu1")
    assert cordon.response().json()["outcome"] == "cordoned"
    conn = ask(svc, "mid")
    assert [host_of(c) for c in http.calls] == ["gpu2"]
    ok(http.calls[0])
    assert conn.response().headers["x-llmproxy-model"] == "small"


def test_a_full_queue_falls_back_and_a_model_without_fallbacks_gets_429() -> None:
    """gpu1 takes one at a time and queues one: the third request for mid goes to
    small; one for solo (no fallbacks) on the same full queue gets 429."""
    svc, http, _, _ = make()
    ask(svc, "mid")
    ask(svc, "mid")
    assert len(http.calls) == 1
    third = ask(svc, "mid")
    assert [host_of(c) for c in http.calls] == ["gpu1", "gpu2"]
    ok(http.calls[1])
    assert third.response().headers["x-llmproxy-model"] == "small"
    solo = ask(svc, "solo").response()
    assert solo.status == 429 and solo.json()["error"]["code"] == "queue_full"


# -- when it does not ------------------------------------------------------------
def test_no_fallback_once_anything_reached_an_engine() -> None:
    """The request was written (ResponseNeverReceived): 502, nothing else asked. An
    engine's own error status is relayed. A stream cut after its first bytes is cut
    for the client, and nothing goes to small."""
    svc, http, _, _ = make()
    conn = ask(svc, "mid")
    http.calls[0].deferred.errback(Failure(ResponseNeverReceived([Failure(OSError("reset"))])))
    assert conn.response().status == 502 and len(http.calls) == 1
    error = ask(svc, "mid")
    failed = FakeResponse(500, {"Content-Type": "application/json", "Content-Length": "2"})
    http.calls[1].deferred.callback(failed)
    failed.send(b"{}")
    failed.finish()
    assert error.response().status == 500 and len(http.calls) == 2
    stream = ask(svc, "mid")
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[2].deferred.callback(upstream)
    upstream.send(b'data: {"choices": []}\n\n')
    upstream.die()
    assert len(http.calls) == 3
    cut = stream.response()
    assert cut.status == 200 and not cut.complete
    assert "x-llmproxy-model" not in cut.headers


def test_a_queue_timeout_is_answered_not_passed_on() -> None:
    """A request that waited queue_timeout_seconds in gpu1's queue gets its 503;
    it does not go to small."""
    svc, http, _, clock = make()
    ask(svc, "mid")
    waiting = ask(svc, "mid")
    clock.advance(10)
    resp = waiting.response()
    assert resp.status == 503 and resp.json()["error"]["code"] == "queue_timeout"
    assert len(http.calls) == 1


def test_the_last_models_failure_is_the_answer() -> None:
    """mid down, then small down too: small's 502 is the answer, naming small."""
    svc, http, _, _ = make()
    conn = ask(svc, "mid")
    refuse(http.calls[0])
    refuse(http.calls[1])
    resp = conn.response()
    assert resp.status == 502 and resp.json()["error"]["code"] == "upstream_failed"
    assert resp.headers["x-llmproxy-model"] == "small" and len(http.calls) == 2


def test_a_key_without_access_to_a_fallback_skips_it() -> None:
    """A key scoped to big and small: big's engine fails, mid (out of scope) is
    skipped, small (mid's fallback) serves. A key scoped to mid alone gets mid's
    own 502 when gpu1 is down."""
    def digest(secret: str) -> str:
        return hashlib.sha256(secret.encode()).hexdigest()

    keys = parse_keys({"keys": [
        {"name": "edge", "sha256": digest("edge-secret"), "models": ["big", "small"]},
        {"name": "mid", "sha256": digest("mid-secret"), "models": ["mid"]}]}, "keys.json")
    svc, http, agent, _ = make(keys=keys)
    conn = ask(svc, "big", Authorization="Bearer edge-secret")
    agent.last().answer({"ok": False, "error": "big exited with status 1"})
    agent.last("status").answer({"ok": True, "engines": []})
    assert [(host_of(c), model_of(c)) for c in http.calls] == [("gpu2", "small")]
    ok(http.calls[0])
    assert conn.response().headers["x-llmproxy-model"] == "small"
    alone = ask(svc, "mid", Authorization="Bearer mid-secret")
    refuse(http.calls[1])
    resp = alone.response()
    assert resp.status == 502 and len(http.calls) == 2
    assert "x-llmproxy-model" not in resp.headers


def test_the_anthropic_path_follows_the_same_chain() -> None:
    """/v1/messages for mid with gpu1 down: small serves it, same header."""
    svc, http, _, _ = make()
    conn = ask(svc, "mid", "/v1/messages")
    refuse(http.calls[0])
    assert http.calls[1].url.endswith("/v1/messages") and model_of(http.calls[1]) == "small"
    ok(http.calls[1])
    assert conn.response().headers["x-llmproxy-model"] == "small"


def test_a_stream_that_waited_with_pings_falls_back_inside_its_event_stream() -> None:
    """A streamed request for big waits for its engine (its 200 and pings already
    sent); the start fails: mid serves it inside the same event stream, with no
    X-LLMProxy-Model (its head was sent) and one route.fallback."""
    svc, http, agent, clock = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.send("POST", "/v1/chat/completions",
                  json.dumps({"model": "big", "stream": True}).encode())
        clock.advance(1)                    # the first ping: the 200 is out
        agent.last().answer({"ok": False, "error": "big exited with status 1"})
        agent.last("status").answer({"ok": True, "engines": []})
        assert [(host_of(c), model_of(c)) for c in http.calls] == [("gpu1", "mid-up")]
        upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
        http.calls[0].deferred.callback(upstream)
        upstream.send(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
        upstream.finish()
    resp = conn.response()
    assert resp.status == 200 and resp.complete and "x-llmproxy-model" not in resp.headers
    assert b": queued 1st for gpu3, about 119 s" in resp.body and b"data: [DONE]" in resp.body
    assert [(e.model, e.fallback) for e in fallbacks(events)] == [("big", "mid")]
