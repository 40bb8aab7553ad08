"""The proxy's HTTP behaviour, end to end through the real Site and HTTPChannel,
with a fake upstream client and task.Clock: routing, streaming relay,
backpressure, cancellation and every error answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.logger import LogEvent, capturedLogs, formatEvent
from twisted.python.failure import Failure

from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.speedups import Selection
from llmproxy.testing.fakes import Connection, FakeHTTPClient, FakeResponse
from tests.selections import compat_entries, environment_speedups

CONFIG = {
    "listen": "127.0.0.1:0",
    "header_timeout_seconds": 30,
    "max_body_bytes": 1000,
    "hosts": [
        {"name": "gpu1", "url": "http://10.0.0.5:8081"},
        {"name": "laptop", "url": "http://10.0.0.7:11434/base"},
    ],
    "models": {
        "qwen": {"host": "gpu1", "upstream": "qwen-up", "ctx": 32768},
        "mistral": {"host": "laptop"},
        "gone": {"host": "laptop", "upstream": "not-listed"},
    },
    "aliases": {"coder": "qwen"},
}


def make(config: dict[str, Any] | None = None, speedups: Selection | None = None
         ) -> tuple[LLMProxyService, FakeHTTPClient, Clock]:
    """The proxy on task.Clock with a fake upstream client; its speedups those
    `speedups` names, else those of the environment (LLMPROXY_SPEEDUPS)."""
    clock = Clock()
    http = FakeHTTPClient()
    chosen = environment_speedups() if speedups is None else speedups
    svc = build_service(ServiceInputs(parse_config(config or CONFIG), clock, http=http,
                                      speedups=chosen,
                                      compat=compat_entries()))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen-up", 4096),
                                           RosterEntry("extra", 2048)))
    svc.runtime.rosters.record_success("laptop", 1, (RosterEntry("mistral", 8192),))
    return svc, http, clock


# The speedups whose request and relay frame a stream's pieces and send them
# now (send_piece, stream_transport, the engine connection's take_data: the
# response_writes request and the engine_client relay): the tests of that path
# name them; every other test runs on what the environment selects.
RESPONSE_WRITES = Selection(True, ("response_writes", "engine_client"))


def chat(model: str = "coder", stream: bool = True) -> bytes:
    return json.dumps({"model": model, "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


def access_lines(events: list[LogEvent]) -> list[str]:
    return [formatEvent(e) for e in events if e.get("log_namespace") == "llmproxy.access"]


def sse(n: int) -> bytes:
    return f"data: {{\"n\": {n}}}\n\n".encode()


def streamed(conn: Connection, http: FakeHTTPClient) -> FakeResponse:
    """A streamed chat completion sent on `conn`, its engine answering with an
    event stream's head (the body is the test's to send)."""
    conn.send("POST", "/v1/chat/completions", chat())
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[-1].deferred.callback(upstream)
    return upstream


def test_a_bug_while_the_engines_headers_are_handled_is_a_logged_500(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in the proxy's own code once the engine's headers are in is
    neither taken for the engine's failure (a 502) nor lost: the client gets
    llmproxy's 500, the log says it was a bug, and the request ends."""
    def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    from llmproxy.speedups.relaychunks import ChunkRelay
    from llmproxy.web.relay import Relay

    for relay in (Relay, ChunkRelay):      # whichever the speedups select
        monkeypatch.setattr(relay, "response_headers", staticmethod(broken))
    svc, http, _ = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        streamed(conn, http)
    resp = conn.response()
    assert resp.status == 500 and resp.json()["error"]["code"] == "internal_error"
    bugs = [e for e in events if "bug while answering" in formatEvent(e)]
    assert len(bugs) == 1 and bugs[0]["log_failure"].check(RuntimeError)
    assert not svc.inflight.active


def test_stream_is_relayed_chunk_by_chunk_before_upstream_finishes() -> None:
    """Every upstream chunk reaches the client as it arrives, in order, and the
    stream ends cleanly (terminating chunk) only when the upstream ends."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        upstream = streamed(conn, http)
        assert len(http.calls) == 1
        upstream.send(sse(1))
        first = conn.response()
        assert first.body == sse(1) and not first.complete
        upstream.send(sse(2))
        assert conn.response().body == sse(1) + sse(2)
        upstream.send(b"data: [DONE]\n\n")
        upstream.finish()
    done = conn.response()
    assert done.complete and done.status == 200
    assert done.body == sse(1) + sse(2) + b"data: [DONE]\n\n"
    assert done.headers["x-accel-buffering"] == "no"
    assert done.headers["transfer-encoding"] == "chunked"
    [line] = access_lines(events)
    assert "model=coder host=gpu1 status=200" in line and "outcome=completed" in line
    assert not svc.inflight.active


def test_a_streams_bytes_and_events_are_counted_whichever_way_they_went(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's first piece goes out with the head (the request's write); the
    next ones are framed and sent by the relay itself (`_send`), and one that
    comes while the channel holds its writes goes the write way again. Either
    way, the record counts every byte and every event, in flight and in the
    access line."""
    from llmproxy.speedups.relaychunks import ChunkRelay
    from llmproxy.speedups.responsewrites import SendingRequest

    routes: list[str] = []
    write, send = SendingRequest.write, ChunkRelay._send

    def spy_write(self: SendingRequest, data: bytes) -> None:
        routes.append("write")
        write(self, data)

    def spy_send(self: ChunkRelay, data: bytes) -> None:
        routes.append("send")
        send(self, data)

    monkeypatch.setattr(SendingRequest, "write", spy_write)
    monkeypatch.setattr(ChunkRelay, "_send", spy_send)
    svc, http, _ = make(speedups=RESPONSE_WRITES)
    conn = Connection(svc.site)
    with capturedLogs() as events:
        upstream = streamed(conn, http)
        [exchange] = svc.inflight.active.values()
        upstream.send(sse(1))
        upstream.send(sse(2) + sse(3))
        channel = conn.channel
        channel.gather()                   # the channel holds writes for a moment
        upstream.send(sse(4))
        channel.flush()
        upstream.send(b"data: [DONE]\n\n")
        body = sse(1) + sse(2) + sse(3) + sse(4) + b"data: [DONE]\n\n"
        assert (exchange.bytes_sent, exchange.events) == (len(body), 5)
        upstream.finish()
    assert routes == ["write", "send", "send", "write", "send"]
    done = conn.response()
    assert done.complete and done.body == body
    [line] = access_lines(events)
    assert f"status=200 bytes={len(body)} " in line


def test_a_streams_reads_go_out_framed_by_the_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read's data reaches the relay in one piece: the first goes with the
    head (the request's write); once the client's response is under way the
    relay frames each piece as one chunk of its own and sends it now, and the
    engine connection hands each next one straight to the relay's `_send` (one
    while the channel holds its writes is held with them, in its turn). Bytes,
    events and the engine's usage are counted as for any piece; a client that
    leaves takes the shortcut away, and one that closes after [DONE] got it all."""
    from llmproxy.speedups.relaychunks import ChunkRelay as Relay

    routes: list[str] = []
    data_received, send = Relay.dataReceived, Relay._send

    def spy_data(self: Relay, data: bytes) -> None:
        routes.append("dataReceived")
        data_received(self, data)

    def spy_send(self: Relay, data: bytes) -> None:
        routes.append("_send")
        send(self, data)

    monkeypatch.setattr(Relay, "dataReceived", spy_data)
    monkeypatch.setattr(Relay, "_send", spy_send)
    svc, http, _ = make(speedups=RESPONSE_WRITES)
    conn = Connection(svc.site)
    usage = b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 7}}\n\n'
    with capturedLogs() as events:
        upstream = streamed(conn, http)
        [exchange] = svc.inflight.active.values()
        upstream.send(sse(1))
        assert upstream.data_handler is None
        upstream.send(sse(2))
        assert upstream.data_handler is not None       # under way: the shortcut is taken
        before = len(conn.transport.value())
        upstream.send(sse(3) + sse(4))                 # a read of two events: one chunk
        both = sse(3) + sse(4)
        assert conn.transport.value()[before:] == b"%x\r\n%b\r\n" % (len(both), both)
        conn.channel.gather()
        before = len(conn.transport.value())
        upstream.send(usage)
        assert len(conn.transport.value()) == before   # held with the channel's writes
        conn.channel.flush()
        assert conn.transport.value()[before:] == b"%x\r\n%b\r\n" % (len(usage), usage)
        upstream.send(b"data: [DONE]\n\n")
        body = sse(1) + sse(2) + sse(3) + sse(4) + usage + b"data: [DONE]\n\n"
        assert (exchange.bytes_sent, exchange.events) == (len(body), 6)
        assert conn.response().body == body
        conn.disconnect()
        assert upstream.data_handler is None            # the client left: no shortcut
    assert routes == ["dataReceived"] * 2 + ["_send"] * 4
    [line] = access_lines(events)
    assert f"status=200 bytes={len(body)} " in line
    assert "outcome=completed tokens=3+7 (the client closed after [DONE])" in line


def test_each_read_goes_out_as_one_chunk_with_the_head_or_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Several events in one read (events that came together): the first read
    goes out with the response's head in one send, as one chunk; each later
    read in one send, as one chunk the proxy framed. Every event and byte is
    counted, and the usage in a piece of several events is found."""
    from twisted.internet.testing import StringTransport

    sends: list[bytes] = []
    write = StringTransport.write

    def spy(self: StringTransport, data: bytes) -> None:
        sends.append(data)
        write(self, data)

    monkeypatch.setattr(StringTransport, "write", spy)
    svc, http, _ = make(speedups=RESPONSE_WRITES)
    conn = Connection(svc.site)
    usage = b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 7}}\n\n'
    reads = [sse(0) + sse(1) + sse(2), sse(3) + sse(4), usage + b"data: [DONE]\n\n"]
    with capturedLogs() as events:
        upstream = streamed(conn, http)
        [exchange] = svc.inflight.active.values()
        sends.clear()
        upstream.send(reads[0])
        [first] = sends
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"chunked" in first
        assert first.endswith(b"\r\n\r\n%x\r\n%b\r\n" % (len(reads[0]), reads[0]))
        upstream.send(reads[1])
        assert sends[1:] == [b"%x\r\n%b\r\n" % (len(reads[1]), reads[1])]
        upstream.send(reads[2])
        body = b"".join(reads)
        assert (exchange.bytes_sent, exchange.events) == (len(body), 7)
        upstream.finish()
    assert conn.response().complete and conn.response().body == body
    assert (exchange.prompt_tokens, exchange.completion_tokens) == (3, 7)
    [line] = access_lines(events)
    assert f"status=200 bytes={len(body)} " in line


def test_an_http10_client_gets_a_stream_as_plain_data() -> None:
    """A client on HTTP/1.0 cannot take chunked framing: the engine's reads (of
    one event or several) reach it as their data alone, the response ends with
    the connection, and every event is counted."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    body = chat()
    conn.channel.dataReceived(b"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\n"
                              b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    upstream = FakeResponse(200, {"Content-Type": "text/event-stream"})
    http.calls[-1].deferred.callback(upstream)
    [exchange] = svc.inflight.active.values()
    upstream.send(sse(1) + sse(2))
    upstream.send(sse(3))
    upstream.send(sse(4) + b"data: [DONE]\n\n")
    upstream.finish()
    head, _, sent = conn.transport.value().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
    events = sse(1) + sse(2) + sse(3) + sse(4) + b"data: [DONE]\n\n"
    assert sent == events and conn.closed
    assert (exchange.bytes_sent, exchange.events) == (len(events), 5)


def test_the_usage_is_found_across_pieces_at_the_end_of_a_stream() -> None:
    """The engine's usage, cut between two reads the relay held, goes into the
    record when the body ends."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    upstream = streamed(conn, http)
    [exchange] = svc.inflight.active.values()
    upstream.send(sse(1))
    upstream.send(b'data: {"usage": {"prompt_tokens": 3, ')
    upstream.send(b'"completion_tokens": 7}}\n\n')
    upstream.send(b"data: [DONE]\n\n")
    upstream.finish()
    assert conn.response().complete
    assert (exchange.prompt_tokens, exchange.completion_tokens) == (3, 7)


def relayed_stream(monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[list[Any], Connection, FakeResponse, Any]:
    """A streamed request under way: the relays made for it (as they are
    made), the client's connection, the engine's response, the exchange."""
    from llmproxy.web import relay as relay_module

    relays: list[relay_module.Relay] = []
    init = relay_module.Relay.__init__

    def keep(self: relay_module.Relay, *args: Any) -> None:
        init(self, *args)
        relays.append(self)

    monkeypatch.setattr(relay_module.Relay, "__init__", keep)
    svc, http, _ = make()
    conn = Connection(svc.site)
    upstream = streamed(conn, http)
    [exchange] = svc.inflight.active.values()
    return relays, conn, upstream, exchange


def test_a_long_streams_tail_is_held_bounded_and_its_usage_still_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever way its pieces went, the relay holds only the body's last
    USAGE_TAIL bytes of data (and a little slack), never the whole stream, and
    the engine's usage at its end is found."""
    from llmproxy.web import relay as relay_module

    relays, conn, upstream, exchange = relayed_stream(monkeypatch)
    event = b"data: " + b"x" * 500 + b"\n\n"
    most = trims = 0
    for _ in range(200):
        before = relays[0]._held
        upstream.send(event)
        most = max(most, relays[0]._held)
        if relays[0]._held < before:
            # Trimmed to the fewest last pieces that hold USAGE_TAIL bytes.
            trims += 1
            assert relays[0]._held - len(relays[0]._tail[0]) < relay_module.USAGE_TAIL
    assert trims > 5
    assert relays[0]._held >= relay_module.USAGE_TAIL
    assert most <= relay_module.USAGE_TAIL + relay_module.TAIL_SLACK + len(event)
    assert relays[0]._held == sum(map(len, relays[0]._tail))
    upstream.send(b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 7}}\n\n')
    upstream.finish()
    assert conn.response().complete and exchange.events == 201
    assert (exchange.prompt_tokens, exchange.completion_tokens) == (3, 7)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.integers(1, 6000), max_size=60))
def test_any_pieces_leave_the_fewest_last_ones_and_the_usage_at_the_end(
        monkeypatch: pytest.MonkeyPatch, pieces: list[int]) -> None:
    """Pieces of any sizes: the relay holds the fewest last pieces that make
    USAGE_TAIL bytes of data (all of them while there are fewer), their data
    exactly the body's end, and finds the engine's usage."""
    from llmproxy.web import relay as relay_module

    relays, conn, upstream, exchange = relayed_stream(monkeypatch)
    body = b""
    for n, size in enumerate(pieces):
        data = (b"data: %d " % n + b"x" * size)[:size]
        upstream.send(data)
        body += data
        relay = relays[0]
        held = b"".join(relay._tail)
        assert held == body[len(body) - len(held):] and relay._held == len(held)
        assert relay._held >= min(len(body), relay_module.USAGE_TAIL)
        assert relay._held - len(relay._tail[0]) < relay_module.USAGE_TAIL or \
            relay._held <= relay_module.USAGE_TAIL + relay_module.TAIL_SLACK
    usage = b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 7}}\n\n'
    upstream.send(usage)
    upstream.finish()
    assert conn.response().complete and conn.response().body == body + usage
    assert (exchange.prompt_tokens, exchange.completion_tokens) == (3, 7)


def test_alias_resolved_and_upstream_name_substituted() -> None:
    """An alias routes to its model's host, and the body sent upstream carries the
    engine's own name for the model, every other field untouched."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions?x=1", chat("coder"))
    [call] = http.calls
    assert call.method == "POST"
    assert call.url == "http://10.0.0.5:8081/v1/chat/completions?x=1"
    sent = json.loads(call.body)
    assert sent == {"model": "qwen-up", "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}
    assert call.kwargs["unbuffered"] is True and call.kwargs["allow_redirects"] is False


def test_model_with_host_prefix_and_base_path() -> None:
    """`host/model` spellings route too, and a host URL's base path is kept."""
    svc, http, _ = make()
    Connection(svc.site).send("POST", "/v1/embeddings", json.dumps(
        {"model": "laptop/mistral", "input": "x"}).encode())
    [call] = http.calls
    assert call.url == "http://10.0.0.7:11434/base/v1/embeddings"
    assert json.loads(call.body)["model"] == "mistral"


def test_roster_only_model_is_routed_under_its_own_name() -> None:
    """A model the host lists but the catalog does not name is still served."""
    svc, http, _ = make()
    Connection(svc.site).send("POST", "/v1/completions", json.dumps(
        {"model": "extra", "prompt": "x"}).encode())
    [call] = http.calls
    assert call.url.startswith("http://10.0.0.5:8081/")
    assert json.loads(call.body)["model"] == "extra"


def test_hop_by_hop_headers_stripped_and_forwarded_for_added() -> None:
    """Hop-by-hop request and response headers never cross the proxy;
    X-Forwarded-For gains the client's address; end-to-end headers pass."""
    svc, http, _ = make()
    conn = Connection(svc.site, client_ip="10.9.8.7")
    conn.send("POST", "/v1/chat/completions", chat(stream=False), headers={
        "Connection": "keep-alive, X-Secret-Hop", "Keep-Alive": "timeout=5", "TE": "trailers",
        "X-Secret-Hop": "1", "Authorization": "Bearer k", "X-Forwarded-For": "192.0.2.1",
        "Proxy-Authorization": "Basic x", "Content-Type": "application/json; charset=utf-8"})
    [call] = http.calls
    sent = {k.decode().lower() for k, _ in call.headers.getAllRawHeaders()}
    assert not sent & {"connection", "keep-alive", "te", "x-secret-hop", "proxy-authorization",
                       "host", "content-length"}
    assert call.headers.getRawHeaders(b"authorization") == [b"Bearer k"]
    assert call.headers.getRawHeaders(b"x-forwarded-for") == [b"192.0.2.1, 10.9.8.7"]
    # (held back from Twisted's form parsing, and put back before forwarding)
    assert call.headers.getRawHeaders(b"content-type") == [b"application/json; charset=utf-8"]
    upstream = FakeResponse(200, {"Content-Type": "application/json", "Keep-Alive": "timeout=5",
                                  "Connection": "keep-alive", "Content-Length": "2",
                                  "X-Engine": "llama"})
    call.deferred.callback(upstream)
    upstream.send(b"{}")
    upstream.finish()
    resp = conn.response()
    assert resp.complete and resp.body == b"{}"
    assert "keep-alive" not in resp.headers and resp.headers["x-engine"] == "llama"
    assert resp.headers["content-length"] == "2" and "transfer-encoding" not in resp.headers
    assert "x-accel-buffering" not in resp.headers


def test_slow_client_pauses_the_upstream() -> None:
    """Backpressure: when the client's socket is full, the upstream is paused,
    and resumed when the client drains."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    upstream = streamed(conn, http)
    assert conn.transport.producer is not None
    conn.transport.producer.pauseProducing()
    assert upstream.transport.paused
    conn.transport.producer.resumeProducing()
    assert not upstream.transport.paused


def test_client_gone_mid_stream_stops_the_upstream() -> None:
    """A client that disconnects mid-stream closes the upstream connection at
    once, nothing more is written, and the access log says client-gone."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        upstream = streamed(conn, http)
        upstream.send(sse(1))
        written = conn.transport.value()
        conn.disconnect()
    assert upstream.transport.stopped
    assert conn.transport.value() == written
    [line] = access_lines(events)
    assert "outcome=client-gone" in line
    assert not svc.inflight.active


def test_a_client_that_closes_right_after_done_completed() -> None:
    """A client (the openai SDK) may close as soon as it read `data: [DONE]`, before
    the engine ends its body: it got everything, so the request completed."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        upstream = streamed(conn, http)
        upstream.send(sse(2) + b"data: [DONE]\n\n")
        conn.disconnect()
    assert upstream.transport.stopped
    [line] = access_lines(events)
    assert "outcome=completed (the client closed after [DONE])" in line


def test_client_gone_before_headers_cancels_the_upstream_request() -> None:
    """A client that leaves while the engine has not answered yet cancels the
    pending upstream request."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.send("POST", "/v1/chat/completions", chat())
        conn.disconnect()
    assert http.calls[0].cancelled
    assert "outcome=client-gone" in access_lines(events)[0]


def test_upstream_dying_mid_stream_cuts_the_client_visibly() -> None:
    """An engine that dies mid-stream ends the client's connection without the
    terminating chunk (never a fake clean end), and the log says so."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        upstream = streamed(conn, http)
        upstream.send(sse(1))
        upstream.die()
    resp = conn.response()
    assert resp.body == sse(1) and not resp.complete
    assert b"[DONE]" not in conn.transport.value()
    assert conn.closed
    [line] = access_lines(events)
    assert "outcome=upstream-failed" in line and "engine went away" in line


def error_of(conn: Connection) -> tuple[int, dict[str, Any]]:
    resp = conn.response()
    assert resp.headers["content-type"] == "application/json"
    doc = resp.json()
    assert set(doc["error"]) == {"message", "type", "code"}
    return resp.status, doc["error"]


@pytest.mark.parametrize("body, code", [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "missing_model"),
    (b'{"messages": []}', "missing_model"),
    (b'{"model": 7}', "missing_model"),
    (b'{"model": ""}', "missing_model"),
])
def test_bad_bodies_get_400(body: bytes, code: str) -> None:
    """A body that is not JSON, or has no string model, is a 400 and is never forwarded."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", body)
    status, error = error_of(conn)
    assert (status, error["code"], error["type"]) == (400, code, "invalid_request_error")
    assert not http.calls


def test_unknown_model_is_404_naming_it() -> None:
    """An unknown model is a 404 model_not_found whose message names the model."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat("gpt-9"))
    status, error = error_of(conn)
    assert (status, error["code"]) == (404, "model_not_found") and "'gpt-9'" in error["message"]
    assert not http.calls


def test_body_over_the_limit_is_413_and_the_connection_closes() -> None:
    """A body over max_body_bytes is refused with 413 without being forwarded."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", b'{"model": "coder", "x": "' + b"a" * 2000 + b'"}')
    status, error = error_of(conn)
    assert status == 413 and "max_body_bytes" in error["message"]
    assert not http.calls
    assert conn.response().headers["connection"] == "close"


def test_upstream_refusing_is_502() -> None:
    """An upstream that cannot be reached is a 502 naming the host."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.send("POST", "/v1/chat/completions", chat())
        http.calls[0].deferred.errback(ConnectionRefusedError("nope"))
    status, error = error_of(conn)
    assert status == 502 and "gpu1" in error["message"] and error["code"] == "upstream_failed"
    assert "outcome=upstream-failed" in access_lines(events)[0]


def test_upstream_slower_than_header_timeout_is_504() -> None:
    """No response headers within header_timeout_seconds: 504, and the upstream
    request is cancelled."""
    svc, http, clock = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat())
    clock.advance(29.9)
    assert conn.transport.value() == b""
    clock.advance(0.2)
    status, error = error_of(conn)
    assert status == 504 and error["code"] == "upstream_timeout" and "30s" in error["message"]
    assert http.calls[0].cancelled


def test_upstream_error_status_passes_through() -> None:
    """An engine's own error answer reaches the client unchanged."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat(stream=False))
    upstream = FakeResponse(500, {"Content-Type": "application/json"}, b"Internal Server Error")
    http.calls[0].deferred.callback(upstream)
    upstream.send(b'{"error": "boom"}')
    upstream.finish()
    resp = conn.response()
    assert resp.status == 500 and resp.body == b'{"error": "boom"}' and resp.complete


def test_models_list_merges_catalog_aliases_and_rosters() -> None:
    """/v1/models: catalog names with catalog ctx over the engine's, aliases,
    roster-only models, and a catalogued model its host does not list (still
    shown, marked unavailable)."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.send("GET", "/v1/models")
    doc = conn.response().json()
    by_id = {m["id"]: m for m in doc["data"]}
    assert list(by_id) == ["qwen", "mistral", "gone", "coder", "extra"]
    assert by_id["qwen"]["context_length"] == 32768           # catalog beats the engine's 4096
    assert by_id["mistral"]["context_length"] == 8192         # the engine's, when no catalog ctx
    assert by_id["coder"]["llmproxy"]["alias_of"] == "qwen"
    assert by_id["gone"]["llmproxy"]["available"] is False
    assert by_id["extra"]["owned_by"] == "gpu1"
    assert all(m["object"] == "model" for m in doc["data"])


def test_down_host_keeps_its_catalog_entries_and_status_shows_the_error() -> None:
    """A host whose roster cannot be read does not empty the list; /status names its error."""
    clock = Clock()
    svc = build_service(ServiceInputs(parse_config(CONFIG), clock, http=FakeHTTPClient()))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen-up"),))
    svc.runtime.rosters.record_failure("laptop", 1, "Connection refused")
    conn = Connection(svc.site)
    conn.send("GET", "/v1/models")
    ids = [m["id"] for m in conn.response().json()["data"]]
    assert "mistral" in ids and "gone" in ids
    conn2 = Connection(svc.site)
    conn2.send("GET", "/status")
    status = conn2.response().json()
    laptop = next(h for h in status["hosts"] if h["name"] == "laptop")
    assert laptop["roster"]["last_error"] == "Connection refused"


def test_naming_host_prefixes_listed_names() -> None:
    """naming: host lists `host/model`; plain names still resolve."""
    svc, http, _ = make(dict(CONFIG, naming="host"))
    conn = Connection(svc.site)
    conn.send("GET", "/v1/models")
    ids = [m["id"] for m in conn.response().json()["data"]]
    assert ids == ["gpu1/qwen", "laptop/mistral", "laptop/gone", "coder", "gpu1/extra"]
    Connection(svc.site).send("POST", "/v1/chat/completions", chat("gpu1/qwen"))
    assert json.loads(http.calls[0].body)["model"] == "qwen-up"


def test_model_retrieve() -> None:
    """GET /v1/models/<id> answers one entry, or 404 model_not_found."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.send("GET", "/v1/models/coder")
    assert conn.response().json()["llmproxy"]["alias_of"] == "qwen"
    conn2 = Connection(svc.site)
    conn2.send("GET", "/v1/models/nope")
    assert error_of(conn2)[0] == 404


def test_readiness_and_health() -> None:
    """/healthz answers as soon as the process runs; /readyz is 503 until the
    proxy has read the rosters and accepts."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.send("GET", "/healthz")
    assert conn.response().status == 200
    conn2 = Connection(svc.site)
    conn2.send("GET", "/readyz")
    assert conn2.response().status == 503


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/chat/completions", 405),
    ("POST", "/v1/models", 405),
    ("GET", "/nowhere", 404),
])
def test_wrong_paths_and_methods(method: str, path: str, status: int) -> None:
    """Unknown paths and wrong methods get OpenAI-style errors."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.send(method, path)
    assert error_of(conn)[0] == status


def test_status_lists_requests_in_flight() -> None:
    """/status shows each running request with its model, host and age."""
    svc, _, clock = make()
    Connection(svc.site).send("POST", "/v1/chat/completions", chat())
    clock.advance(2.5)
    conn = Connection(svc.site)
    conn.send("GET", "/status")
    doc = conn.response().json()
    running = [r for r in doc["in_flight"] if r["path"] == "/v1/chat/completions"]
    assert running[0]["model"] == "coder" and running[0]["host"] == "gpu1"
    assert running[0]["age_seconds"] == 2.5
    assert doc["version"] and doc["pid"] > 0


@pytest.mark.parametrize("never", ["RequestNotSent", "CrossedClose"])
def test_a_request_never_sent_is_sent_once_more_on_a_fresh_connection(never: str) -> None:
    """Twisted's RequestNotSent (the pooled connection was gone before a byte was
    written), or CrossedClose (the engine's idle close of a reused connection
    crossed the request; the client raises it for a body that streams, having
    sent a bytes body once more itself), is retried once; the answer of the
    second try reaches the client."""
    from twisted.web.client import RequestNotSent

    from llmproxy.web.engineclient import CrossedClose

    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat(stream=False))
    http.calls[0].deferred.errback(
        RequestNotSent() if never == "RequestNotSent" else CrossedClose([Failure(Exception())]))
    assert len(http.calls) == 2 and http.calls[1].body == http.calls[0].body
    upstream = FakeResponse(200, {"Content-Type": "application/json"})
    http.calls[1].deferred.callback(upstream)
    upstream.send(b'{"ok": 1}')
    upstream.finish()
    assert conn.response().status == 200 and conn.response().body == b'{"ok": 1}'


def test_a_request_that_may_have_reached_the_engine_is_never_retried() -> None:
    """Once bytes may have been written (the connection died waiting for the
    answer), the request is not sent again: the client gets a 502."""
    from twisted.web.client import ResponseNeverReceived

    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat(stream=False))
    http.calls[0].deferred.errback(ResponseNeverReceived([Failure(ConnectionRefusedError())]))
    assert len(http.calls) == 1 and conn.response().status == 502
