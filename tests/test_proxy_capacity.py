"""A host's slots and queue seen by clients, through the real Site with a fake
upstream and task.Clock: requests beyond max_concurrent wait and go upstream in
arrival order, a full queue is a 429 and a long wait a 503 (both with
Retry-After, OpenAI-style bodies), a waiting streaming client hears pings, a
client that leaves the queue never reaches the engine, and /status shows it."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock

from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.lifecycle.upgrade import Launcher
from llmproxy.testing.fakes import (
    Connection,
    FakeHTTPClient,
    FakeResponse,
)
from llmproxy.testing.upgradefakes import ReadyCandidates, hand_over_to
from llmproxy.web.errorbody import ERROR_LIMIT, ERROR_TIMEOUT

CONFIG = {
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081", "max_concurrent": 1,
               "max_queue": 2, "queue_timeout_seconds": 10}],
    "models": {"qwen": {"host": "gpu1"}},
}


def make(config: dict[str, Any] | None = None) -> tuple[LLMProxyService, FakeHTTPClient, Clock]:
    clock = Clock()
    http = FakeHTTPClient()
    svc = build_service(ServiceInputs(parse_config(config or CONFIG), clock, http=http,
                                      launcher=Launcher(ReadyCandidates())))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen"),))
    return svc, http, clock


def ask(svc: LLMProxyService, tag: str, stream: bool = False) -> Connection:
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions",
              json.dumps({"model": "qwen", "stream": stream, "user": tag}).encode())
    return conn


def answer(call: Any) -> None:
    response = FakeResponse(200, {"Content-Type": "application/json", "Content-Length": "2"})
    call.deferred.callback(response)
    response.send(b"{}")
    response.finish()


def test_requests_beyond_max_concurrent_go_upstream_one_at_a_time_in_order() -> None:
    """max_concurrent 1: the second and third requests are not sent upstream until the
    one before them is answered, and they go in arrival order."""
    svc, http, _ = make()
    conns = [ask(svc, f"c{i}") for i in range(3)]
    assert len(http.calls) == 1
    for i in range(3):
        assert json.loads(http.calls[i].body)["user"] == f"c{i}"
        answer(http.calls[i])
        assert len(http.calls) == min(i + 2, 3)
    assert [c.response().status for c in conns] == [200, 200, 200]


def test_a_full_queue_answers_429_with_retry_after() -> None:
    """One in flight and two waiting (max_queue 2): the next gets 429 rate_limit_error
    queue_full with Retry-After, and never goes upstream."""
    svc, http, _ = make()
    asked = [ask(svc, f"c{i}") for i in range(3)]
    refused = ask(svc, "c3")
    resp = refused.response()
    assert resp.status == 429 and resp.headers["retry-after"] == "5"
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
    assert error["message"] == ("model qwen: the queue of host gpu1 is full (2 waiting, "
                                "max_queue)")
    assert len(http.calls) == 1
    _leave(svc, asked)


def _leave(svc: LLMProxyService, conns: list[Connection]) -> None:
    """The clients still waiting or served go away: nothing is left in flight (a
    request left in flight would be resumed whenever its objects are collected,
    at the interpreter's exit at the latest, after its fake transport is gone)."""
    for conn in conns:
        conn.disconnect()
    assert not svc.inflight.active


def test_a_request_that_waited_too_long_answers_503_with_retry_after() -> None:
    """queue_timeout_seconds 10: a request still waiting then gets 503 queue_timeout."""
    svc, http, clock = make()
    ask(svc, "c0")
    late = ask(svc, "c1")
    clock.advance(10)
    resp = late.response()
    assert resp.status == 503 and resp.headers["retry-after"] == "5"
    assert resp.json()["error"]["code"] == "queue_timeout"
    assert len(http.calls) == 1


def test_a_waiting_streaming_client_hears_pings_and_a_timeout_as_an_error_event() -> None:
    """A streaming client waiting for a slot gets `: queued 1st for gpu1, ...` comments
    (the same pings as for an engine switch; `wait unknown` while no request duration
    was measured); a queue timeout after them is an error event."""
    svc, _, clock = make()
    ask(svc, "c0")
    waiting = ask(svc, "c1", stream=True)
    clock.advance(1)
    assert waiting.response().body == b": queued 1st for gpu1, wait unknown\n\n"
    clock.advance(9)
    resp = waiting.response()
    event = json.loads(resp.body.split(b"data: ", 1)[1])
    assert event["error"]["code"] == 503 and "queue_timeout_seconds" in event["error"]["message"]
    assert not resp.complete and waiting.closed


def test_an_error_status_after_the_pings_is_an_error_event_with_its_body() -> None:
    """A streaming client that heard pings has its 200 already: an engine that
    then answers with an error status reaches it as an error event carrying the
    status and the engine's body, and the stream is cut, not ended."""
    svc, http, clock = make()
    first = ask(svc, "c0")
    waiting = ask(svc, "c1", stream=True)
    clock.advance(1)
    answer(http.calls[0])
    assert first.response().status == 200
    response = FakeResponse(503, {"Content-Type": "application/json"})
    http.calls[1].deferred.callback(response)
    assert b"data: " not in waiting.response().body     # the body is read first
    response.send(b'{"error": "loading model"}')
    response.finish()
    resp = waiting.response()
    assert resp.status == 200 and resp.body.startswith(b": queued 1st for gpu1")
    event = json.loads(resp.body.split(b"data: ", 1)[1])
    assert event["error"]["code"] == 503
    assert event["error"]["message"] == 'upstream gpu1 answered 503: {"error": "loading model"}'
    assert not resp.complete and waiting.closed


def test_an_endless_or_stalled_error_answer_after_the_pings_is_cut_to_its_start() -> None:
    """An engine's error answer to a stream already begun is not trusted to be short or to
    end: its first bytes make the error event at once, the engine connection is closed; one
    that stalls gives what came after ERROR_TIMEOUT."""
    svc, http, clock = make()
    first = ask(svc, "c0")
    endless, stalled = ask(svc, "c1", stream=True), ask(svc, "c2", stream=True)
    clock.advance(1)
    answer(http.calls[0])
    assert first.response().status == 200
    huge = FakeResponse(500)
    http.calls[1].deferred.callback(huge)
    huge.send(b"x" * (ERROR_LIMIT + 10))
    assert huge.transport.stopped
    event = json.loads(endless.response().body.split(b"data: ", 1)[1])
    assert event["error"]["message"] == "upstream gpu1 answered 500: " + "x" * 500
    assert endless.closed
    slow = FakeResponse(502)
    http.calls[2].deferred.callback(slow)
    slow.send(b"partial")
    clock.advance(ERROR_TIMEOUT - 0.1)
    assert b"data: " not in stalled.response().body and not slow.transport.stopped
    clock.advance(0.1)
    assert slow.transport.stopped and stalled.closed
    event = json.loads(stalled.response().body.split(b"data: ", 1)[1])
    assert event["error"]["message"] == "upstream gpu1 answered 502: partial"


def test_a_client_that_leaves_the_queue_never_reaches_the_engine() -> None:
    """A queued client disconnects: it is out of the queue at once, and when the slot
    frees the next one goes upstream, never the one that left."""
    svc, http, _ = make()
    ask(svc, "c0")
    gone = ask(svc, "gone")
    behind = ask(svc, "behind")
    gone.disconnect()
    assert svc.fleet.gates["gpu1"].queued() == 1
    answer(http.calls[0])
    assert [json.loads(c.body)["user"] for c in http.calls] == ["c0", "behind"]
    answer(http.calls[1])
    assert behind.response().status == 200


def test_status_shows_each_hosts_slots_and_queue() -> None:
    """/status: per host in flight, queued, max_concurrent, max_queue, the oldest wait."""
    svc, _, clock = make()
    asked = [ask(svc, "c0"), ask(svc, "c1")]
    clock.advance(3)
    conn = Connection(svc.site)
    conn.send("GET", "/status")
    [host] = conn.response().json()["hosts"]
    assert host["capacity"] == {"in_flight": 1, "queued": 1, "max_concurrent": 1,
                                "max_queue": 2, "queue_timeout_seconds": 10.0,
                                "oldest_wait_seconds": 3.0, "cordoned": False}
    _leave(svc, asked)


def test_after_a_hand_over_a_request_waiting_for_a_slot_goes_to_the_new_process() -> None:
    """An upgrade's hand-over closes the hosts: a request still waiting for a slot (so
    nothing of it reached an engine) is re-sent to the new process, as the client sent
    it; the one in flight goes on here."""
    svc, http, _ = make()
    ask(svc, "c0")
    waiting = ask(svc, "c1")
    assert hand_over_to(svc.upgrade, "http://127.0.0.1:4711").called
    svc.stop_readiness()
    assert http.calls[1].url == "http://127.0.0.1:4711/v1/chat/completions"
    assert json.loads(http.calls[1].body)["user"] == "c1"
    answer(http.calls[1])
    assert waiting.response().status == 200


def test_a_plain_stop_still_serves_a_request_waiting_for_a_slot() -> None:
    """SIGTERM without a successor: the waiting request is served when the slot frees
    (the drain waits for it), not refused."""
    svc, http, _ = make()
    ask(svc, "c0")
    waiting = ask(svc, "c1")
    svc.stop_readiness()
    answer(http.calls[0])
    assert json.loads(http.calls[1].body)["user"] == "c1"
    answer(http.calls[1])
    assert waiting.response().status == 200
