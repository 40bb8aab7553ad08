"""HTTP/2 streams judged from their headers (web/streams.py, through
llmproxy.compat.streamhooks): a real h2 client over a memory transport on a
task.Clock, against the proxy built as the service builds it (keys on). The
door, the body limit and the body timer answer before the body is read; the
stream is then reset with NO_ERROR; a body is kept in memory, not a file; the
entry's guard, and HTTP/2 not offered when it is off."""

from __future__ import annotations

import json
from io import BytesIO
from tempfile import SpooledTemporaryFile

import pytest
from twisted.internet.task import Clock

from llmproxy import compat
from llmproxy.compat import streamhooks
from llmproxy.compat.goaway import GracefulH2Connection
from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.accessfiles import AccessFiles
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.fakes import FakeHTTPClient
from llmproxy.web import streams
from tests.h2client import Client
from tests.test_access import CONFIG, SECRETS, ring

LIMIT = 1000
BODY_SECONDS = 5.0


def make(guarded: bool = True) -> tuple[LLMProxyService, Client, FakeHTTPClient, Clock]:
    clock, http = Clock(), FakeHTTPClient()
    config = parse_config({**CONFIG, "max_body_bytes": LIMIT,
                           "client_body_timeout_seconds": BODY_SECONDS})
    svc = build_service(ServiceInputs(config, clock, http=http,
                                      access_files=AccessFiles(keys=ring())))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen-up", 4096),))
    cls = streamhooks.hooked(GracefulH2Connection) if guarded else GracefulH2Connection
    client = Client(cls(clock, svc.site, svc.parts.hub.publish), clock, acknowledge=True)
    return svc, client, http, clock


KEY = {"authorization": f"Bearer {SECRETS['bob']}"}
CHAT = "/v1/chat/completions"


def test_the_guard_passes_on_the_twisted_it_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On, with the pinned Twisted; a changed method turns it off with the reason."""
    assert streamhooks.guard() is None and compat.select().on("h2_streams")
    name = "twisted.web._http2.H2Connection._requestReceived"
    monkeypatch.setitem(streamhooks.SOURCES, name, "0" * 16)
    assert f"{name} changed" in compat.select().off["h2_streams"]


def test_a_keyless_post_gets_401_before_its_body_and_the_stream_is_reset() -> None:
    """The door runs on the headers: 401 with the JSON error while the body
    has not come, then RST_STREAM(NO_ERROR); what the client still sends is
    not read; no engine is asked."""
    svc, client, http, _ = make()
    stream = client.post(CHAT, {"content-type": "application/json"})
    assert client.status[stream] == 401 and stream in client.ended
    assert client.error(stream)["code"] == "invalid_api_key"
    assert client.reset_code(stream) == 0
    assert not http.calls and not svc.inflight.active


def test_a_content_length_over_the_limit_gets_413_at_once() -> None:
    """A Content-Length over max_body_bytes: 413 before any DATA frame."""
    _, client, http, _ = make()
    stream = client.post(CHAT, {**KEY, "content-length": str(32 << 20)})
    assert client.status[stream] == 413 and client.error(stream)["code"] == "request_too_large"
    assert client.reset_code(stream) == 0 and not http.calls


def test_a_body_crossing_the_limit_gets_413_where_it_crosses() -> None:
    """No Content-Length: the running total past max_body_bytes is answered
    413 at that frame; later frames change nothing (no second answer)."""
    _, client, http, _ = make()
    stream = client.post(CHAT, KEY)
    client.send(stream, b"x" * 600)
    assert stream not in client.status
    client.send(stream, b"x" * 600)
    assert client.status[stream] == 413 and client.reset_code(stream) == 0
    assert not http.calls


def test_a_stalled_body_gets_408_after_the_body_timeout() -> None:
    """client_body_timeout_seconds without a DATA frame: 408; each frame
    starts the timer again."""
    svc, client, http, clock = make()
    stream = client.post(CHAT, KEY)
    clock.advance(BODY_SECONDS - 1)
    client.send(stream, b'{"model": ')
    clock.advance(BODY_SECONDS - 1)
    assert stream not in client.status
    clock.advance(1)
    client.pump()
    assert client.status[stream] == 408
    assert client.error(stream)["code"] == "request_timeout"
    assert "client_body_timeout_seconds" in client.error(stream)["message"]
    assert client.reset_code(stream) == 0 and not http.calls and not svc.inflight.active


def test_a_whole_body_in_time_is_forwarded_and_no_timer_is_left() -> None:
    """A body that ends in time goes to the engine; its timer is gone."""
    _, client, http, clock = make()
    stream = client.post(CHAT, KEY)
    client.send(stream, json.dumps({"model": "coder", "messages": []}).encode(), end=True)
    assert len(http.calls) == 1 and stream not in client.status
    assert not [c for c in clock.getDelayedCalls() if c.func.__name__ == "_timed_out"]


def test_a_stream_without_a_body_is_not_timed() -> None:
    """HEADERS with END_STREAM (a GET): no body timer."""
    _, client, _, clock = make()
    stream = int(client.h2.get_next_available_stream_id())
    client.h2.send_headers(stream, [(":method", "GET"), (":path", "/v1/models"),
                                    (":scheme", "https"), (":authority", "127.0.0.1"),
                                    *KEY.items()], end_stream=True)
    client.pump()
    assert client.status[stream] == 200 and client.reset_code(stream) is None
    assert not [c for c in clock.getDelayedCalls() if c.func.__name__ == "_timed_out"]


def test_bodies_are_kept_in_memory_not_in_a_file_per_stream() -> None:
    """Bodies of unknown length, or up to IN_MEMORY bytes, open no file."""
    assert isinstance(streams.body_file(100), BytesIO)
    assert isinstance(streams.body_file(streams.IN_MEMORY), BytesIO)
    spooled = streams.body_file(None)
    assert isinstance(spooled, SpooledTemporaryFile)
    spooled.write(b"x" * 1000)
    assert not spooled._rolled        # (still in memory)


def test_without_the_hooks_a_keyless_body_is_read_to_its_end() -> None:
    """Twisted's own behaviour, which the entry changes (and why HTTP/2 is not
    offered without it): no answer until the body ends."""
    _, client, _, _ = make(guarded=False)
    stream = client.post(CHAT)
    client.send(stream, b"x" * 100)
    assert stream not in client.status
    client.send(stream, b"}", end=True)
    assert client.status[stream] == 401


def test_a_refused_stream_whose_body_ends_in_the_same_read_is_answered_once() -> None:
    """Headers, body and END_STREAM in one read: one 401 (the end does not
    dispatch the request a second time), no engine asked."""
    svc, client, http, _ = make()
    stream = int(client.h2.get_next_available_stream_id())
    client.h2.send_headers(stream, [(":method", "POST"), (":path", CHAT), (":scheme", "https"),
                                    (":authority", "127.0.0.1")])
    client.h2.send_data(stream, b"{}", end_stream=True)
    client.pump()
    assert client.status[stream] == 401 and client.data[stream].count(b'"error"') == 1
    assert not http.calls and not svc.inflight.active
