"""The cap on `/api/events` subscribers against a real `twistd -n llmproxy`,
with raw sockets on 127.0.0.1: past `max_event_subscribers` a subscriber gets
a 503 with Retry-After, and a slot freed by a client that leaves is taken again."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Iterator

import pytest

from llmproxy.testing.fakes import parse_response
from tests.procs import Proxy, SimEngine, wait_until

pytestmark = pytest.mark.integration

CAP = 2
REQUEST = b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    engine = SimEngine(["m"])
    try:
        p = Proxy({"hosts": [{"name": "gpu1", "url": engine.url}],
                   "max_event_subscribers": CAP}, tmp_path_factory.mktemp("proxy"))
        yield p
        p.stop()
    finally:
        engine.stop()


def enough(data: bytes) -> bool:
    """A stream's first line came, or a whole (error) response."""
    if b"retry: 1000\n\n" in data:
        return True
    return b"\r\n\r\n" in data and parse_response(data).complete


def read_head(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """What the socket gives until `enough` (or it closes, or time is up)."""
    data = b""
    deadline = time.monotonic() + timeout
    while not enough(data) and time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], deadline - time.monotonic())
        if not ready:
            break
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def subscribe(proxy: Proxy, stack: contextlib.ExitStack) -> tuple[socket.socket, bytes]:
    """A subscriber on a new connection: its socket and what came until the first
    event-stream line (a stream) or the end of a JSON error."""
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", proxy.port), timeout=5))
    sock.sendall(REQUEST)
    return sock, read_head(sock)


def streams(proxy: Proxy) -> int:
    return int(proxy.get_json("/status")["event_streams"])


def test_the_subscriber_past_the_cap_gets_503_and_a_freed_slot_is_reused(
        proxy: Proxy) -> None:
    """With max_event_subscribers 2: two subscribers get their streams (200,
    text/event-stream, `retry:`); the third gets 503 too_many_subscribers with
    Retry-After while the API still answers; once one of the two closes its
    connection, a new subscriber gets a stream again (and the next is refused)."""
    with contextlib.ExitStack() as stack:
        held = [subscribe(proxy, stack) for _ in range(CAP)]
        for _, head in held:
            assert head.startswith(b"HTTP/1.1 200 "), head
            assert b"content-type: text/event-stream" in head.lower()
            assert b"retry: 1000" in head
        assert streams(proxy) == CAP
        _, head = subscribe(proxy, stack)
        refused = parse_response(head)
        assert refused.status == 503 and refused.complete, head
        assert refused.headers["retry-after"] == "5"
        error = json.loads(refused.body)["error"]
        assert error["code"] == "too_many_subscribers"
        assert f"at most {CAP} at once" in error["message"]
        assert proxy.get_json("/v1/models")["data"][0]["id"] == "m"
        assert streams(proxy) == CAP
        held[0][0].close()
        assert wait_until(lambda: streams(proxy) == CAP - 1, timeout=5)
        _, head = subscribe(proxy, stack)
        assert head.startswith(b"HTTP/1.1 200 "), head
        _, head = subscribe(proxy, stack)
        assert head.startswith(b"HTTP/1.1 503 "), head
