"""The host lease on the proxy's side (issue 38, parts 3 and 4), on a clock with fakes: the
watch remembers what the agent said of the lease; a host held by another proxy refuses every
request naming the holder without an agent call, and its engines are dropped; a lease taken
after a wait adopts what runs there; a standby answers /readyz 503 `standby` and model
requests 503 `standby` (Retry-After), shows whom it waits for, and is taken over only once
every host's lease is held and adopted; orders carry this proxy's identity."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from llmproxy.agent.protocol import LeaseState
from llmproxy.config import parse_config
from llmproxy.hosts.agentclient import SSHAgentTransport
from llmproxy.hosts.agentstream import StreamEnded
from llmproxy.hosts.lease import held_text, holder_identity
from llmproxy.hosts.queueerrors import SwitchFailed
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.agentfakes import FakeAgentTransport, engine_found, status_answer
from llmproxy.testing.fakes import Connection, FakeHTTPClient
from tests.test_watch import make as make_watch

BIG = ["llama-server", "-m", "big.gguf"]
CONFIG = {
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081", "ssh": "llm@10.0.0.5",
               "engines": {"big": {"command": BIG}}},
              {"name": "gpu2", "url": "http://10.0.0.6:8081", "ssh": "llm@10.0.0.6",
               "engines": {"big": {"command": BIG}}}],
    "models": {"qwen": {"host": "gpu1", "engine": "big"}},
}
OTHER = {"machine": "proxy-b", "pid": 4242, "runtime_dir": "/run/b", "since": 0}


def make(standby: bool = False) -> tuple[LLMProxyService, FakeAgentTransport]:
    agent = FakeAgentTransport()
    svc = build_service(ServiceInputs(parse_config(CONFIG), Clock(), http=FakeHTTPClient(),
                                      agent=agent, fetch=lambda host: succeed(()),
                                      standby=standby))
    return svc, agent


def lease(held: bool, holder: dict[str, Any] = OTHER) -> dict[str, Any]:
    """A lease event line as the agent writes it."""
    return {"event": "lease", "held": held, "holder": holder}


def lease_said(held: bool, holder: dict[str, Any] = OTHER) -> LeaseState:
    """A lease event as the proxy decodes it."""
    return LeaseState(held, holder)


def test_the_watch_remembers_the_lease_until_its_session_ends() -> None:
    """held False with the holder, then held True; a broken session: not known (None)."""
    watch, _, streams, events = make_watch()
    watch.start()
    assert watch.snapshot(0)["lease"] == {"held": None, "holder": None}
    streams[0].on_event(lease(False))
    assert watch.held is False and watch.holder == OTHER
    assert watch.snapshot(0)["lease"] == {"held": False, "holder": OTHER}
    streams[0].on_event(lease(True, {"machine": "me", "pid": 1}))
    assert watch.held is True and isinstance(events[-1][1], LeaseState)
    streams[0].ended.callback(StreamEnded("gone"))
    assert watch.held is None


def test_a_host_held_elsewhere_refuses_by_name_and_calls_no_agent() -> None:
    """Refused: a request for the host's model is a 424 naming machine, pid and since, no
    start order is sent, the adopted engine is dropped, an operator's start is refused too,
    and /status shows held_by."""
    svc, agent = make()
    published: list[Any] = []
    svc.parts.hub.subscribe(published.append)
    manager = svc.fleet.managers["gpu1"]
    manager.controller.assume("big")
    svc.fleet.leases.event("gpu1", lease_said(False))
    svc.fleet.leases.event("gpu1", lease_said(False))      # said once, not per watch tick
    assert manager.running is None
    said = [e for e in published if e.type == "host.lease"]
    assert [(e.host, e.held) for e in said] == [("gpu1", False)]
    assert said[0].line() == ("warn", "host gpu1 is held by proxy-b pid 4242 since "
                              "1970-01-01T00:00:00Z: this proxy does not manage it and "
                              "waits for its lease")
    failures: list[Any] = []
    manager.acquire("big").addErrback(failures.append)
    assert isinstance(failures[0].value, SwitchFailed)
    assert "held by proxy-b pid 4242 since 1970-01-01T00:00:00Z" in str(failures[0].value)
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", json.dumps({"model": "qwen"}).encode())
    response = conn.response()
    assert response.status == 424 and "held by proxy-b pid 4242" in response.json()[
        "error"]["message"]
    reasons: list[Any] = []
    Deferred.fromCoroutine(svc.fleet.command("gpu1", "start", "big")).addCallback(
        reasons.append)
    assert reasons and "held by proxy-b" in reasons[0]
    assert agent.calls == []
    svc._ready = True
    status = Connection(svc.site)
    status.send("GET", "/status")
    [gpu1, _] = status.response().json()["hosts"]
    assert gpu1["engine"]["held_by"].startswith("held by proxy-b pid 4242")


def test_a_lease_taken_after_a_refusal_adopts_what_runs() -> None:
    """Once the holder lets go the lease is ours: the refusal is lifted and the host's
    engines are read and adopted (no start)."""
    svc, agent = make()
    manager = svc.fleet.managers["gpu1"]
    svc.fleet.leases.event("gpu1", lease_said(False))
    svc.fleet.leases.event("gpu1", lease_said(True, {"machine": "me", "pid": 1}))
    assert manager.held_by is None
    [call] = agent.calls
    assert call.order["op"] == "status"
    call.answer(status_answer(engine_found("big", BIG, pid=555)))
    assert manager.running == "big"


def test_a_standby_waits_for_every_lease_and_serves_nothing_meanwhile() -> None:
    """A standby: /readyz 503 with code standby and whom it waits for, a model request 503
    `standby` with Retry-After and no agent call, /status says so; taken() fires only
    once both hosts' leases are held and each one's engines adopted."""
    svc, agent = make(standby=True)
    assert svc.state == "standby"
    svc.fleet.leases.event("gpu1", lease_said(False))
    ready = Connection(svc.site)
    ready.send("GET", "/readyz")
    doc = ready.response()
    assert doc.status == 503 and doc.json()["code"] == "standby"
    assert doc.json()["waiting_for"] == {"gpu1": held_text(OTHER),
                                         "gpu2": "no answer from its agent yet"}
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", json.dumps({"model": "qwen"}).encode())
    refused = conn.response()
    assert refused.status == 503 and refused.json()["error"]["code"] == "standby"
    assert refused.headers.get("retry-after") == "5"
    assert agent.calls == []
    taken: list[Any] = []
    svc.fleet.leases.taken().addCallback(taken.append)
    me = {"machine": "me", "pid": 1}
    svc.fleet.leases.event("gpu2", lease_said(True, me))
    svc.fleet.leases.event("gpu1", lease_said(True, me))
    assert [c.order["op"] for c in agent.calls] == ["status", "status"]
    agent.calls[0].answer(status_answer())
    assert taken == []                         # gpu1 not adopted yet
    agent.calls[1].answer(status_answer(engine_found("big", BIG)))
    assert taken == [None] and svc.fleet.leases.waiting_for() == {}
    svc.fleet.leases.took_over()
    assert svc.state != "standby" and svc.status()["standby"] is False


def test_orders_and_watches_carry_this_proxys_identity(tmp_path: Any) -> None:
    """The ssh transport stamps every order with the protocol and, once the fleet locked
    its hosts, who sends it: this machine, this pid, the resolved runtime_dir."""
    transport = SSHAgentTransport(Clock(), ["ssh"])    # type: ignore[arg-type]
    assert "holder" not in transport.stamp({"op": "status"})
    transport.identify(holder_identity(str(tmp_path), pid=7, machine="m"))
    assert transport.stamp({"op": "stop"}) == {
        "op": "stop", "protocol": 4,
        "holder": {"machine": "m", "pid": 7, "runtime_dir": str(tmp_path.resolve())}}
