"""No input makes the proxy answer 500 or log a traceback: random methods,
paths, headers and bodies (JSON or not, sized right or wrong, in one read or
in pieces) through the real Site and HTTPChannel in memory, every upstream
call answered by a fake engine, then every timer run out. Every answer is a
success or an OpenAI-style JSON error."""

from __future__ import annotations

import json
import string
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from twisted.logger import capturedLogs

from llmproxy.testing.fakes import Connection, FakeResponse
from tests.test_proxy import CONFIG, make

API = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
PATHS = [*API, "/v1/models",
         "/v1/models/coder", "/v1/models/", "/status", "/healthz", "/readyz", "/metrics",
         "/admin/reload", "/admin/upgrade", "/", "/page/app.js", "/nowhere", "/v1/"]
MODELS = ["coder", "qwen", "mistral", "gone", "extra", "gpu1/qwen", "nope", "", "/", "a/b/c"]
TOKEN = string.ascii_letters + string.digits + "-!#$%&'*+.^_`|~"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)
chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(MODELS) | json_values},
    optional={"stream": json_values | st.booleans(), "messages": json_values,
              "stream_options": json_values})
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    chat_bodies.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 100_000).map(lambda n: b"[" * n),
    st.integers(1, 5000).map(lambda n: b'{"model": "coder", "x": ' + b"[" * n + b"]" * n + b"}"),
    st.integers(900, 1200).map(lambda n: b'{"model": "coder", "x": "' + b"a" * n + b'"}'),
)
paths = st.one_of(
    st.sampled_from(API),
    st.sampled_from(PATHS),
    st.tuples(st.sampled_from(PATHS), st.text(string.printable.strip(), max_size=12)).map(
        lambda t: t[0] + "?" + t[1]),
    st.text(string.ascii_letters + string.digits + "/%._~-:@!$&'()*+,;=", max_size=30).map(
        lambda p: "/" + p),
)
headers = st.lists(st.tuples(
    st.one_of(st.sampled_from(["Content-Type", "Connection", "Expect", "Transfer-Encoding",
                               "Content-Length", "X-Forwarded-For", "Accept-Encoding", "Host",
                               "Authorization", "Cookie", "Upgrade", "TE"]),
              st.text(TOKEN, min_size=1, max_size=12)),
    st.one_of(st.sampled_from(["close", "keep-alive", "100-continue", "chunked", "gzip", "0",
                               "-1", "99999999999", "application/json", ""]),
              st.binary(max_size=20).map(lambda b: b.decode("latin-1")))), max_size=5)


def request_bytes(method: str, path: str, head: list[tuple[str, str]], body: bytes,
                  length: str, version: str) -> bytes:
    lines = [f"{method} {path} {version}"] + [f"{k}: {v}" for k, v in head]
    if length == "right":
        lines.append(f"Content-Length: {len(body)}")
    elif length == "short" and body:
        lines.append(f"Content-Length: {len(body) // 2}")
    elif length == "chunked":
        lines.append("Transfer-Encoding: chunked")
        body = (f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n") if body else b"0\r\n\r\n"
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body


def responses(data: bytes, method: str) -> list[tuple[int, dict[str, str], bytes]]:
    """Every response in what the proxy wrote (the last one possibly cut short)."""
    out = []
    while data.startswith(b"HTTP/1."):
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        hdrs = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        if 100 <= status < 200:
            data = rest                  # an interim answer (100 Continue): no body
            continue
        if method == "HEAD" and not out and not rest.startswith(b"{"):
            # The answer to a HEAD has no body (the channel's own refusal of a
            # malformed request has one: it answers before it knows the method).
            body, data = b"", rest
        elif "content-length" in hdrs:
            n = int(hdrs["content-length"])
            body, data = rest[:n], rest[n:]
        elif hdrs.get("transfer-encoding") == "chunked":
            body, data = dechunk(rest)
        else:
            body, data = rest, b""
        out.append((status, hdrs, body))
    assert data == b"" or not out, f"stray bytes after a response: {data[:80]!r}"
    return out


def dechunk(rest: bytes) -> tuple[bytes, bytes]:
    body = b""
    while True:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            return body, b""
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return body, rest[2:]
        body, rest = body + rest[:size], rest[size + 2:]


def check(status: int, hdrs: dict[str, str], body: bytes, head: bool) -> None:
    assert status != 500 and status < 600, (status, body[:200])
    if status == 503 and body in (b'{"ready": false}\n', b""):
        return                           # /readyz before the rosters were read
    if status >= 400:
        assert hdrs.get("content-type") == "application/json", (status, hdrs)
        if head and not body:
            return                       # the answer to a HEAD: headers only
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "code"}
    elif hdrs.get("content-type") == "application/json" and body:
        json.loads(body)


@example(method="POST", limit=1000, path="/v1/chat/completions",  # found by this test
         head=[("Content-Type", "\x0b\x01")], body=b"\x00", length="right",
         version="HTTP/1.1", pieces=1, trailing=b"")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(["POST", "POST", "POST", "GET", "HEAD", "PUT", "OPTIONS"])
       | st.text(TOKEN, min_size=1, max_size=8), limit=st.sampled_from([1000, 1 << 20]),
       path=paths, head=headers, body=bodies,
       length=st.sampled_from(["right", "right", "right", "short", "none", "chunked"]),
       version=st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0"]),
       pieces=st.integers(1, 4), trailing=st.binary(max_size=20) | st.just(b""))
def test_no_input_gets_a_500_or_a_traceback(method: str, limit: int, path: str,
                                             head: list[tuple[str, str]], body: bytes,
                                             length: str, version: str, pieces: int,
                                             trailing: bytes) -> None:
    svc, http, clock = make({**CONFIG, "max_body_bytes": limit})
    conn = Connection(svc.site)
    data = request_bytes(method, path, head, body, length, version) + trailing
    step = max(1, len(data) // pieces)
    with capturedLogs() as events:
        for i in range(0, len(data), step):
            if not conn.transport.disconnecting:
                conn.channel.dataReceived(data[i:i + step])
            clock.advance(0)
        answer_upstream_calls(http.calls)
        clock.advance(0)
        for _ in range(3):
            if conn.transport.disconnecting:
                break                    # a real transport would now report the close
            clock.advance(1000)          # every timer: client and upstream timeouts, linger
        conn.disconnect()
    for status, hdrs, resp_body in responses(conn.transport.value(), method):
        check(status, hdrs, resp_body, method == "HEAD")
    failures = [e for e in events if "log_failure" in e]
    assert not failures, failures[0]["log_failure"].getTraceback()


def answer_upstream_calls(calls: list[Any]) -> None:
    for call in calls:
        if not call.deferred.called:
            upstream = FakeResponse(200, {"Content-Type": "application/json"})
            call.deferred.callback(upstream)
            upstream.send(b'{"ok": true}')
            upstream.finish()
