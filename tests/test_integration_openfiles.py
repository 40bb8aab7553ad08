"""Open files with real processes: `twistd llmproxy` started under prlimit as a
systemd service is (a soft RLIMIT_NOFILE of 1024) raises its soft limit to the
hard one and serves 600 concurrent streams (1,200 descriptors); and a proxy
that cannot raise it (soft = hard) and runs out of descriptors keeps serving
the connections it has, lets the others wait in the listen queue, and says so
in one log line per burst, not one per failed accept()."""

from __future__ import annotations

import json
import resource
import selectors
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmproxy.testing.fakes import parse_response
from tests.procs import Proxy, SimEngine

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("prlimit") is None, reason="no prlimit (util-linux)"),
]

STREAMS = 600


@pytest.fixture(scope="module", autouse=True)
def enough_open_files() -> Iterator[None]:
    """This process holds every client socket, and the engine it starts inherits
    its limit: both need more than a service's 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * STREAMS if hard == resource.RLIM_INFINITY else min(hard, 4 * STREAMS)
    if want < 3 * STREAMS:
        pytest.skip(f"hard limit of open files {hard} is too low for {STREAMS} streams")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Streams:
    """`n` streamed chat completions over `n` sockets, read in one thread."""

    def __init__(self, port: int, n: int, tokens: int, delay: float) -> None:
        body = json.dumps({"model": "m", "stream": True}).encode()
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   + f"X-Sim-Tokens: {tokens}\r\nX-Sim-Delay: {delay}\r\n".encode()
                   + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        self.selector = selectors.DefaultSelector()
        self.data: dict[int, bytes] = {}
        self.closed: set[int] = set()
        self.hold = False          # keep a connection open after its response
        for i in range(n):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(request)
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ, i)
            self.data[i] = b""

    def done(self, i: int) -> bool:
        """Its stream arrived whole."""
        return self.data[i].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")

    def refused(self, i: int) -> bool:
        """It was answered with a whole JSON error."""
        data = self.data[i]
        if not data.startswith(b"HTTP/1.1 5") or b"\r\n\r\n" not in data:
            return False
        resp = parse_response(data)
        return resp.complete and "error" in resp.json()

    def read(self, seconds: float, until_done: bool = True) -> None:
        """Read for `seconds` (or until every response is in); a client closes
        its connection once its response is in, as curl would (unless `hold`)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.selector.get_map():
            if until_done and all(i in self.closed for i in self.data):
                return
            if not self.hold:
                for key in list(self.selector.get_map().values()):
                    if self.done(key.data) or self.refused(key.data):
                        self._close(key)
            for key, _ in self.selector.select(0.1):
                sock: Any = key.fileobj
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                self.data[key.data] += chunk
                if not chunk:
                    self._close(key)

    def _close(self, key: selectors.SelectorKey) -> None:
        self.closed.add(key.data)
        self.selector.unregister(key.fileobj)
        key.fileobj.close()  # type: ignore[union-attr]

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()


def in_flight(proxy: Proxy) -> int:
    """Streams in flight (not counting the /status request asking)."""
    return sum(r["path"] == "/v1/chat/completions" for r in proxy.get_json("/status")["in_flight"])


def test_600_streams_under_a_soft_limit_of_1024(engine: SimEngine, tmp_path: Path) -> None:
    """Started as `prlimit --nofile=1024:4096 twistd ... llmproxy`, the proxy
    raises its soft limit to 4096 and logs it; 600 concurrent streams (each a
    client and an engine connection) are all in flight at once and all
    complete with [DONE]."""
    proxy = Proxy({"hosts": [{"name": "gpu1", "url": engine.url}]}, tmp_path,
                  prefix=("prlimit", "--nofile=1024:4096", "--"))
    try:
        assert "open files: soft limit raised from 1024 to 4096" in proxy.output()
        started = time.monotonic()
        streams = Streams(proxy.port, STREAMS, tokens=12, delay=0.5)
        most = 0
        while time.monotonic() - started < 20 and most < STREAMS:
            streams.read(0.3, until_done=False)
            most = max(most, in_flight(proxy))
        streams.read(20)
        streams.close()
        done = [i for i in streams.data if streams.done(i)]
        assert most == STREAMS
        assert len(done) == STREAMS, {i: streams.data[i][-200:] for i in streams.data
                                      if not streams.done(i)}
        assert "accept() failed" not in proxy.output()
    finally:
        assert proxy.stop() == 0


def test_out_of_descriptors_it_serves_on_and_logs_once(engine: SimEngine,
                                                         tmp_path: Path) -> None:
    """Under `prlimit --nofile=64:64` (nothing to raise), 10 streams run when 60
    more clients arrive at once, far more than the descriptors left: the 10
    complete; the 60 that it cannot accept at once wait in the listen queue and
    are taken as descriptors free up, each answered (a stream, or a 502 JSON
    error when its engine connection found no descriptor), none reset or left
    hanging. The answered clients hold on to their connections for 2 s, so
    accept() fails again at every retry: still one log line when accepting
    stopped and one when it resumed for good."""
    proxy = Proxy({"hosts": [{"name": "gpu1", "url": engine.url}]}, tmp_path,
                  prefix=("prlimit", "--nofile=64:64", "--"))
    try:
        assert "open files: soft limit 64 (the hard limit)" in proxy.output()
        running = Streams(proxy.port, 10, tokens=15, delay=0.2)
        running.read(1, until_done=False)
        assert all(running.data[i].startswith(b"HTTP/1.1 200 ") for i in running.data)
        # All 60 in the listen queue before the proxy looks: one burst, for sure.
        proxy.signal(signal.SIGSTOP)
        try:
            flood = Streams(proxy.port, 60, tokens=3, delay=0.1)
        finally:
            proxy.signal(signal.SIGCONT)
        flood.hold = True        # the answered ones keep their descriptors for 2 s
        for _ in range(8):
            running.read(0.25, until_done=False)
            flood.read(0.25, until_done=False)
        flood.hold = False
        for _ in range(60):
            running.read(0.25)
            flood.read(0.25)
        running.close()
        flood.close()
        assert all(running.done(i) for i in running.data)
        answered = [i for i in flood.data if flood.done(i) or flood.refused(i)]
        assert len(answered) == 60, {
            i: flood.data[i][-300:] for i in flood.data if i not in answered}
        failures = proxy.wait_for(r"open files: accepting again; (\d+) accept\(\) failure",
                                  timeout=10)
        assert int(failures.group(1)) >= 3       # one a retry while they held on
        out = proxy.output()
        assert out.count("accept() failed with EMFILE") == 1, out
        assert out.count("open files: accepting again") == 1
        assert "Traceback" not in out
    finally:
        proxy.stop()
