"""Client input, bounded: what a client chose (its model, path, a key it repeats)
reaches an event, a log line or an error body only as `core.text.shown` makes
it (a bounded prefix, on one line), a model over 256 bytes is a 400, and a body
that names its model twice (JSON or form) is a 400 that reaches no engine. Each
test runs on the reference path and with the speedups."""

from __future__ import annotations

import json
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from llmproxy.core.events import RequestEnded
from llmproxy.core.hub import Hub
from llmproxy.core.text import MARKER, shown
from llmproxy.observe.inflight import DETAIL_SHOWN, InFlight
from llmproxy.testing.fakes import Connection
from llmproxy.web.forward import MODEL_BYTES
from tests.test_multipart import form, post
from tests.test_multipart import make as make_multipart
from tests.test_proxy import CONFIG, access_lines, chat, make

MiB = 1 << 20
BIG = {**CONFIG, "max_body_bytes": 4 * MiB}


# Each test on the reference path and with the speedups (conftest.py's `on_both_paths`).
pytestmark = pytest.mark.usefixtures("on_both_paths")


# -- the model's length ---------------------------------------------------------------
def error_of(conn: Connection) -> tuple[int, dict[str, Any]]:
    resp = conn.response()
    return resp.status, resp.json()["error"]


@pytest.mark.parametrize("model", ["m" * 300, "é" * 129, "m" * MiB, "\n" * 300])
def test_a_model_over_256_bytes_is_400_quoting_a_bounded_prefix(model: str) -> None:
    """A model over 256 bytes of UTF-8 (300 ASCII, 129 two-byte characters, a
    megabyte, 300 newlines) is 400 string_above_max_length, invalid_request_error;
    its message quotes at most a 64-character escaped prefix, nothing goes
    upstream, and the access line (one line) has no model."""
    svc, http, _ = make(BIG)
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.send("POST", "/v1/chat/completions", chat(model))
    status, error = error_of(conn)
    assert (status, error["type"], error["code"]) == (
        400, "invalid_request_error", "string_above_max_length")
    assert f"maximum length {MODEL_BYTES} bytes" in error["message"]
    assert len(error["message"]) < 300 and "\n" not in error["message"]
    assert not http.calls
    [line] = access_lines(events)
    assert "\n" not in line and "model=- " in line and "status=400" in line


def test_a_model_of_256_bytes_is_routed() -> None:
    """The bound refuses nothing at it: 128 two-byte characters (256 bytes) are
    a name like any other (unknown here: 404, named whole)."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat("é" * 128))
    status, error = error_of(conn)
    assert (status, error["code"]) == (404, "model_not_found")
    assert "é" * 128 in error["message"]


def test_a_form_model_over_256_bytes_is_400() -> None:
    """The bound holds for a multipart form's model field too."""
    svc, http, _ = make_multipart()
    resp = post(svc, form(("model", b"w" * 300, None), ("file", b"x", "a.wav"))).response()
    assert (resp.status, resp.json()["error"]["code"]) == (400, "string_above_max_length")
    assert "w" * 65 not in resp.json()["error"]["message"]
    assert http.calls == []


# -- what a client chose, in events, log lines and error bodies -----------------------
def test_a_model_with_a_line_break_leaves_one_line_and_an_escaped_event() -> None:
    """A model holding a newline and a forged access line: its 404 quotes it
    escaped, its access line is one line, and its event's model is escaped."""
    svc, _, _ = make()
    ended: list[RequestEnded] = []
    svc.parts.hub.subscribe(lambda e: ended.append(e) if isinstance(e, RequestEnded) else None)
    forged = "x\nINFO 1-1 POST /v1/chat/completions model=qwen status=200"
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.send("POST", "/v1/chat/completions", chat(forged))
    status, error = error_of(conn)
    assert status == 404 and "\n" not in error["message"]
    assert "x\\x0aINFO 1-1" in error["message"]
    [line] = access_lines(events)
    assert "\n" not in line and "model=x\\x0aINFO" in line
    assert [e.model for e in ended] == [shown(forged)]


def test_a_path_with_control_characters_is_shown_escaped() -> None:
    """A request target Twisted takes may hold bytes that read as C1 control
    characters (\\x85 is a line break to str.splitlines): the access line
    escapes them, and a long one is cut."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.channel.dataReceived(b"GET /x\x85y" + b"z" * 5000
                                  + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert conn.response().status == 404
    [line] = access_lines(events)
    assert len(line.splitlines()) == 1 and "/x\\x85y" in line and len(line) < 600


def test_an_admin_path_refused_is_quoted_bounded() -> None:
    """An admin path asked from off loopback is refused quoting the path shown."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.channel.dataReceived(b"POST /admin/" + b"\xb0" * 4000
                              + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    status, error = error_of(conn)
    assert status == 403 and len(error["message"]) < 400 and MARKER in error["message"]


def test_an_exchange_keeps_what_the_client_chose_shown() -> None:
    """The record of a request (its /status entry, its events) holds its method,
    path, model and notes bounded and on one line."""
    inflight = InFlight(Clock(), Hub(), id_prefix="t")
    exchange = inflight.begin("M" * 100, "/p\u2028" + "q" * 1000, "10.0.0.1")
    exchange.asked_for("m\r\n" * 500)
    exchange.note("the engine said:\n" + "e" * 5000)
    snap = exchange.snapshot(0)
    assert snap["method"] == "M" * 32 + MARKER
    assert snap["path"].startswith("/p\\u2028q") and len(snap["path"]) <= 257
    assert snap["model"].startswith("m\\x0d\\x0a") and len(snap["model"]) <= 257
    assert exchange.detail is not None and "\n" not in exchange.detail
    assert len(exchange.detail) <= DETAIL_SHOWN + 1


# -- a model named twice ----------------------------------------------------------
@pytest.mark.parametrize("body", [
    b'{"model": "coder", "messages": [], "model": "mistral"}',
    b'{"model": "coder", "mod\\u0065l": "mistral"}',
    b' {"stream": true, "model": "coder", "stream": false} ',
])
def test_a_json_body_repeating_a_top_level_key_is_400(body: bytes) -> None:
    """A top-level key twice (the model, spelled plainly or escaped, or another)
    is 400 duplicate_key naming it; nothing goes upstream."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", body)
    status, error = error_of(conn)
    assert (status, error["code"], error["type"]) == (400, "duplicate_key",
                                                      "invalid_request_error")
    assert "more than once" in error["message"]
    assert not http.calls


def test_a_key_repeated_below_the_top_level_is_forwarded() -> None:
    """Only the top level is the proxy's to read: a repeated key inside a
    message is the engine's business, forwarded as it came."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions",
              b'{"model": "coder", "messages": [{"role": "user", "role": "system"}]}')
    [call] = http.calls
    assert json.loads(call.body)["model"] == "qwen-up"


@pytest.mark.parametrize("parts", [
    (("model", b"whisper", None), ("model", b"other", None)),
    (("model", b"whisper", None), ("file", b"x", "a.wav"), ("model", b"whisper", None)),
    (("model", b"whisper", None), ("model", b"other", "m.txt")),
    (("stream", b"false", None), ("model", b"whisper", None), ("stream", b"true", None)),
])
def test_a_form_repeating_a_field_the_proxy_reads_is_400(
        parts: tuple[tuple[str, bytes, str | None], ...]) -> None:
    """A form with two `model` parts (fields, or a field and a file) or two
    `stream` fields is 400 duplicate_field; nothing goes upstream."""
    svc, http, _ = make_multipart()
    resp = post(svc, form(*parts)).response()
    assert (resp.status, resp.json()["error"]["code"]) == (400, "duplicate_field")
    assert http.calls == []


# -- two Host headers ---------------------------------------------------------------
@pytest.mark.parametrize("head", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nhOST: a\r\nX-B: 2\r\n",
    b"GET /healthz HTTP/1.1\r\nHOST: a\r\nHost: \r\n",
])
@pytest.mark.parametrize("split", [False, True])
def test_two_host_headers_are_400(head: bytes, split: bool) -> None:
    """Two Host headers (any case, the second last or not, either empty) are a
    400 bad_request (RFC 9112 section 3.2), whole or a byte at a time: nothing
    is dispatched or forwarded, and the connection closes."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    data = head + b"Content-Length: 2\r\n\r\n{}"
    with capturedLogs() as events:
        for piece in [data[i:i + 1] for i in range(len(data))] if split else [data]:
            conn.channel.dataReceived(piece)
    resp = conn.response()
    assert resp.status == 400 and resp.json()["error"]["code"] == "bad_request"
    assert "Host" in resp.json()["error"]["message"]
    assert conn.closed and not http.calls and not access_lines(events)
    assert conn.transport.value().count(b"HTTP/1.1 ") == 1


def test_one_host_header_is_served() -> None:
    """One Host header is a request like any other."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    conn.send("POST", "/v1/chat/completions", chat())
    assert len(http.calls) == 1


# -- a chunk declared past the limit ------------------------------------------------
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


@pytest.mark.parametrize("first", [b"", b"10\r\n" + b"a" * 16 + b"\r\n"])
@pytest.mark.parametrize("together", [False, True])
def test_a_chunk_declared_past_the_limit_is_413_at_its_size_line(
        first: bytes, together: bool) -> None:
    """A chunk whose size line declares more than is left of max_body_bytes
    (1000 here) is answered 413 in the turn its size line arrives, before any of
    its data (no body timeout waited for), with the head or after it; nothing
    is forwarded and the connection reads no more."""
    svc, http, clock = make()
    conn = Connection(svc.site)
    line = b"fffffff;x=y\r\n"
    if together:
        conn.channel.dataReceived(HEAD + first + line)
    else:
        conn.channel.dataReceived(HEAD + first)
        assert conn.transport.value() == b""
        conn.channel.dataReceived(line)
    clock.advance(0)
    resp = conn.response()
    assert resp.status == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert conn.transport.producerState == "paused" and not http.calls
    conn.channel.dataReceived(b"zz\r\n\r\n" * 100)       # what follows: never read
    clock.advance(0)
    assert conn.transport.value().count(b"HTTP/1.1 ") == 1


def test_chunks_up_to_the_limit_are_forwarded() -> None:
    """Chunks declaring max_body_bytes in all, exactly, are read and forwarded:
    the size lines refuse nothing within the limit."""
    svc, http, clock = make()
    conn = Connection(svc.site)
    body = chat()
    pad = b" " * (1000 - len(body))
    conn.channel.dataReceived(HEAD + f"{len(body):x}\r\n".encode() + body + b"\r\n")
    conn.channel.dataReceived(f"{len(pad):X}\r\n".encode() + pad + b"\r\n0\r\n\r\n")
    clock.advance(0)
    [call] = http.calls
    assert json.loads(call.body)["model"] == "qwen-up"
