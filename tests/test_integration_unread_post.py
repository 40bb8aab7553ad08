"""A POST on a reused engine connection that the engine closed, then reset
unread (its idle close and the request crossed; web.enginewatch.
refused_after_close), goes once more on a fresh connection, on both engine
clients, over real TCP on 127.0.0.1. A POST the engine read whole and closed
on unanswered is never sent again (tests/test_engineclient.py and
tests/test_upstream_crossed.py)."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from typing import Any

import pytest
import pytest_twisted

from llmproxy.speedups.engineclient import UpstreamClient, UpstreamPool
from llmproxy.testing.fakes import read_body
from llmproxy.web.engineclient import EngineClient, EnginePool

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class UnreadingEngine:
    """An engine in a thread, on blocking sockets: on its first connection it
    answers one request, then, when the next one arrives, looks at it without
    reading it (MSG_PEEK), shuts the connection and closes it: a FIN, then a
    reset for the bytes it never read (as Twisted and cpp-httplib close an
    idle connection whose next request has just come). Every later connection
    is answered, one request each, and kept open. `read`: the request lines it read; `unread`:
    those it only looked at."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.stopping = False
        self.kept: list[socket.socket] = []
        self.port = self.listener.getsockname()[1]
        self.read: list[bytes] = []
        self.unread: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _request(self, conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            body += conn.recv(65536)
        return head.split(b"\r\n", 1)[0]

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
            conn.settimeout(10)
            self.read.append(self._request(conn))
            conn.sendall(OK)
            readable, _, _ = select.select([conn], [], [], 10)
            assert readable
            self.unread.append(conn.recv(65536, socket.MSG_PEEK).split(b"\r\n", 1)[0])
            conn.shutdown(socket.SHUT_RDWR)
            conn.close()
            while True:
                fresh, _ = self.listener.accept()
                self.kept.append(fresh)       # kept open, as an engine would
                if self.stopping:
                    return
                fresh.settimeout(10)
                self.read.append(self._request(fresh))
                fresh.sendall(OK)
        except OSError:
            return        # the listener closed: the test is over

    def close(self) -> None:
        self.stopping = True
        with contextlib.suppress(OSError):        # wakes the accept
            socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
        self.thread.join(10)
        self.listener.close()
        for conn in self.kept:
            conn.close()


def _clients(reactor: Any) -> dict[str, tuple[Any, Any]]:
    reference = EnginePool(reactor)
    fast = UpstreamPool(reactor)
    return {"reference": (EngineClient(reactor, reference, 5.0), reference),
            "speedups": (UpstreamClient(reactor, fast, 5.0), fast)}


@pytest.mark.integration
@pytest.mark.parametrize("path", ["reference", "speedups"])
@pytest_twisted.ensureDeferred
async def test_a_post_the_engine_refused_unread_goes_once_more(path: str) -> None:
    """Two POSTs: the second goes out on the reused connection, which the
    engine shuts with it unread; it is answered on a fresh connection, and
    the engine read each POST exactly once."""
    from twisted.internet import reactor

    engine = UnreadingEngine()
    http, pool = _clients(reactor)[path]
    url = f"http://127.0.0.1:{engine.port}/v1/chat/completions"
    try:
        answers = []
        for n in (1, 2):
            response = await http.request("POST", url, data=b'{"n": %d}' % n)
            answers.append((response.code, await read_body(response)))
        assert answers == [(200, b"ok"), (200, b"ok")]
        line = b"POST /v1/chat/completions HTTP/1.1"
        assert engine.unread == [line]
        assert engine.read == [line, line]
    finally:
        await pool.closeCachedConnections()
        engine.close()
