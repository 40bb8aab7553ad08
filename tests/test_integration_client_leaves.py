"""A client that leaves is cancelled at once, at every phase: while its request
waits in the host's queue, while the engine's head is awaited, and while the
answer streams; by a FIN or a reset, with a body. Within a second the engine
sees its connection closed, the request is out of /status, its slot is free,
and the access line says `client-gone`. A real twistd in front of a raw-socket
engine on 127.0.0.1, with raw-socket clients; run in both modes by the suite.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import sshd as sshd_harness
from tests.procs import ROOT, Proxy, RawServer, free_port, wait_until

pytestmark = pytest.mark.integration

EVENT = b'data: {"a":1}\n\n'
BODY = json.dumps({"model": "m", "stream": True,
                   "messages": [{"role": "user", "content": "x" * 2000}]}).encode()


class Engine(RawServer):
    """An engine on a raw socket: it reads a request, then answers as `mode`
    says ("silent": never; "stream": a head and one event, then nothing) and
    records when each connection was closed by the proxy."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        super().__init__()
        self.requests = 0
        self.closed = 0
        self._lock = threading.Lock()
        self.start()

    def serve(self, conn: socket.socket) -> None:
        data = b""
        with conn:
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                if data.startswith(b"GET /v1/models"):
                    body = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                    return
                with self._lock:
                    self.requests += 1
                if self.mode == "stream":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n"
                                 b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
                while conn.recv(65536):
                    pass
            except OSError:
                pass
            with self._lock:
                self.closed += 1



def _send(port: int, body: bytes = BODY) -> socket.socket:
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                   % (len(body), body))
    return client


# A body far past what one read takes and what Twisted reads ahead (16 KiB).
LARGE = json.dumps({"model": "m", "stream": True,
                    "messages": [{"role": "user", "content": "y" * 300_000}]}).encode()


def _leave(client: socket.socket, how: str) -> None:
    if how == "reset":       # RST: SO_LINGER with a zero timeout, then close
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()


def _api_requests(proxy: Proxy) -> list[dict[str, Any]]:
    return [r for r in proxy.get_json("/status")["in_flight"] if r["path"].startswith("/v1/")]


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    e = Engine(request.param)
    yield e
    e.stop()


def _proxy(engine: Engine, tmp_path: Path, **extra: Any) -> Proxy:
    return Proxy({"hosts": [{"name": "g", "url": f"http://127.0.0.1:{engine.port}", **extra}],
                  "models": {"m": {"host": "g"}}}, tmp_path)


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("how", ["fin", "reset"])
@pytest.mark.parametrize("engine", ["silent", "stream"], indirect=True)
def test_a_client_that_leaves_frees_the_engine_and_its_slot(engine: Engine, tmp_path: Path,
                                                            how: str, size: str) -> None:
    """Waiting for the engine's head (silent engine) or mid-stream (one event
    sent): a client that leaves a second or more after sending its request
    (FIN or RST; a body of 2 KB or 300 KB) has its engine connection closed and
    its request ended as client-gone within a second."""
    proxy = _proxy(engine, tmp_path)
    try:
        client = _send(proxy.port, BODY if size == "small" else LARGE)
        assert wait_until(lambda: engine.requests == 1, 5)
        if engine.mode == "stream":
            client.settimeout(5)
            assert b"data:" in client.recv(65536)
        time.sleep(1.2)        # well past the moment a leave used to be noticed
        _leave(client, how)
        left = time.monotonic()
        assert wait_until(lambda: engine.closed == 1, 1.0), "the engine connection stayed open"
        assert wait_until(lambda: _api_requests(proxy) == [], 1.0)
        assert time.monotonic() - left < 1.5
        proxy.wait_for(r"POST /v1/chat/completions model=m host=g .*outcome=client-gone", 2)
    finally:
        proxy.stop()


@pytest.mark.parametrize("how", ["fin", "reset"])
@pytest.mark.parametrize("engine", ["silent"], indirect=True)
def test_a_queued_client_that_leaves_is_out_of_the_queue_at_once(engine: Engine,
                                                                 tmp_path: Path,
                                                                 how: str) -> None:
    """With max_concurrent 1, a second request waits in the queue; its client
    leaves: the queue is empty within a second, the first request goes on, and
    the second never reaches the engine."""
    proxy = _proxy(engine, tmp_path, max_concurrent=1)
    try:
        first = _send(proxy.port)
        assert wait_until(lambda: engine.requests == 1, 5)
        second = _send(proxy.port)
        assert wait_until(lambda: len(_api_requests(proxy)) == 2, 5)
        time.sleep(1.2)
        _leave(second, how)
        assert wait_until(lambda: len(_api_requests(proxy)) == 1, 1.0)
        host = proxy.get_json("/status")["hosts"][0]
        assert host["capacity"]["queued"] == 0, host["capacity"]
        assert engine.requests == 1 and engine.closed == 0
        proxy.wait_for(r"POST /v1/chat/completions model=m host=g .*outcome=client-gone", 2)
        _leave(first, how)
        assert wait_until(lambda: engine.closed == 1, 1.0)
    finally:
        proxy.stop()


@pytest.mark.parametrize("how", ["fin", "reset"])
def test_a_client_that_leaves_during_an_engine_switch_is_out_at_once(
        tmp_path: Path, how: str, sshd: sshd_harness.SSHD) -> None:
    """A managed host whose engine takes long to start (its command never
    listens): a request that waits for the switch, whose client leaves, is out
    of /status within a second and logged client-gone; the switch itself is
    the host's business and goes on."""
    port = free_port()
    config = {
        "ssh_command": sshd.ssh_command, "runtime_dir": str(tmp_path / "locks"),
        "hosts": [{"name": "g", "url": f"http://127.0.0.1:{port}", "ssh": sshd.target,
                   "agent": ["env", f"PYTHONPATH={ROOT}", sys.executable, "-m",
                             "llmproxy.agent", "--state-dir", str(tmp_path / "agent")],
                   "engines": {"slow": {"command": ["sleep", "60"],
                                        "start_timeout_seconds": 30}}}],
        "models": {"m": {"host": "g", "engine": "slow"}},
    }
    proxy = Proxy(config, tmp_path)
    try:
        client = _send(proxy.port)
        assert wait_until(lambda: len(_api_requests(proxy)) == 1, 5)
        time.sleep(1.2)
        _leave(client, how)
        assert wait_until(lambda: _api_requests(proxy) == [], 1.0)
        proxy.wait_for(r"POST /v1/chat/completions model=m host=g .*outcome=client-gone", 2)
    finally:
        proxy.stop(timeout=1)   # its stop waits for the switch, which never ends: not this test
