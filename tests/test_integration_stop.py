"""Graceful stop of a real `twistd -n llmproxy` process: SIGTERM drains
running streams, refuses new connections, cuts only at the deadline, and the
exit status and log say what happened."""

from __future__ import annotations

import errno
import http.client
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.notifysock import NotifyReceiver
from tests.procs import Proxy, SimEngine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine() -> Iterator[SimEngine]:
    e = SimEngine(["m"])
    yield e
    e.stop()


def config(engine: SimEngine, **extra: Any) -> dict[str, Any]:
    return {"hosts": [{"name": "gpu1", "url": engine.url}], **extra}


class Stream(threading.Thread):
    """A client reading one streamed answer in the background."""

    def __init__(self, port: int, tokens: int = 20, delay: float = 0.25,
                 stream: bool = True) -> None:
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.conn.request("POST", "/v1/chat/completions",
                          json.dumps({"model": "m", "stream": stream}),
                          {"X-Sim-Delay": str(delay), "X-Sim-Tokens": str(tokens)})
        self.resp: http.client.HTTPResponse
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        try:
            # Read in the background: a non-streamed answer's headers come last.
            self.resp = self.conn.getresponse()
            if self.resp.getheader("Content-Type", "").startswith("text/event-stream"):
                for line in self.resp.read().split(b"\n"):
                    if line.startswith(b"data: "):
                        self.events.append(line[6:].decode())
            else:
                self.events.append(self.resp.read().decode())
        except BaseException as e:  # the test inspects it
            self.error = e
        self.ended_at = time.monotonic()

    def contents(self) -> list[str]:
        return [json.loads(e)["choices"][0]["delta"].get("content", "")
                for e in self.events if e.startswith("{")]


def wait_until(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED


def wait_exit(proxy: Proxy, timeout: float) -> tuple[int, float]:
    code = proxy.popen.wait(timeout)
    return code, time.monotonic()


def test_sigterm_drains_a_running_stream_then_exits_0(engine: SimEngine,
                                                      tmp_path: Path) -> None:
    """A 20-event stream (0.25 s apart) with SIGTERM 1.5 s in: every event and
    [DONE] arrive, the process exits soon after the stream's end (within 5 s,
    far from the 120 s drain budget) with status 0, and the log tells the
    drain's story."""
    with NotifyReceiver(tmp_path) as notify:
        proxy = Proxy(config(engine), tmp_path, extra_env={"NOTIFY_SOCKET": notify.address})
        notify.wait_for(lambda m: m.get("READY") == "1")
        stream = Stream(proxy.port)
        time.sleep(1.5)
        proxy.signal(signal.SIGTERM)
        notify.wait_for(lambda m: m.get("STOPPING") == "1")
        code, exited = wait_exit(proxy, 30)
        stream.join(5)
        assert stream.error is None
        assert stream.contents()[1:21] == [f"tok{i} " for i in range(20)]
        assert stream.events[-1] == "[DONE]"
        assert stream.ended_at is not None and exited - stream.ended_at < 5.0
        assert code == 0
        out = proxy.output()
        assert "received SIGTERM: stopping gracefully" in out
        assert "stopping: 1 request(s) in flight, budget" in out
        assert "outcome=completed" in out and "drained, exiting" in out
        assert any(m.get("STATUS", "").startswith("draining: 1 request(s)")
                   for m in notify.messages)


def test_drain_deadline_cuts_the_stream_and_names_it(engine: SimEngine, tmp_path: Path) -> None:
    """With drain_seconds shorter than the rest of the stream, the stream is cut
    at the deadline (a truncated body, no [DONE]), the log names the cut request,
    the process is gone within drain + 2 s + a margin (far from the budget's
    60 s engine wait), exit status 3."""
    proxy = Proxy(config(engine, drain_seconds=1), tmp_path)
    stream = Stream(proxy.port, tokens=80)       # 20 s: the deadline cuts it, always
    time.sleep(1.0)
    signalled = time.monotonic()
    proxy.signal(signal.SIGTERM)
    code, exited = wait_exit(proxy, 30)
    stream.join(5)
    assert code == 3
    assert exited - signalled < 1 + 2 + 6
    # Aborted (RST), never finished: the client sees an error, not a clean end.
    assert isinstance(stream.error, (http.client.IncompleteRead, ConnectionResetError))
    assert "[DONE]" not in stream.events
    out = proxy.output()
    assert "drain time over: cut 1 request(s)" in out
    cut_lines = [line for line in out.splitlines() if "outcome=cut" in line]
    assert len(cut_lines) == 1 and "model=m host=gpu1" in cut_lines[0]


def test_during_the_drain_new_connections_are_refused_and_keepalive_closes(
        engine: SimEngine, tmp_path: Path) -> None:
    """During the drain this process takes no new connection (refused: it bound
    the port itself), an idle keep-alive connection is closed, and a keep-alive
    client's response that starts during the drain carries `Connection: close`."""
    proxy = Proxy(config(engine), tmp_path)
    stream = Stream(proxy.port, tokens=16, delay=0.25)
    idle = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    idle.request("GET", "/healthz")
    assert idle.getresponse().read()
    slow = Stream(proxy.port, tokens=10, delay=0.25, stream=False)  # headers come at the end
    wait_until(lambda: len(proxy.get_json("/status")["in_flight"]) == 3)  # both, and /status
    proxy.signal(signal.SIGTERM)
    proxy.wait_for("stopping: ")
    assert wait_until(lambda: refused(proxy.port)), "still accepting during the drain"
    assert idle.sock is not None
    idle.sock.settimeout(5)
    assert idle.sock.recv(1) == b""                       # closed by the proxy
    slow.join(10)
    assert slow.error is None and slow.resp.getheader("Connection") == "close"
    stream.join(10)
    assert stream.events[-1] == "[DONE]"
    assert proxy.popen.wait(10) == 0


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_second_signal_exits_at_once(engine: SimEngine, tmp_path: Path, sig: int,
                                     status: int) -> None:
    """A second SIGTERM (SIGINT) during the drain exits at once, long before the
    stream would end, with status 143 (130) after one line."""
    proxy = Proxy(config(engine), tmp_path)
    Stream(proxy.port, tokens=120, delay=0.25)   # 30 s
    wait_until(lambda: len(proxy.get_json("/status")["in_flight"]) == 2)
    proxy.signal(sig)
    proxy.wait_for("stopping: 1 request")
    second = time.monotonic()
    proxy.signal(sig)
    code, exited = wait_exit(proxy, 20)
    assert code == status and exited - second < 10
    name = signal.Signals(sig).name
    assert (f"received {name} again during the stop: exiting now with status {status}"
            in proxy.output())


def test_refused_connect_errno_is_econnrefused() -> None:
    """Guard for the refusal test above: connecting to a closed port here is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with socket.socket() as c:
        assert c.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED
