"""Hostile and heavy clients against a real `twistd -n llmproxy` in front of a
simulated engine, over real sockets on 127.0.0.1: oversized bodies refused
before they are read, slowloris connections closed at the header timeout
while others are served, a client that never reads aborted at the write-stall
bound."""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import threading
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
def proxy(engine: SimEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = Proxy(config(engine), tmp_path_factory.mktemp("proxy"))
    yield p
    p.stop()


HEADER_TIMEOUT = 2.0
WRITE_STALL = 1.0


def config(engine: SimEngine, **extra: Any) -> dict[str, Any]:
    return {"hosts": [{"name": "gpu1", "url": engine.url}], "max_body_bytes": LIMIT,
            "client_header_timeout_seconds": HEADER_TIMEOUT,
            "client_write_stall_seconds": WRITE_STALL, **extra}


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
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
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
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
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
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        resp, _ = read_response(sock)
    assert resp.status == 400 and resp.json()["error"]["code"] == "invalid_json"
    assert "Traceback" not in proxy.output()


def test_a_body_within_the_limit_is_served(proxy: Proxy) -> None:
    """The limit refuses nothing below it: a body near the limit is forwarded."""
    body = json.dumps({"model": "m", "pad": "z" * (LIMIT - 100)}).encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        resp, _ = read_response(sock)
    assert resp.status == 200, resp


class Slowloris(threading.Thread):
    """`n` connections that each send one more header byte every `every`
    seconds, never ending their headers; notes when the proxy ends each one,
    and what it said."""

    def __init__(self, port: int, n: int, every: float) -> None:
        super().__init__(daemon=True)
        self.socks: list[socket.socket] = []
        self.opened: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.answers: dict[int, bytes] = {}
        for _ in range(n):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            self.opened[sock.fileno()] = time.monotonic()
            self.answers[sock.fileno()] = b""
            sock.setblocking(False)
            self.socks.append(sock)
        self.every = every
        self.start()

    def run(self) -> None:
        live = {s.fileno(): s for s in self.socks}
        next_byte = time.monotonic() + self.every
        deadline = time.monotonic() + 20
        while live and time.monotonic() < deadline:
            readable, _, _ = select.select(list(live.values()), [], [], 0.05)
            for sock in readable:
                fd = sock.fileno()
                try:
                    data = sock.recv(4096)
                except ConnectionResetError:
                    data = b""
                self.answers[fd] += data
                if not data:
                    self.ended[fd] = time.monotonic()
                    del live[fd]
            if time.monotonic() >= next_byte:
                next_byte += self.every
                for sock in live.values():
                    with contextlib.suppress(OSError):
                        sock.send(b"a")
        for sock in self.socks:
            sock.close()


def test_slowloris_connections_are_closed_at_the_header_timeout(proxy: Proxy) -> None:
    """200 connections sending a header byte every second are each answered 408
    and closed at the header timeout (2 s here) after they connected, although
    they never stop sending; meanwhile a normal client is served at once."""
    loris = Slowloris(proxy.port, 200, every=1.0)
    served = []
    for _ in range(3):
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": "m"}))
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["model"] == "m"
        served.append(time.monotonic() - started)
        conn.close()
        time.sleep(0.3)
    loris.join(25)
    assert max(served) < 1.0, served
    assert len(loris.ended) == 200
    lived = [loris.ended[fd] - loris.opened[fd] for fd in loris.ended]
    assert min(lived) > HEADER_TIMEOUT - 0.1 and max(lived) < HEADER_TIMEOUT + 3.0, lived
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in loris.answers.values())


def test_a_client_that_never_reads_is_aborted_and_the_engine_serves_on(
        proxy: Proxy, engine: SimEngine) -> None:
    """A real socket with a small receive buffer asks for a long, fast stream and
    never reads: once the proxy's buffers are full and nothing drains for the
    write-stall bound (1 s here), it is aborted, its access line says
    client-stalled, the engine sees its request cancelled, and the next request
    is served."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", proxy.port))
    body = json.dumps({"model": "m", "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"X-Sim-Delay: 0\r\nX-Sim-Tokens: 1000000\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    started = time.monotonic()
    try:
        line = proxy.wait_for(r"model=m host=gpu1 status=200 .*outcome=client-stalled",
                              timeout=20)
        took = time.monotonic() - started
        assert "client_write_stall_seconds" in line.string
        record = wait_for_record(engine, lambda r: r["outcome"] == "client-gone")
        assert record["chunks_sent"] < 1_000_000
    finally:
        sock.close()
    assert took < 10, took
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "m", "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read().rstrip().endswith(b"data: [DONE]")


def wait_for_record(engine: SimEngine, match: Any, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in engine.requests() if match(r)]
        if found or time.monotonic() > deadline:
            assert found, engine.requests()[-3:]
            return found[-1]
        time.sleep(0.1)
