"""Client input, bounded, against a real `twistd -n llmproxy` in front of a
simulated engine, over raw sockets on 127.0.0.1 (the proxy runs the mode
LLMPROXY_SPEEDUPS says: run this file with 0 and with 1): a model over 256
bytes is a 400 quoting a bounded prefix; a model holding a line break and a
megabyte-long one each leave one bounded access line and a bounded event; a
body that names its model twice (JSON or form) is a 400 that reaches no engine;
two Host headers are a 400; a chunk declared past max_body_bytes is a 413 in
well under a second."""

from __future__ import annotations

import json
import re
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from llmproxy.core.text import shown
from llmproxy.testing.fakes import ParsedResponse, parse_response
from tests.procs import Proxy, SimEngine

pytestmark = pytest.mark.integration

MiB = 1 << 20
LIMIT = 4 * MiB
BOUNDARY = "bounded-7d3a"


@pytest.fixture(scope="module")
def proxy(engine: SimEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = Proxy({"hosts": [{"name": "gpu1", "url": engine.url}], "max_body_bytes": LIMIT},
              tmp_path_factory.mktemp("proxy"))
    yield p
    p.stop()


def read_response(sock: socket.socket, timeout: float = 10) -> ParsedResponse:
    """Read until one whole response is in (or the connection ends)."""
    data = b""
    deadline = time.monotonic() + timeout
    while not (b"\r\n\r\n" in data and parse_response(data).complete):
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        chunk = sock.recv(65536) if ready else b""
        if not chunk:
            break
        data += chunk
    return parse_response(data)


def ask(port: int, data: bytes) -> ParsedResponse:
    """`data` sent on a fresh connection; the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        return read_response(sock)


def post(path: str, body: bytes, ctype: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def chat(model: str) -> bytes:
    return post("/v1/chat/completions", json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode())


def form(*parts: tuple[str, bytes]) -> bytes:
    body = b"".join(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"'
                    f'{"; filename=a.wav" if name == "file" else ""}\r\n\r\n'.encode()
                    + value + b"\r\n" for name, value in parts)
    return post("/v1/audio/transcriptions", body + f"--{BOUNDARY}--\r\n".encode(),
                f"multipart/form-data; boundary={BOUNDARY}")


def test_a_300_byte_model_is_400_quoting_a_bounded_prefix(proxy: Proxy) -> None:
    """400 string_above_max_length (invalid_request_error), its message quoting
    at most a short prefix of the name."""
    resp = ask(proxy.port, chat("q" * 300))
    error = resp.json()["error"]
    assert (resp.status, error["type"], error["code"]) == (
        400, "invalid_request_error", "string_above_max_length")
    assert "q" * 65 not in error["message"] and len(resp.body) < 400


class EventReader:
    """A raw /api/events client; `wait_end(id)` is the request.end event of a request."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        self.data = b""
        self._read_until(b"retry: ")

    def _read_until(self, wanted: bytes, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while wanted not in self.data:
            assert time.monotonic() < deadline, self.data[-2000:]
            ready, _, _ = select.select([self.sock], [], [], 0.5)
            if ready:
                chunk = self.sock.recv(65536)
                assert chunk, "the event stream ended"
                self.data += chunk

    def wait_end(self, request_id: str) -> tuple[bytes, dict[str, Any]]:
        """The raw SSE message of the request's end, and its data."""
        self._read_until(f'"request_id":"{request_id}"'.encode())
        for message in re.findall(rb"event: request\.end\ndata: [^\n]*\n\n", self.data):
            doc = json.loads(message.split(b"data: ", 1)[1])
            if doc["request_id"] == request_id:
                return message, doc
        raise AssertionError(f"no request.end for {request_id}")

    def close(self) -> None:
        self.sock.close()


def test_a_line_break_or_a_megabyte_in_a_model_leaves_one_bounded_line_and_event(
        proxy: Proxy) -> None:
    """A model forging an access line after a newline (a 404) and a 1 MB model
    (a 400): each request leaves exactly one access line in the process output,
    short, its model escaped or absent, no forged line; and its request.end
    event on /api/events is small, the model as `shown` makes it."""
    events = EventReader(proxy.port)
    try:
        forged = "x\nFORGED-LINE 1-1 POST /v1/chat/completions model=m status=200"
        resp = ask(proxy.port, chat(forged))
        assert resp.status == 404 and "\n" not in resp.json()["error"]["message"]
        forged_id = resp.headers["x-request-id"]
        resp = ask(proxy.port, chat("y" * MiB))
        assert resp.status == 400 and len(resp.body) < 400
        big_id = resp.headers["x-request-id"]
        for request_id, model in ((forged_id, shown(forged)), (big_id, None)):
            message, doc = events.wait_end(request_id)
            assert doc["model"] == model and len(message) < 1500
            proxy.wait_for(rf"{request_id} POST /v1/chat/completions model=")
            [line] = [ln for ln in proxy.output().splitlines() if request_id + " " in ln]
            assert len(line) < 800, line[:200]
        assert "model=x\\x0aFORGED-LINE" in proxy.output()
        assert not [ln for ln in proxy.output().splitlines() if ln.startswith("FORGED")]
    finally:
        events.close()


def test_a_model_named_twice_reaches_no_engine(proxy: Proxy, engine: SimEngine) -> None:
    """A JSON body repeating `model` (spelled plainly or escaped) and a form
    with two `model` fields are 400s naming the repetition; the engine sees
    neither, and sees the same form with one model field."""
    before = len(engine.requests())
    for body, code in (
            (post("/v1/chat/completions", b'{"model": "m", "model": "other"}'), "duplicate_key"),
            (post("/v1/chat/completions", b'{"model": "m", "mode\\u006c": "x"}'),
             "duplicate_key"),
            (form(("model", b"m"), ("file", b"RIFF"), ("model", b"other")), "duplicate_field")):
        resp = ask(proxy.port, body)
        assert (resp.status, resp.json()["error"]["code"]) == (400, code), resp.body
    assert len(engine.requests()) == before
    resp = ask(proxy.port, form(("model", b"m"), ("file", b"RIFF")))
    assert resp.status == 200 and len(engine.requests()) == before + 1


@pytest.mark.parametrize("hosts", [b"Host: a\r\nHost: b\r\n", b"host: a\r\nX-A: 1\r\nHOST: a\r\n"])
def test_two_host_headers_are_400(proxy: Proxy, hosts: bytes) -> None:
    """Two Host headers: 400 bad_request, and the connection closes."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n" + hosts + b"\r\n")
        resp = read_response(sock)
        assert resp.status == 400 and resp.json()["error"]["code"] == "bad_request"
        sock.settimeout(5)
        assert sock.recv(65536) == b""


def test_a_chunk_declared_past_the_limit_is_413_within_a_second(proxy: Proxy) -> None:
    """A chunked body whose first size line declares 64 GiB, then nothing: a
    413 comes in well under a second (not at the 30 s body timeout), and the
    proxy ends the connection."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        time.sleep(0.1)
        started = time.monotonic()
        sock.sendall(b"1000000000\r\n")
        resp = read_response(sock, timeout=5)
        elapsed = time.monotonic() - started
        assert resp.status == 413 and resp.json()["error"]["code"] == "request_too_large"
        assert elapsed < 1.0, elapsed
        sock.settimeout(5)
        try:
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
