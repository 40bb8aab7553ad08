"""A real twistd answers with standard reason phrases and a 405 names what it
allows (issue 45, item 9), in whichever mode the suite runs (LLMPROXY_SPEEDUPS)."""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Proxy, SimEngine

pytestmark = pytest.mark.integration

SECRET = "sk-limited-1a2b3c"


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Proxy]:
    engine = SimEngine(["sim"])
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    (tmp_path / "keys.json").write_text(json.dumps(
        {"keys": [{"name": "limited", "sha256": digest, "rpm": 1}]}))
    config = {"keys_file": "keys.json", "public_status": True,
              "runtime_dir": str(tmp_path / "run"),
              "hosts": [{"name": "gpu1", "url": engine.url}]}
    try:
        p = Proxy(config, tmp_path)
    except BaseException:
        engine.stop()
        raise
    yield p
    p.stop()
    engine.stop()


def exchange(proxy: Proxy, head: bytes, body: bytes = b"") -> tuple[bytes, dict[str, str]]:
    """The status line and headers the proxy answers a raw request with."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(head + body)
        got = b""
        while b"\r\n\r\n" not in got:
            more = s.recv(65536)
            if not more:
                break
            got += more
    lines = got.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return lines[0].encode(), {k.lower(): v for k, v in headers.items()}


def chat(secret: str) -> tuple[bytes, bytes]:
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}]})
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n"
            % (secret.encode(), len(body)), body.encode())


def test_429_431_and_405_have_their_phrases_and_405_its_allow(proxy: Proxy) -> None:
    """Over rpm: `429 Too Many Requests`; headers over the limit: `431 Request
    Header Fields Too Large`; a GET on a POST path and a POST on a GET path:
    `405 Method Not Allowed` with `Allow: POST`, `Allow: GET, HEAD`, and `Allow: GET` on the
    endless event stream, which takes no HEAD."""
    assert exchange(proxy, *chat(SECRET))[0] == b"HTTP/1.1 200 OK"
    status, headers = exchange(proxy, *chat(SECRET))
    assert status == b"HTTP/1.1 429 Too Many Requests" and "retry-after" in headers
    big = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n"
    assert exchange(proxy, big)[0] == b"HTTP/1.1 431 Request Header Fields Too Large"
    auth = b"Authorization: Bearer " + SECRET.encode() + b"\r\n"
    status, headers = exchange(proxy, b"GET /v1/chat/completions HTTP/1.1\r\n"
                               b"Host: 127.0.0.1\r\n" + auth + b"Connection: close\r\n\r\n")
    assert (status, headers.get("allow")) == (b"HTTP/1.1 405 Method Not Allowed", "POST")
    status, headers = exchange(proxy, b"POST /status HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth
                               + b"Content-Length: 0\r\nConnection: close\r\n\r\n")
    assert (status, headers.get("allow")) == (b"HTTP/1.1 405 Method Not Allowed", "GET, HEAD")
    status, headers = exchange(proxy, b"POST /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               + auth + b"Content-Length: 0\r\nConnection: close\r\n\r\n")
    assert (status, headers.get("allow")) == (b"HTTP/1.1 405 Method Not Allowed", "GET")
