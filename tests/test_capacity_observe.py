"""Queue depth, cordons, replica choice and residency as an operator sees them:
in /metrics and in the event stream, through the real Site with a fake upstream
and task.Clock (the same events feed the log, the stream and the metrics)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.agentfakes import FakeAgentTransport
from llmproxy.testing.fakes import Connection, FakeHTTPClient, FakeResponse

CONFIG: dict[str, Any] = {
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081", "max_concurrent": 1,
               "max_queue": 1},
              {"name": "gpu2", "url": "http://10.0.0.6:8081"},
              {"name": "gpu3", "url": "http://10.0.0.7:8081", "ssh": "llm@gpu3",
               "min_engine_seconds": 30,
               "engines": {"a": {"command": ["x"]}, "b": {"command": ["y"]}}}],
    "models": {"solo": {"host": "gpu1"}, "both": {"hosts": ["gpu2", "gpu1"]},
               "ma": {"host": "gpu3", "engine": "a"}, "mb": {"host": "gpu3", "engine": "b"}},
}


def make(tmp_path: Path) -> tuple[LLMProxyService, FakeHTTPClient, FakeAgentTransport, Clock]:
    clock = Clock()
    http = FakeHTTPClient()
    agent = FakeAgentTransport()
    svc = build_service(ServiceInputs(parse_config({**CONFIG, "runtime_dir": str(tmp_path)}),
                                      clock, http=http, agent=agent))
    svc.parts.hub.subscribe(lambda e: published.setdefault(id(svc), []).append(e.type))
    for host in ("gpu1", "gpu2"):
        svc.runtime.rosters.record_success(host, 1, (RosterEntry("solo"), RosterEntry("both")))
    return svc, http, agent, clock


def ask(svc: LLMProxyService, model: str) -> Connection:
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", json.dumps({"model": model}).encode())
    return conn


def metrics(svc: LLMProxyService) -> dict[str, float]:
    conn = Connection(svc.site)
    conn.send("GET", "/metrics")
    out = {}
    for line in conn.response().body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


published: dict[int, list[str]] = {}


def event_types(svc: LLMProxyService) -> list[str]:
    """The types of the events published (what /api/events streams)."""
    return published.get(id(svc), [])


def test_queue_depth_and_rejections_show_in_metrics_and_events(tmp_path: Path) -> None:
    """One in flight, one waiting, one refused: depth 1 and a queue_full rejection in
    /metrics; queue.wait and queue.reject in the event stream; once served, the wait."""
    svc, http, _, clock = make(tmp_path)
    ask(svc, "solo")
    ask(svc, "solo")
    ask(svc, "solo")
    m = metrics(svc)
    assert m['llmproxy_queue_depth{host="gpu1"}'] == 1
    assert m['llmproxy_host_max_concurrent{host="gpu1"}'] == 1
    assert m['llmproxy_queue_rejections_total{host="gpu1",reason="queue_full"}'] == 1
    assert m['llmproxy_queue_waits_total{host="gpu1",reason="capacity"}'] == 1
    clock.advance(2)
    response = FakeResponse(200, {"Content-Length": "2"})
    http.calls[0].deferred.callback(response)
    response.send(b"{}")
    response.finish()
    assert metrics(svc)['llmproxy_queue_wait_seconds_count{host="gpu1"}'] == 1
    types = event_types(svc)
    assert {"queue.wait", "queue.reject", "queue.leave"} <= set(types)


def test_cordons_replica_choices_and_failovers_show_in_metrics_and_events(
        tmp_path: Path) -> None:
    """A cordon is a 0/1 gauge and a host.cordon event; each choice for a replicated
    model counts by host and reason; a failover counts by the host that failed."""
    svc, http, _, _ = make(tmp_path)
    svc.fleet.cordon("gpu1")
    ask(svc, "both")
    http.calls[0].deferred.errback(Failure(ConnectionRefusedError()))
    m = metrics(svc)
    assert m['llmproxy_host_cordoned{host="gpu1"}'] == 1
    assert m['llmproxy_host_cordoned{host="gpu2"}'] == 0
    assert m['llmproxy_replica_choices_total{host="gpu2",model="both",reason="only host up"}'] \
        == 1
    assert "llmproxy_failovers_total" not in " ".join(m)     # gpu2 was the only one open
    svc.fleet.cordon("gpu1", False)
    ask(svc, "both")
    first = http.calls[-1]
    failed = "gpu1" if "10.0.0.5" in first.url else "gpu2"
    first.deferred.errback(Failure(ConnectionRefusedError()))
    assert metrics(svc)[f'llmproxy_failovers_total{{host="{failed}"}}'] == 1
    types = event_types(svc)
    assert {"host.cordon", "replica.choice", "replica.failover"} <= set(types)


def test_residency_shows_as_seconds_left_and_as_a_switch_wait(tmp_path: Path) -> None:
    """After a switch on a host with min_engine_seconds, /metrics has its residency
    left and /status its engine's resident_seconds_left; a switch held by it counts
    as a switch wait with reason residency."""
    svc, http, agent, clock = make(tmp_path)
    ask(svc, "ma")
    agent.last().answer({"ok": True, "engine": "a", "pid": 1, "healthy": True})
    response = FakeResponse(200, {"Content-Length": "2"})
    # The chat request (the engine's readiness also re-reads the host's roster).
    [chat] = [c for c in http.calls if c.url.endswith("/v1/chat/completions")]
    chat.deferred.callback(response)
    response.send(b"{}")
    response.finish()
    clock.advance(3)         # a request for a came 3 s ago: requests for it keep coming
    ask(svc, "mb")
    m = metrics(svc)
    assert m['llmproxy_engine_resident_seconds{host="gpu3"}'] == 27
    assert m['llmproxy_engine_switch_waits_total{host="gpu3",reason="residency"}'] == 1
    conn = Connection(svc.site)
    conn.send("GET", "/status")
    hosts = {h["name"]: h for h in conn.response().json()["hosts"]}
    assert hosts["gpu3"]["engine"]["resident_seconds_left"] == 27
    assert hosts["gpu3"]["capacity"]["queued"] == 1
