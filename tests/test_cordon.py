"""Cordons, in memory and on file: the atomic cordon file, a cordoned host taking
no new request (503 host_cordoned with Retry-After) while its running stream
finishes, the loopback-only admin endpoints, the cordon read back by a new
process (restart, upgrade), and an unreadable file refusing the start (78)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from llmproxy.config import parse_config
from llmproxy.hosts.cordons import CordonFile, CordonFileError
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.agentfakes import FakeAgentTransport
from llmproxy.testing.fakes import Connection, FakeHTTPClient, FakeResponse


def config(tmp_path: Path) -> dict[str, Any]:
    return {
        "runtime_dir": str(tmp_path / "run"),
        "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"},
                  {"name": "gpu2", "url": "http://10.0.0.6:8081", "ssh": "llm@10.0.0.6",
                   "engines": {"big": {"command": ["llama-server"]}}}],
        "models": {"qwen": {"host": "gpu1"}, "big": {"host": "gpu2", "engine": "big"}},
        # the Host the in-memory client (testing.fakes.Connection) names: keyless
        # admin actions answer only IP literals, localhost and these
        "server_names": ["proxy"],
    }


def make(tmp_path: Path) -> tuple[LLMProxyService, FakeHTTPClient, FakeAgentTransport]:
    http = FakeHTTPClient()
    agent = FakeAgentTransport()
    svc = build_service(ServiceInputs(parse_config(config(tmp_path)), Clock(), http=http,
                                      agent=agent))
    svc.fleet.load_cordons()
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen"),))
    svc.fleet.managers["gpu2"].controller.assume("big")
    return svc, http, agent


def post(svc: LLMProxyService, path: str, body: bytes = b"", client: str = "127.0.0.1",
         ) -> Connection:
    conn = Connection(svc.site, client)
    conn.send("POST", path, body)
    return conn


def chat(model: str = "qwen") -> bytes:
    return json.dumps({"model": model, "stream": True}).encode()


def test_the_cordon_file_is_written_atomically_and_read_back(tmp_path: Path) -> None:
    """save() replaces the file whole (no temp file left); load() gives what was
    saved; no file means no cordons."""
    file = CordonFile(str(tmp_path / "run"))
    assert file.load() == {}
    file.save({"gpu2": 5.0, "gpu1": 7.5})
    assert file.load() == {"gpu1": 7.5, "gpu2": 5.0}
    assert os.listdir(tmp_path / "run") == ["cordons.json"]
    assert json.loads((tmp_path / "run" / "cordons.json").read_text()) == {
        "cordoned": {"gpu1": 7.5, "gpu2": 5.0}}


@pytest.mark.parametrize("text", ["{", "[]", '{"cordoned": ["gpu1"]}',
                                  '{"cordoned": {"gpu1": "now"}}'])
def test_an_unreadable_cordon_file_is_an_error_naming_it(tmp_path: Path, text: str) -> None:
    """Anything but {"cordoned": {HOST: SECONDS}} is a CordonFileError naming the file."""
    (tmp_path / "cordons.json").write_text(text)
    with pytest.raises(CordonFileError, match=f"cannot read cordons from {tmp_path}"):
        CordonFile(str(tmp_path)).load()


def test_a_cordoned_host_takes_no_new_request_and_its_stream_finishes(tmp_path: Path) -> None:
    """A stream runs on gpu1 when it is cordoned: it completes; a new request for a
    model only gpu1 serves gets 503 host_cordoned with Retry-After, and never goes
    upstream; uncordoned, the host serves again."""
    svc, http, _ = make(tmp_path)
    stream = post(svc, "/v1/chat/completions", chat(), client="10.0.0.9")
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[0].deferred.callback(upstream)
    with capturedLogs() as events:
        answer = post(svc, "/admin/cordon?host=gpu1")
    assert answer.response().json() == {"outcome": "cordoned", "host": "gpu1",
                                         "in_flight": 1, "queued": 0}
    assert ("cordoned gpu1: it takes no new request; 1 in flight and 0 queued there finish"
            in [formatEvent(e) for e in events])
    refused = post(svc, "/v1/chat/completions", chat(), client="10.0.0.9").response()
    assert refused.status == 503 and refused.headers["retry-after"] == "30"
    assert refused.json()["error"]["code"] == "host_cordoned"
    assert len(http.calls) == 1
    upstream.send(b"data: [DONE]\n\n")
    upstream.finish()
    assert stream.response().complete
    assert post(svc, "/admin/uncordon?host=gpu1").response().json()["outcome"] == "uncordoned"
    post(svc, "/v1/chat/completions", chat(), client="10.0.0.9")
    assert len(http.calls) == 2


def test_admin_endpoints_answer_loopback_only_and_name_unknown_hosts(tmp_path: Path) -> None:
    """From another address: 403; an unknown host: 404 naming it; GET: 405."""
    svc, _, _ = make(tmp_path)
    assert post(svc, "/admin/cordon?host=gpu1", client="10.0.0.9").response().status == 403
    unknown = post(svc, "/admin/cordon?host=gpu9").response()
    assert unknown.status == 404 and unknown.json()["reason"] == "no host named 'gpu9'"
    conn = Connection(svc.site, "127.0.0.1")
    conn.send("GET", "/admin/uncordon?host=gpu1")
    assert conn.response().status == 405
    assert not svc.fleet.gates["gpu1"].cordoned


def test_a_cordon_survives_into_a_new_process_on_the_same_runtime_dir(tmp_path: Path) -> None:
    """What one process cordoned, the next one (a restart, or an upgrade's successor,
    which reads the same file at start-up) has cordoned too; /status shows it."""
    first, _, _ = make(tmp_path)
    post(first, "/admin/cordon?host=gpu2")
    second, _, _ = make(tmp_path)
    assert second.fleet.gates["gpu2"].cordoned and not second.fleet.gates["gpu1"].cordoned
    conn = Connection(second.site)
    conn.send("GET", "/status")
    hosts = {h["name"]: h for h in conn.response().json()["hosts"]}
    assert hosts["gpu2"]["capacity"]["cordoned"] is True
    assert post(second, "/v1/chat/completions", chat("big")).response().status == 503


def test_an_unreadable_cordon_file_refuses_the_start_with_78(tmp_path: Path) -> None:
    """A cordon file that cannot be read: the proxy does not start (EX_CONFIG), rather
    than forget a cordon and send requests to a host under maintenance."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "cordons.json").write_text("{")
    svc = build_service(ServiceInputs(parse_config(config(tmp_path)), Clock(),
                                      http=FakeHTTPClient(), agent=FakeAgentTransport()))
    svc.listener.open = lambda: None         # type: ignore[method-assign]
    with pytest.raises(SystemExit) as info:
        svc.privilegedStartService()
    assert info.value.code == 78
    svc.fleet.release()


def test_an_operators_stop_waits_for_the_stream_on_the_engine(tmp_path: Path) -> None:
    """POST /admin/engine?op=stop while a stream runs on gpu2's engine: no stop order
    until the stream ends, then one; the answer says done and that nothing runs."""
    svc, http, agent = make(tmp_path)
    post(svc, "/v1/chat/completions", chat("big"), client="10.0.0.9")
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[0].deferred.callback(upstream)
    stop = post(svc, "/admin/engine?host=gpu2&op=stop")
    assert agent.calls == [] and stop.transport.value() == b""
    upstream.finish()
    assert agent.last().order["op"] == "stop"
    agent.last().answer({"ok": True, "stopped": [{"engine": "big", "pid": 7, "killed": False}]})
    assert stop.response().json() == {"outcome": "done", "host": "gpu2", "op": "stop",
                                      "engine": None, "reason": None, "running": None,
                                      "resident": []}


def test_an_operators_start_answers_the_agents_reason_when_it_fails(tmp_path: Path) -> None:
    """op=start: a switch through the queue; a failed start is a 409 with the agent's
    reason; an unmanaged host is a 409 that says so."""
    svc, _, agent = make(tmp_path)
    svc.fleet.managers["gpu2"].controller.assume(None)
    start = post(svc, "/admin/engine?host=gpu2&op=start&engine=big")
    agent.last().answer({"ok": False, "error": "big exited with status 1"})
    agent.last("status").answer({"ok": True, "engines": []})
    resp = start.response()
    assert resp.status == 409 and resp.json()["reason"] == (
        "switching host gpu2 to engine big failed: big exited with status 1")
    plain = post(svc, "/admin/engine?host=gpu1&op=stop").response()
    assert plain.status == 409
    assert plain.json()["reason"] == "host gpu1 is not managed (it has no engines)"
