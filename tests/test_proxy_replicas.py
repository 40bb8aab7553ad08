"""Models served by several hosts, through the real Site with a fake upstream and
task.Clock: the catalog's replica routes and their spellings, failover exactly
where nothing was sent (refused, never written, an engine that would not start)
and never after, affinity through the proxy, and what /v1/models and /status
say about which hosts serve a model."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.error import ConnectionRefusedError, TimeoutError
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.web._newclient import RequestNotSent, ResponseNeverReceived

from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.agentfakes import FakeAgentTransport
from llmproxy.testing.fakes import Connection, FakeHTTPClient, FakeResponse

CONFIG: dict[str, Any] = {
    "header_timeout_seconds": 30,
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"},
              {"name": "gpu2", "url": "http://10.0.0.6:8081"},
              {"name": "gpu3", "url": "http://10.0.0.7:8081", "ssh": "llm@gpu3",
               "engines": {"big": {"command": ["llama-server"]}}}],
    "models": {"qwen": {"hosts": ["gpu1", "gpu2"], "upstream": "qwen-up",
                        "affinity": "header:X-Session-Id"},
               "big": {"hosts": ["gpu3", "gpu1"], "engine": "big"}},
}


def make(config: dict[str, Any] | None = None
         ) -> tuple[LLMProxyService, FakeHTTPClient, FakeAgentTransport, Clock]:
    clock = Clock()
    http = FakeHTTPClient()
    agent = FakeAgentTransport()
    svc = build_service(ServiceInputs(parse_config(config or CONFIG), clock, http=http,
                                      agent=agent))
    for host in ("gpu1", "gpu2"):
        svc.runtime.rosters.record_success(host, 1, (RosterEntry("qwen-up"),
                                                     RosterEntry("big"), RosterEntry("tiny")))
    return svc, http, agent, clock


def ask(svc: LLMProxyService, model: str = "qwen", **headers: str) -> Connection:
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", json.dumps({"model": model}).encode(), headers)
    return conn


def ok(call: Any) -> None:
    response = FakeResponse(200, {"Content-Type": "application/json", "Content-Length": "2"})
    call.deferred.callback(response)
    response.send(b"{}")
    response.finish()


def host_of(call: Any) -> str:
    return {"10.0.0.5": "gpu1", "10.0.0.6": "gpu2", "10.0.0.7": "gpu3"}[
        call.url.split("//")[1].split(":")[0]]


def test_the_catalog_lists_a_replica_model_once_with_its_hosts() -> None:
    """`hosts` makes one listed name with every host; `gpu2/qwen` spells gpu2 alone;
    a model two rosters list (and the catalog does not name) is served by both."""
    svc, _, _, _ = make()
    catalog = svc.runtime.catalog
    qwen = catalog.resolve("qwen")
    assert qwen is not None and [h.name for h in qwen.hosts] == ["gpu1", "gpu2"]
    pinned = catalog.resolve("gpu2/qwen")
    assert pinned is not None and [h.name for h in pinned.hosts] == ["gpu2"]
    tiny = catalog.resolve("tiny")
    assert tiny is not None and [h.name for h in tiny.hosts] == ["gpu1", "gpu2"]
    assert not tiny.catalogued
    conn = Connection(svc.site)
    conn.send("GET", "/v1/models")
    by_id = {m["id"]: m["llmproxy"] for m in conn.response().json()["data"]}
    assert by_id["qwen"]["hosts"] == ["gpu1", "gpu2"]
    assert by_id["qwen"]["available_on"] == ["gpu1", "gpu2"]
    assert by_id["tiny"]["hosts"] == ["gpu1", "gpu2"] and "gpu2/qwen" not in by_id


def test_with_host_naming_each_host_is_listed_and_the_plain_name_is_the_replicas() -> None:
    """naming host: gpu1/qwen and gpu2/qwen are listed; plain qwen reaches both."""
    svc, _, _, _ = make({**CONFIG, "naming": "host"})
    names = [r.name for r in svc.runtime.catalog.routes()]
    assert names[:2] == ["gpu1/qwen", "gpu2/qwen"]
    route = svc.runtime.catalog.resolve("qwen")
    assert route is not None and len(route.hosts) == 2


def test_a_refused_connection_fails_over_to_the_next_host() -> None:
    """Connection refused on the first host (nothing sent): the same request goes to
    the other host, whose answer the client gets; the failover is logged."""
    svc, http, _, _ = make()
    conn = ask(svc)
    first = host_of(http.calls[0])
    with capturedLogs() as events:
        http.calls[0].deferred.errback(Failure(ConnectionRefusedError("Connection refused")))
    assert len(http.calls) == 2 and host_of(http.calls[1]) != first
    assert http.calls[1].body == http.calls[0].body
    ok(http.calls[1])
    assert conn.response().status == 200
    assert any(f"{first} unreachable" in formatEvent(e) and "nothing was sent" in
               formatEvent(e) for e in events)


def test_a_request_never_written_or_a_connect_timeout_fails_over_too() -> None:
    """RequestNotSent (after its one retry on a fresh connection) and a connect
    timeout: nothing reached the engine, so the next host gets it."""
    for error in (RequestNotSent(), TimeoutError("connect timed out")):
        svc, http, _, _ = make()
        conn = ask(svc)
        if isinstance(error, RequestNotSent):
            http.calls[0].deferred.errback(Failure(error))     # the retry on a fresh one
            http.calls[1].deferred.errback(Failure(error))
        else:
            http.calls[0].deferred.errback(Failure(error))
        ok(http.calls[-1])
        assert conn.response().status == 200
        assert host_of(http.calls[-1]) != host_of(http.calls[0])


def test_no_failover_once_the_request_may_have_reached_an_engine() -> None:
    """ResponseNeverReceived (the request was written) and a header timeout: 502 and
    504 as with one host; nothing is sent anywhere else."""
    svc, http, _, clock = make()
    conn = ask(svc)
    http.calls[0].deferred.errback(Failure(ResponseNeverReceived([Failure(OSError("reset"))])))
    assert conn.response().status == 502 and len(http.calls) == 1
    slow = ask(svc)
    clock.advance(30)
    assert slow.response().status == 504 and len(http.calls) == 2


def test_the_last_host_refusing_is_a_502() -> None:
    """Both hosts refuse: the second failure is answered, 502 upstream_failed."""
    svc, http, _, _ = make()
    conn = ask(svc)
    for call in list(http.calls):
        call.deferred.errback(Failure(ConnectionRefusedError()))
    http.calls[1].deferred.errback(Failure(ConnectionRefusedError()))
    resp = conn.response()
    assert resp.status == 502 and resp.json()["error"]["code"] == "upstream_failed"
    assert len(http.calls) == 2


def test_an_engine_that_will_not_start_fails_over_to_another_host() -> None:
    """`big` on gpu3 (managed) and gpu1, whose last roster read failed (so gpu3 comes
    first): gpu3's start fails, nothing reached an engine, and gpu1 still serves it."""
    svc, http, agent, _ = make()
    svc.runtime.rosters.record_failure("gpu1", 2, "Connection refused")
    conn = ask(svc, "big")
    assert agent.last().order["op"] == "start" and http.calls == []
    agent.last().answer({"ok": False, "error": "big exited with status 1"})
    agent.last("status").answer({"ok": True, "engines": []})
    assert [host_of(c) for c in http.calls] == ["gpu1"]
    ok(http.calls[0])
    assert conn.response().status == 200


def test_affinity_keeps_a_session_on_its_host_through_the_proxy() -> None:
    """Requests with X-Session-Id s1 all go to the host the first went to, though it
    is the busier one; other sessions spread."""
    svc, http, _, _ = make()
    ask(svc, **{"X-Session-Id": "s1"})
    home = host_of(http.calls[0])
    for _ in range(3):
        ask(svc, **{"X-Session-Id": "s1"})
    assert {host_of(c) for c in http.calls} == {home}
    ask(svc, **{"X-Session-Id": "s2"})
    assert host_of(http.calls[-1]) != home


def test_status_says_which_hosts_serve_each_model() -> None:
    """/status `models`: each listed name with its hosts and where its roster has it."""
    svc, _, _, _ = make()
    conn = Connection(svc.site)
    conn.send("GET", "/status")
    models = {m["name"]: m for m in conn.response().json()["models"]}
    assert models["qwen"]["hosts"] == ["gpu1", "gpu2"]
    assert models["qwen"]["affinity"] == "header:X-Session-Id"
    assert models["big"]["hosts"] == ["gpu3", "gpu1"] and models["big"]["engine"] == "big"
