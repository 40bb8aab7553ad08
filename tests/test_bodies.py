"""Hostile request bodies through the real Site and HTTPChannel, in memory: a
body over max_body_bytes is refused as soon as the proxy knows (before it is
read), the connection is half-closed and then aborted, deeply nested JSON is a
400, and Twisted's own malformed-request answer is an OpenAI-style JSON error."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.interfaces import ISSLTransport
from twisted.logger import capturedLogs
from zope.interface import directlyProvides

from llmproxy.testing.fakes import Connection, parse_response
from llmproxy.web import forward
from llmproxy.web.bodylimit import LINGER_SECONDS
from tests.test_proxy import CONFIG, access_lines, chat, make

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"


# Each test on the reference path and with the speedups (conftest.py's `on_both_paths`).
pytestmark = pytest.mark.usefixtures("on_both_paths")


def test_content_length_over_the_limit_is_413_before_the_body() -> None:
    """A Content-Length over max_body_bytes (1000 here) is answered 413 at the end
    of the headers, with no byte of the body sent; the connection reads nothing
    more, is half-closed after the answer, and aborted LINGER_SECONDS later."""
    svc, http, clock = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.channel.dataReceived(HEAD + b"Content-Length: 1073741824\r\n\r\n")
    resp = conn.response()
    assert resp.status == 413 and resp.complete
    assert resp.json()["error"]["code"] == "request_too_large"
    assert resp.headers["connection"] == "close"
    assert not http.calls
    assert conn.transport.write_closed and conn.transport.producerState == "paused"
    assert "status=413" in access_lines(events)[0]
    conn.channel.dataReceived(b"x" * 100_000)       # more of the body: ignored
    assert conn.transport.value() == parse_response_bytes(conn)
    assert not conn.transport.disconnecting
    clock.advance(LINGER_SECONDS)
    assert conn.closed


def parse_response_bytes(conn: Connection) -> bytes:
    data = conn.transport.value()
    assert parse_response(data).complete
    return data


def test_over_tls_the_413_is_followed_by_the_tls_close_not_a_tcp_half_close() -> None:
    """Over TLS the answer can still be in the TLS layer when the channel ends
    its writing side (Twisted's TLS transport writes on the next turn): the
    refused chunked body's 413 is followed by the TLS close (which sends what
    is buffered, then close_notify), never a TCP half-close under it, and the
    connection is still aborted LINGER_SECONDS later."""
    svc, _, clock = make()
    conn = Connection(svc.site)
    directlyProvides(conn.transport, ISSLTransport)
    aborted: list[bool] = []
    conn.transport.abortConnection = lambda: aborted.append(True)  # type: ignore[method-assign]
    conn.channel.dataReceived(HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
                              + b"800\r\n" + b"a" * 100)
    clock.advance(0)
    assert conn.response().status == 413
    assert conn.transport.disconnecting and not conn.transport.write_closed
    assert conn.transport.producerState == "paused" and aborted == []
    clock.advance(LINGER_SECONDS)
    assert aborted == [True]


def test_expect_100_continue_over_the_limit_gets_413_and_no_continue() -> None:
    """A client that asks before sending (Expect: 100-continue) is told 413 and
    never invited to send its body."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.channel.dataReceived(HEAD + b"Content-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
    data = conn.transport.value()
    assert b"100 Continue" not in data and data.startswith(b"HTTP/1.1 413 ")


def test_chunked_body_is_413_where_it_crosses_the_limit() -> None:
    """A chunked body is refused at the chunk that crosses the limit, without
    waiting for its end; what follows is not read."""
    svc, http, clock = make()
    conn = Connection(svc.site)
    conn.channel.dataReceived(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
    conn.channel.dataReceived(b"200\r\n" + b"a" * 512 + b"\r\n")
    assert conn.transport.value() == b""
    conn.channel.dataReceived(b"200\r\n" + b"a" * 512 + b"\r\n" + b"200\r\n" + b"a" * 100)
    clock.advance(0)
    resp = conn.response()
    assert resp.status == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert conn.transport.producerState == "paused" and conn.transport.write_closed
    conn.channel.dataReceived(b"a" * 412 + b"\r\n0\r\n\r\n")   # its end: changes nothing
    clock.advance(0)
    assert conn.transport.value().count(b"HTTP/1.1") == 1
    assert not http.calls


def test_chunked_body_ending_in_the_crossing_read_is_answered_once() -> None:
    """The crossing chunk and the body's end in one read: one 413, no second dispatch."""
    svc, _, clock = make()
    conn = Connection(svc.site)
    conn.channel.dataReceived(HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
                              + b"400\r\n" + b"a" * 1024 + b"\r\n0\r\n\r\n")
    clock.advance(0)
    assert conn.transport.value().count(b"HTTP/1.1 413") == 1
    assert not svc.inflight.active


def test_chunked_body_under_the_limit_is_forwarded() -> None:
    """A chunked body within the limit is read whole and forwarded."""
    svc, http, _ = make()
    conn = Connection(svc.site)
    body = chat()
    conn.channel.dataReceived(HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
                              + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    [call] = http.calls
    assert json.loads(call.body)["model"] == "qwen-up"


def test_deeply_nested_json_is_400_invalid_json() -> None:
    """100,000 nested arrays (a RecursionError in the parser) are a 400, not a 500."""
    svc, http, _ = make({**CONFIG, "max_body_bytes": 1 << 20})
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.send("POST", "/v1/chat/completions", b"[" * 100_000)
    resp = conn.response()
    assert resp.status == 400 and resp.json()["error"]["code"] == "invalid_json"
    assert not http.calls
    assert not [e for e in events if "log_failure" in e]


def test_malformed_request_gets_a_json_400() -> None:
    """Twisted's own refusal of a malformed request (here a bad Content-Length)
    is an OpenAI-style JSON error too: the service mixes llmproxy.compat's
    badrequest entry into its channel (tests/test_compat.py has the entry on
    and off)."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.channel.dataReceived(HEAD + b"Content-Length: lots\r\n\r\n")
    resp = conn.response()
    assert resp.status == 400 and resp.json()["error"]["code"] == "bad_request"
    assert resp.headers["connection"] == "close"


def test_a_header_line_too_long_gets_a_json_431() -> None:
    """A line longer than the line reader takes is answered (431, JSON), not just
    dropped."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    conn.channel.dataReceived(HEAD + b"X-Long: " + b"a" * 70_000)
    resp = conn.response()
    assert resp.status == 431 and "error" in resp.json()


def test_a_content_type_the_email_package_rejects_is_no_crash() -> None:
    """Twisted would parse a POST body by its Content-Type through the email
    package, which raises on a value such as "\\x0b\\x01" (found by the property
    test): the header is held back from that parsing, and the request is
    answered like any other."""
    svc, _, _ = make()
    conn = Connection(svc.site)
    with capturedLogs() as events:
        conn.send("POST", "/v1/chat/completions", b"\x00", headers={"Content-Type": "\x0b\x01"})
    resp = conn.response()
    assert resp.status == 400 and resp.json()["error"]["code"] == "invalid_json"
    assert not [e for e in events if "log_failure" in e]


@pytest.mark.parametrize("raw", [
    b'{"model":"m","messages":[]}', b' {"model":"m"}', b'{"model":"m"}\n', b'{"a":1}}',
    b'{}{}', b'{"a":"}"}', b'{"a":NaN}', b'{"a":1', b"[1]", b"{",
    b'{"a":"\xff"}', b'\xef\xbb\xbf{"model":"m"}', '{"model":"m"}'.encode("utf-16"),
    '{"model":"\u00e9"}'.encode(), b'{"a":' * 100_000 + b"}",
])
def test_a_body_is_read_as_json_loads_reads_it(raw: bytes) -> None:
    """The usual body's short way (forward._json) gives what json.loads gives, or
    the same kind of error."""
    def outcome(read: Callable[[bytes], Any]) -> Any:
        try:
            return read(raw)
        except (ValueError, RecursionError) as e:
            return type(e)

    assert outcome(forward._json) == outcome(json.loads)
