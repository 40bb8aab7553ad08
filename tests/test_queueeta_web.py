"""Queue position and ETA as clients see them, on HTTP/1.1 and HTTP/2 (the proxy
built as the service builds it, a fake engine client, task.Clock): a waiting
streaming client's keep-alive comment names its place and wait, and every answer
whose head was not sent carries X-LLMProxy-Queue-Wait, the seconds it waited."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock

from llmproxy.compat.goaway import GracefulH2Connection
from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.lifecycle.upgrade import Launcher
from llmproxy.testing.fakes import FakeHTTPClient, FakeResponse
from llmproxy.testing.upgradefakes import ReadyCandidates
from tests.h2client import Client
from tests.test_proxy_capacity import answer, ask

CONFIG = {
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081", "max_concurrent": 1,
               "max_queue": 4, "queue_timeout_seconds": 30}],
    "models": {"qwen": {"host": "gpu1"}},
}


def make() -> tuple[LLMProxyService, FakeHTTPClient, Clock]:
    clock = Clock()
    http = FakeHTTPClient()
    svc = build_service(ServiceInputs(parse_config(CONFIG), clock, http=http,
                                      launcher=Launcher(ReadyCandidates())))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen"),))
    return svc, http, clock


def stream_answer(call: Any) -> None:
    response = FakeResponse(200, {"Content-Type": "text/event-stream"})
    call.deferred.callback(response)
    response.send(b"data: [DONE]\n\n")
    response.finish()


def test_http11_a_waiting_stream_hears_its_place_and_a_plain_answer_says_its_wait() -> None:
    """Behind one request (one slot): the streaming one is 1st, its comment says so
    (`wait unknown`: no duration measured yet); the plain one behind it, served 2 s
    later, has X-LLMProxy-Queue-Wait 2.000; the first, served at once, 0.000."""
    svc, http, clock = make()
    first = ask(svc, "c0")
    waiting = ask(svc, "c1", stream=True)
    plain = ask(svc, "c2")
    clock.advance(1)
    assert waiting.response().body == b": queued 1st for gpu1, wait unknown\n\n"
    clock.advance(1)
    answer(http.calls[0])
    assert first.response().headers["x-llmproxy-queue-wait"] == "0.000"
    stream_answer(http.calls[1])
    assert waiting.response().body.endswith(b"data: [DONE]\n\n")
    assert "x-llmproxy-queue-wait" not in waiting.response().headers   # its head went first
    answer(http.calls[2])
    assert plain.response().headers["x-llmproxy-queue-wait"] == "2.000"


def test_http2_a_waiting_stream_hears_its_place_and_a_plain_answer_says_its_wait() -> None:
    """The same over HTTP/2 streams: the comment in the waiting stream's DATA, the
    header in the plain stream's HEADERS; once a duration is measured (the first
    request took 2 s), the next waiter's comment has an ETA."""
    svc, http, clock = make()
    client = Client(GracefulH2Connection(clock, svc.site, svc.parts.hub.publish), clock,
                    acknowledge=True)

    def post(tag: str, stream: bool = False) -> int:
        sid = client.post("/v1/chat/completions", {"content-type": "application/json"})
        client.send(sid, json.dumps({"model": "qwen", "stream": stream, "user": tag}).encode(),
                    end=True)
        return sid

    first = post("c0")
    waiting = post("c1", stream=True)
    plain = post("c2")
    clock.advance(1)
    client.pump()
    assert client.data[waiting] == b": queued 1st for gpu1, wait unknown\n\n"
    clock.advance(1)
    answer(http.calls[0])
    client.pump()
    assert client.headers[first]["x-llmproxy-queue-wait"] == "0.000"
    later = post("c3", stream=True)
    clock.advance(1)
    client.pump()
    # c1 holds the slot (2 s median), c2 is 1st: c3 is 2nd, about 2 + 2 = 4 s.
    assert client.data[later] == b": queued 2nd for gpu1, about 4 s\n\n"
    stream_answer(http.calls[1])
    answer(http.calls[2])
    client.pump()
    assert client.status[plain] == 200
    assert client.headers[plain]["x-llmproxy-queue-wait"] == "3.000"
