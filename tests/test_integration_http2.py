"""HTTP/2 on the TLS listener, with real processes: httpx (http2=True) streams
through it, keys, limits and errors answer as over HTTP/1.1, and a raw h2
client that records every frame sees the two-phase GOAWAY on SIGTERM and on a
SIGUSR1 upgrade: the GOAWAY with 2^31-1, then the one with the real last
stream id, its stream in flight complete and one opened between the two
served; a stream the client resets cancels the engine's request."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx2 as httpx
import pytest
import trustme
from h2.errors import ErrorCodes
from hyperframe.frame import Frame, GoAwayFrame

from tests.procs import Proxy, SimEngine, kill_if_alive, wait_gone, wait_until

pytestmark = pytest.mark.integration

KEY = "sk-h2-test-1f2e3d4c"
MAX_STREAM_ID = 2**31 - 1
CHAT = "/v1/chat/completions"


def chat(tokens: int, delay: float = 0.05) -> tuple[bytes, list[tuple[str, str]]]:
    body = json.dumps({"model": "m", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    return body, [("content-type", "application/json"), ("authorization", f"Bearer {KEY}"),
                  ("x-sim-tokens", str(tokens)), ("x-sim-delay", str(delay))]


def words(tokens: int) -> str:
    return "".join(f"tok{i} " for i in range(tokens))


def streamed_text(body: bytes) -> str:
    """The content an SSE chat completion carried, token by token."""
    text = ""
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text


class FrameRecorder:
    """A raw HTTP/2 client over TLS (ALPN h2) that records every frame the
    proxy sends. GOAWAY frames are recorded and kept from h2's state machine
    (which closes at the first one and then refuses the data of streams still
    in flight), so those streams can be read to their end. `read` stops at a
    GOAWAY, so a test can act before the frames after it (the PING) are
    answered."""

    def __init__(self, port: int, cafile: Path, acknowledge: bool = True) -> None:
        self.acknowledge = acknowledge      # False: no WINDOW_UPDATE, a reader that stalls
        context = ssl.create_default_context(cafile=str(cafile))
        context.set_alpn_protocols(["h2"])
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock = context.wrap_socket(raw, server_hostname="localhost")
        assert self.sock.selected_alpn_protocol() == "h2"
        self.sock.settimeout(0.2)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        self.buffer = b""
        self.frames: list[Frame] = []
        self.goaways: list[GoAwayFrame] = []
        self.status: dict[int, int] = {}
        self.data: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.reset: dict[int, int] = {}
        self.closed = False
        self.flush()

    def flush(self) -> None:
        out = self.h2.data_to_send()
        if out:
            self.sock.sendall(out)

    def request(self, path: str, body: bytes | None = None,
                headers: list[tuple[str, str]] | None = None, method: str = "POST") -> int:
        stream = int(self.h2.get_next_available_stream_id())
        self.h2.send_headers(stream, [(":method", method), (":path", path), (":scheme", "https"),
                                      (":authority", "localhost"), *(headers or [])],
                             end_stream=body is None)
        if body is not None:
            self.h2.send_data(stream, body, end_stream=True)
        self.flush()
        return stream

    def cancel(self, stream: int) -> None:
        self.h2.reset_stream(stream, ErrorCodes.CANCEL)
        self.flush()

    def read(self) -> None:
        """What has arrived: frames handled up to and including a GOAWAY."""
        if not self._take_frames():
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, ssl.SSLWantReadError):
                return
            except (ConnectionError, ssl.SSLError):
                data = b""
            if not data:
                self.closed = True
                return
            self.buffer += data
            self._take_frames()
        self.flush()

    def _take_frames(self) -> bool:
        """Frames from the buffer; True if it stopped at a GOAWAY."""
        while len(self.buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self.buffer[:9]))
            if len(self.buffer) < 9 + length:
                return False
            raw, self.buffer = self.buffer[:9 + length], self.buffer[9 + length:]
            frame.parse_body(memoryview(raw[9:]))
            self.frames.append(frame)
            if isinstance(frame, GoAwayFrame):
                self.goaways.append(frame)
                return True
            for event in self.h2.receive_data(raw):
                self._event(event)
        return False

    def _event(self, event: Any) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            self.status[event.stream_id] = int(dict(event.headers)[b":status"])
        elif isinstance(event, h2.events.DataReceived):
            self.data[event.stream_id] = self.data.get(event.stream_id, b"") + event.data
            if self.acknowledge:
                self.h2.acknowledge_received_data(event.flow_controlled_length,
                                                  event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self.ended.add(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            self.reset[event.stream_id] = event.error_code

    def until(self, check: Callable[[], Any], timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline or (self.closed and not self.buffer):
                raise AssertionError(f"timed out; frames: {self.frames[-10:]}")
            self.read()
        return check()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def tls_dir(tmp_path: Path) -> Path:
    ca = trustme.CA()
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    cert = ca.issue_cert("localhost", "127.0.0.1")
    (tmp_path / "proxy.pem").write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
    (tmp_path / "proxy.key").write_bytes(cert.private_key_pem.bytes())
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [
        {"name": "tester", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "admin": True}]}))
    return tmp_path


ENGINE_MODELS = ("m-up",)   # the `fresh_engine` fixture's (conftest.py)


def start_proxy(tls_dir: Path, engine: SimEngine, **extra: Any) -> Proxy:
    return Proxy({"tls": {"cert_file": "proxy.pem", "key_file": "proxy.key"}, **extra,
                  "keys_file": "keys.json", "max_body_bytes": 4096,
                  "hosts": [{"name": "gpu1", "url": engine.url}],
                  "models": {"m": {"host": "gpu1", "upstream": "m-up"}}}, tls_dir)


def test_httpx_speaks_http2_with_the_same_answers(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """httpx with http2=True gets HTTP/2 by ALPN and streams a chat completion
    token by token; a missing key is 401, an unknown model 404, a body over
    max_body_bytes 413, each with the proxy's JSON error; a client that offers
    only http/1.1 gets HTTP/1.1 on the same socket."""
    proxy = start_proxy(tls_dir, fresh_engine)
    try:
        context = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
        with httpx.Client(http2=True, verify=context, base_url=proxy.url, timeout=20) as client:
            body, headers = chat(12, 0.02)
            pieces = []
            with client.stream("POST", CHAT, content=body, headers=dict(headers)) as response:
                assert response.http_version == "HTTP/2" and response.status_code == 200
                for piece in response.iter_bytes():
                    pieces.append(piece)
            assert streamed_text(b"".join(pieces)) == words(12)
            assert len(pieces) > 3             # token by token, not one piece at the end
            key = {"authorization": f"Bearer {KEY}"}
            answers = [
                client.post(CHAT, json={"model": "m", "messages": []}),
                client.post(CHAT, json={"model": "nope", "messages": []}, headers=key),
                client.post(CHAT, content=b"x" * 5000, headers=key),
            ]
            assert [(a.http_version, a.status_code) for a in answers] == [
                ("HTTP/2", 401), ("HTTP/2", 404), ("HTTP/2", 413)]
            assert all(a.json()["error"]["message"] for a in answers)
        with httpx.Client(http2=False, verify=context, base_url=proxy.url) as client:
            one = client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
            assert (one.http_version, one.status_code) == ("HTTP/1.1", 200)
    finally:
        proxy.stop()


def test_a_reset_stream_cancels_the_engine_request(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """RST_STREAM from the client mid-stream: the engine sees its client go
    (its request ends as client-gone), the proxy logs the request as
    client-gone, and the connection's other stream goes on to its end."""
    proxy = start_proxy(tls_dir, fresh_engine)
    recorder = FrameRecorder(proxy.port, tls_dir / "ca.pem")
    try:
        body, headers = chat(400, 0.05)
        doomed = recorder.request(CHAT, body, headers)
        other = recorder.request(CHAT, *chat(10, 0.05))
        recorder.until(lambda: recorder.data.get(doomed))
        recorder.cancel(doomed)
        recorder.until(lambda: other in recorder.ended)
        assert streamed_text(recorder.data[other]) == words(10)
        assert wait_until(lambda: [r["outcome"] for r in fresh_engine.requests()
                                   if r["headers"].get("x-sim-tokens") == "400"] ==
                          ["client-gone"])
        proxy.wait_for(r"POST /v1/chat/completions model=m host=gpu1 .*outcome=client-gone")
    finally:
        recorder.close()
        proxy.stop()


def drain_and_check(proxy: Proxy, recorder: FrameRecorder, sig: int, tokens: int) -> None:
    """The two-phase GOAWAY on `sig`, with a stream of `tokens` in flight (long
    enough to outlast what comes before the drain) and one opened between the
    two GOAWAYs: both complete whole, then the connection closes."""
    first = recorder.request(CHAT, *chat(tokens, 0.05))
    recorder.until(lambda: recorder.data.get(first))
    proxy.signal(sig)
    recorder.until(lambda: recorder.goaways, timeout=30)
    assert (recorder.goaways[0].last_stream_id, recorder.goaways[0].error_code) == \
        (MAX_STREAM_ID, 0)
    # Before the PING behind that GOAWAY is answered: a new stream.
    between = recorder.request(CHAT, *chat(5, 0.05))
    recorder.until(lambda: len(recorder.goaways) == 2)
    assert (recorder.goaways[1].last_stream_id, recorder.goaways[1].error_code) == (between, 0)
    recorder.until(lambda: recorder.closed)
    assert recorder.reset == {}
    assert {first, between} <= recorder.ended
    assert streamed_text(recorder.data[first]) == words(tokens)
    assert streamed_text(recorder.data[between]) == words(5)
    assert recorder.status == {first: 200, between: 200}
    proxy.wait_for(rf"http2 drain 127\.0\.0\.1:\d+: GOAWAY last stream {MAX_STREAM_ID} "
                   r"\(no new streams\) and a PING; 1 stream\(s\) in flight")
    proxy.wait_for(rf"http2 drain .*: GOAWAY last stream {between} after the PING's ack; "
                   r"2 stream\(s\) in flight finish")
    proxy.wait_for(r"http2 drain .*: closed after its last stream")


def test_sigterm_drains_http2_with_two_goaways(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """SIGTERM: GOAWAY 2^31-1, then (after the PING's round trip) GOAWAY with
    the last stream the client opened; nothing is cut and the proxy exits 0."""
    proxy = start_proxy(tls_dir, fresh_engine)
    recorder = FrameRecorder(proxy.port, tls_dir / "ca.pem")
    try:
        drain_and_check(proxy, recorder, signal.SIGTERM, 30)
        assert proxy.popen.wait(timeout=30) == 0
        proxy.wait_for(r"drained, exiting")
    finally:
        recorder.close()
        proxy.stop()


def test_an_upgrade_drains_http2_with_two_goaways(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """SIGUSR1: the successor takes the socket; the old process sends both
    GOAWAYs on its HTTP/2 connection, finishes its streams and exits 0, and a
    new HTTP/2 connection is served by the successor. The stream opened
    between the two GOAWAYs is re-sent to the successor, as the old process
    does with every request it receives after the hand-over."""
    proxy = start_proxy(tls_dir, fresh_engine)
    recorder = FrameRecorder(proxy.port, tls_dir / "ca.pem")
    new_pid = None
    try:
        old_pid = proxy.pid
        drain_and_check(proxy, recorder, signal.SIGUSR1, 120)
        new_pid = int(proxy.wait_for(r"upgrade: handed over to pid (\d+)").group(1))
        assert proxy.popen.wait(timeout=30) == 0
        fresh = FrameRecorder(proxy.port, tls_dir / "ca.pem")
        try:
            stream = fresh.request("/status", method="GET",
                                   headers=[("authorization", f"Bearer {KEY}")])
            fresh.until(lambda: stream in fresh.ended)
            assert json.loads(fresh.data[stream])["pid"] == new_pid != old_pid
        finally:
            fresh.close()
    finally:
        recorder.close()
        proxy.stop()
        if new_pid is not None:         # the successor is not the process Proxy started
            os.kill(new_pid, signal.SIGTERM)
            assert wait_gone(new_pid)
            kill_if_alive(new_pid)


def test_a_stream_whose_reader_stalls_is_reset(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """A client that stops reading (sends no WINDOW_UPDATE) holds no engine
    forever: once flow control has paused its stream for client_write_stall_seconds,
    the stream is reset, the engine's request cancelled, and the request ends as
    client-stalled, as an HTTP/1.1 reader that stalls is aborted."""
    proxy = start_proxy(tls_dir, fresh_engine, client_write_stall_seconds=2)
    recorder = FrameRecorder(proxy.port, tls_dir / "ca.pem", acknowledge=False)
    try:
        stream = recorder.request(CHAT, *chat(20000, 0.001))
        recorder.until(lambda: stream in recorder.reset, timeout=30)
        assert stream not in recorder.ended
        assert len(recorder.data[stream]) <= 65535     # the initial window, no more
        ok = wait_until(lambda: [r["outcome"] for r in fresh_engine.requests()
                                 if r["headers"].get("x-sim-tokens") == "20000"] ==
                        ["client-gone"])
        assert ok, [(r["outcome"], r.get("headers")) for r in fresh_engine.requests()]
        proxy.wait_for(r"POST /v1/chat/completions model=m host=gpu1 .*outcome=client-stalled")
    finally:
        recorder.close()
        proxy.stop()
