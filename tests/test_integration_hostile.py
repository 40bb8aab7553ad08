"""Hostile and heavy clients against a real `twistd -n llmproxy` in front of a
simulated engine, over real sockets on 127.0.0.1: oversized bodies refused
before they are read."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from llmproxy.testing.fakes import ParsedResponse, parse_response
from tests.procs import Proxy, SimEngine

pytestmark = pytest.mark.integration

LIMIT = 64 * 1024
MiB = 1 << 20


@pytest.fixture(scope="module")
def engine() -> Iterator[SimEngine]:
    e = SimEngine(["m"])
    yield e
    e.stop()


@pytest.fixture(scope="module")
def proxy(engine: SimEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = Proxy(config(engine), tmp_path_factory.mktemp("proxy"))
    yield p
    p.stop()


def config(engine: SimEngine, **extra: Any) -> dict[str, Any]:
    return {"hosts": [{"name": "gpu1", "url": engine.url}], "max_body_bytes": LIMIT, **extra}


def read_response(sock: socket.socket, timeout: float = 10) -> tuple[ParsedResponse, bytes]:
    """Read until one whole response is in (or the connection ends)."""
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if data.startswith(b"HTTP/") and b"\r\n\r\n" in data and parse_response(data).complete:
            break
        ready, _, _ = select.select([sock], [], [], deadline - time.monotonic())
        if not ready:
            break
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return parse_response(data), data


def push_until_answered(sock: socket.socket, first: bytes, piece: bytes,
                        most: int) -> tuple[int, bytes]:
    """Send `first`, then `piece` after `piece` while no answer is readable and
    fewer than `most` bytes of body went out; (body bytes sent, what came back)."""
    sock.sendall(first)
    sent = 0
    sock.setblocking(False)
    while sent < most:
        readable, writable, _ = select.select([sock], [sock], [], 5)
        if readable:
            break
        if writable:
            try:
                sent += sock.send(piece)
            except BlockingIOError:
                continue
        time.sleep(0.01)
    sock.setblocking(True)
    readable, _, _ = select.select([sock], [], [], 5)
    return sent, sock.recv(65536) if readable else b""


def ends(sock: socket.socket, timeout: float) -> bool:
    """Whether the proxy ends the connection (FIN or reset) within `timeout`."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_a_1_gib_body_is_refused_before_1_mib_is_sent(proxy: Proxy) -> None:
    """A client announcing a 1 GiB body gets 413 while it is still sending, long
    before it has sent 1 MiB, and the proxy then ends the connection."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n")
        sent, answer = push_until_answered(sock, head, b"x" * 16384, MiB)
        assert sent < MiB and answer.startswith(b"HTTP/1.1 413 "), (sent, answer[:200])
        resp = parse_response(answer)
        assert resp.json()["error"]["code"] == "request_too_large"
        assert resp.headers["connection"] == "close"
        assert ends(sock, 5)
    assert proxy.wait_for(r"POST /v1/chat/completions model=- host=- status=413 .*"
                          r"outcome=completed")


def test_a_chunked_body_is_refused_where_it_crosses_the_limit(proxy: Proxy) -> None:
    """A chunked body gets 413 once it has passed max_body_bytes, while the
    client is still sending it; the rest is never read."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"2000\r\n" + b"y" * 0x2000 + b"\r\n"
        sent, answer = push_until_answered(sock, head, piece, 64 * MiB)
        assert LIMIT < sent < 16 * MiB, sent
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert ends(sock, 5)


def test_deeply_nested_json_is_400(proxy: Proxy) -> None:
    """100,000 nested arrays: 400 invalid_json, no traceback in the log."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        body = b"[" * 60_000
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        resp, _ = read_response(sock)
    assert resp.status == 400 and resp.json()["error"]["code"] == "invalid_json"
    assert "Traceback" not in proxy.output()


def test_a_body_within_the_limit_is_served(proxy: Proxy) -> None:
    """The limit refuses nothing below it: a body near the limit is forwarded."""
    body = json.dumps({"model": "m", "pad": "z" * (LIMIT - 100)}).encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        resp, _ = read_response(sock)
    assert resp.status == 200, resp
