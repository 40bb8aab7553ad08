"""Graceful stop of a real `twistd -n llmproxy` process: SIGTERM drains
running streams, refuses new connections, cuts only at the deadline, and the
exit status and log say what happened."""

from __future__ import annotations

import errno
import fcntl
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.notifysock import NotifyReceiver
from tests.procs import Proxy, SimEngine, env, one_host, twistd, wait_until

pytestmark = pytest.mark.integration


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
        proxy = Proxy(one_host(engine), tmp_path, extra_env={"NOTIFY_SOCKET": notify.address})
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
    proxy = Proxy(one_host(engine, drain_seconds=1), tmp_path)
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
    proxy = Proxy(one_host(engine), tmp_path)
    stream = Stream(proxy.port, tokens=16, delay=0.25)
    idle = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    idle.request("GET", "/healthz")
    assert idle.getresponse().read()
    slow = Stream(proxy.port, tokens=10, delay=0.25, stream=False)  # headers come at the end
    wait_until(lambda: len(proxy.get_json("/status")["in_flight"]) == 3, 10)  # both, and /status
    proxy.signal(signal.SIGTERM)
    proxy.wait_for("stopping: ")
    assert wait_until(lambda: refused(proxy.port), 10), "still accepting during the drain"
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
    proxy = Proxy(one_host(engine), tmp_path)
    Stream(proxy.port, tokens=120, delay=0.25)   # 30 s
    wait_until(lambda: len(proxy.get_json("/status")["in_flight"]) == 2, 10)
    proxy.signal(sig)
    proxy.wait_for("stopping: 1 request")
    second = time.monotonic()
    proxy.signal(sig)
    code, exited = wait_exit(proxy, 20)
    assert code == status and exited - second < 10
    name = signal.Signals(sig).name
    assert (f"received {name} again during the stop: exiting now with status {status}"
            in proxy.output())


def test_a_stop_that_overruns_its_budget_exits_124(engine: SimEngine, tmp_path: Path) -> None:
    """A blocked reactor cannot hold the stop up: here the reactor blocks, as it
    would on a stalled journal, writing a log line to a stdout pipe nobody
    reads. The pipe is filled (by the test, which holds it too) to leave room for
    the signal's line only, so the reactor arms the last-resort timer, then
    blocks on the next line; the timer thread ends the process at the budget
    (drain 0 s + cut logging 2 s + engine wait 60 s) + 5 s with status 124,
    saying so on stderr. About 70 s: the budget has no shorter form."""
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({**one_host(engine), "listen": "127.0.0.1:0", "drain_seconds": 0}))
    out_r, out_w = os.pipe()
    proc = subprocess.Popen([twistd(), "-n", "--pidfile=", "llmproxy", "-c", str(path)],
                            stdout=out_w, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=env(), cwd=tmp_path)
    try:
        seen = read_pipe_until(out_r, b"ready: listening", 20)
        ready = next(line for line in seen.decode().splitlines() if "ready: listening" in line)
        # The signal's line has the ready line's prefix (time, namespace, level).
        first = len(ready[:ready.index("ready:")] + "received SIGTERM: stopping gracefully\n")
        room = first + 50                        # the next line ("stopping: ...") is longer
        os.write(out_w, b"#" * (fcntl.fcntl(out_w, fcntl.F_GETPIPE_SZ) - room))
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(100)
        took = time.monotonic() - signalled
        assert proc.stderr is not None
        stderr = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(out_w)
    logged = read_pipe_until(out_r, b"", 1).replace(b"#", b"").decode()
    os.close(out_r)
    assert code == 124, (code, stderr, logged)
    assert 62 + 5 <= took < 62 + 5 + 10
    assert "the stop took over 67s, beyond its budget: exiting now (status 124)" in stderr
    assert "received SIGTERM: stopping gracefully" in logged and "stopping: " not in logged


def read_pipe_until(fd: int, marker: bytes, timeout: float) -> bytes:
    """What `fd` holds once `marker` has come (b"": all there is now), as it
    comes, then whatever else is already there."""
    data = b""
    deadline = time.monotonic() + timeout
    while (not marker or marker not in data) and time.monotonic() < deadline:
        if not select.select([fd], [], [], 0.2)[0]:
            if not marker:
                break
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    while select.select([fd], [], [], 0.2)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data


def test_refused_connect_errno_is_econnrefused() -> None:
    """Guard for the refusal test above: connecting to a closed port here is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with socket.socket() as c:
        assert c.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED
