"""A hostile engine behind a real `twistd -n llmproxy`, in both modes
(LLMPROXY_SPEEDUPS=0: Twisted's client behind web.enginehead's watch; =1: the
fast engine client), over raw sockets on 127.0.0.1: the engine's output is
re-framed, never copied. The client's status line is the proxy's own; a head
with a bare LF, a CR or NUL where it does not belong, a 101, 5,000 interim
responses or an ambiguous framing is the proxy's 502 `upstream_failed` (no
traceback, nothing of the engine's head in it); a header the engine's
Connection header names never reaches the client, nor the engine's chunk
framing (extensions, trailers)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.differential_views import dechunk
from tests.procs import Proxy, RawServer
from tests.test_integration_hostile import read_response

pytestmark = pytest.mark.integration

OK = b"Content-Length: 2\r\n\r\nok"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
ANSWERS = {
    "lf-status": b"HTTP/1.1 200 OK\nSet-Cookie: pwned=1\r\n" + OK,
    "cr-value": b"HTTP/1.1 200 OK\r\nX-A: a\rSet-Cookie: pwned=1\r\n" + OK,
    "nul-value": b"HTTP/1.1 200 OK\r\nX-A: pwned\x00=1\r\n" + OK,
    "101": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: pwned\r\nConnection: upgrade\r\n\r\n",
    "interim-5000": CONTINUE * 5000 + b"HTTP/1.1 200 OK\r\n" + OK,
    "interim-32": CONTINUE * 32 + b"HTTP/1.1 200 OK\r\n" + OK,
    "connection-named": b"HTTP/1.1 200 OK\r\nConnection: x-secret, X-Other\r\n"
                        b"X-Secret: pwned\r\nX-Other: pwned\r\nX-Kept: 1\r\n" + OK,
    "chunk-framing": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"0002;pwned=1\r\nok\r\n00003;x\r\n!!!\r\n0;pwned\r\nX-Pwned: 1\r\n\r\n",
    "length-and-chunked": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "phrase": b"HTTP/1.1 200 Totally Fine <script>\r\n" + OK,
    "unknown-code": b"HTTP/1.1 299 Whatever\r\n" + OK,
}
MODELS = b'{"object":"list","data":[{"id":"m","object":"model"}]}'


class HostileEngine(RawServer):
    """An engine on a raw socket: each request on a connection (keep-alive) is
    answered with ANSWERS[its X-Hostile header]; GET /v1/models with a roster."""

    def __init__(self) -> None:
        super().__init__()
        self.start()

    def serve(self, conn: socket.socket) -> None:
        data = b""
        with conn:
            try:
                while True:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                    head, _, data = data.partition(b"\r\n\r\n")
                    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
                    fields = {k.lower(): v for k, v in fields.items()}
                    length = int(fields.get(b"content-length", b"0"))
                    while len(data) < length:
                        data += conn.recv(65536)
                    data = data[length:]
                    if head.startswith(b"GET /v1/models"):
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(MODELS), MODELS))
                        continue
                    conn.sendall(ANSWERS[fields[b"x-hostile"].decode()])
            except OSError:
                pass



@pytest.fixture(scope="module")
def engine() -> Iterator[HostileEngine]:
    e = HostileEngine()
    yield e
    e.stop()


@pytest.fixture(scope="module", params=["0", "1"], ids=["reference", "speedups"])
def proxy(request: pytest.FixtureRequest, engine: HostileEngine,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = Proxy({"hosts": [{"name": "g", "url": f"http://127.0.0.1:{engine.port}"}],
               "models": {"m": {"host": "g"}}}, tmp_path_factory.mktemp("proxy"),
              extra_env={"LLMPROXY_SPEEDUPS": request.param})
    yield p
    p.stop()


def ask(proxy: Proxy, case: str) -> tuple[bytes, bytes]:
    """A chat completion whose engine answers ANSWERS[case]: the client's
    status line and its whole answer."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"X-Hostile: %s\r\nContent-Length: %d\r\n\r\n%s"
                     % (case.encode(), len(body), body))
        _, raw = read_response(sock)
    return raw.split(b"\r\n", 1)[0], raw


@pytest.mark.parametrize(("case", "why"), [
    ("lf-status", "a bare LF"), ("cr-value", "a CR (without its LF)"),
    ("nul-value", "a NUL"), ("101", "101 Switching Protocols"),
    ("interim-5000", "more than 32 interim (1xx) responses"),
    ("length-and-chunked", "a Content-Length beside Transfer-Encoding: chunked"),
])
def test_a_hostile_head_is_the_proxys_502(proxy: Proxy, case: str, why: str) -> None:
    """The client gets `502 Bad Gateway` with the upstream_failed error saying
    what was wrong, nothing of the engine's head; no traceback (5,000 interim
    responses no RecursionError) in the log."""
    status, raw = ask(proxy, case)
    assert status == b"HTTP/1.1 502 Bad Gateway", raw[:300]
    head, _, body = raw.partition(b"\r\n\r\n")
    error = json.loads(body)["error"]
    assert error["code"] == "upstream_failed" and why in error["message"], error
    assert b"pwned" not in head.lower() and b"upgrade" not in head.lower()
    out = proxy.output()
    assert "Traceback" not in out and "RecursionError" not in out


def test_32_interim_responses_are_passed_over(proxy: Proxy) -> None:
    """Up to 32 interim 100 Continue responses are skipped: the client gets the
    final answer."""
    status, raw = ask(proxy, "interim-32")
    assert status == b"HTTP/1.1 200 OK" and raw.endswith(b"\r\n\r\nok"), raw[:300]
    assert b"100 Continue" not in raw


def test_headers_the_engines_connection_header_names_are_dropped(proxy: Proxy) -> None:
    """The engine's Connection header and the headers it names stay with the
    engine's hop; its other headers reach the client."""
    status, raw = ask(proxy, "connection-named")
    head = raw.partition(b"\r\n\r\n")[0].lower()
    assert status == b"HTTP/1.1 200 OK" and b"\r\nx-kept: 1" in head, raw[:300]
    assert b"x-secret" not in head and b"x-other" not in head and b"pwned" not in head


@pytest.mark.parametrize(("case", "line"), [
    ("phrase", b"HTTP/1.1 200 OK"), ("unknown-code", b"HTTP/1.1 299 Unknown Status")])
def test_the_status_line_is_the_proxys_own(proxy: Proxy, case: str, line: bytes) -> None:
    """The engine's reason phrase never reaches the client: the code's standard
    one does (Twisted's `Unknown Status` for a code it has no phrase for)."""
    status, raw = ask(proxy, case)
    assert status == line and raw.endswith(b"\r\n\r\nok"), raw[:300]


def test_the_engines_chunk_framing_is_never_copied(proxy: Proxy) -> None:
    """A chunked answer with leading zeros, extensions and a trailer: the
    client gets the body's data framed by the proxy (no extension, no
    trailer, no size line of the engine's), whole."""
    status, raw = ask(proxy, "chunk-framing")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert status == b"HTTP/1.1 200 OK" and b"transfer-encoding: chunked" in head.lower()
    assert b"pwned" not in raw.lower() and b"0002" not in body and b";" not in body
    assert dechunk(body)[:2] == (b"ok!!!", True), body
