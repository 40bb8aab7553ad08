"""HTTP/2 streams and request bodies on the TLS listener, with real processes
and real clients: a stream's body is refused or timed out as an HTTP/1.1
request's is, before the proxy reads it; open streams hold no file; and over
TLS HTTP/1.1 a refused body's 413 reaches the client."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest

from tests.procs import SimEngine
from tests.test_integration_http2 import (
    ENGINE_MODELS,
    KEY,
    FrameRecorder,
    start_proxy,
    tls_dir,
)

pytestmark = pytest.mark.integration
__all__ = ["ENGINE_MODELS", "tls_dir"]   # shared with test_integration_http2


def tls_socket(port: int, cafile: Path, alpn: str) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(cafile))
    context.set_alpn_protocols([alpn])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock = context.wrap_socket(raw, server_hostname="localhost")
    assert sock.selected_alpn_protocol() == alpn
    return sock


def read_all(sock: ssl.SSLSocket, seconds: float) -> bytes:
    """What the proxy sends until it closes (or `seconds` pass)."""
    data, deadline = b"", time.monotonic() + seconds
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ssl.SSLWantReadError):
            continue
        except (ConnectionError, ssl.SSLError):
            break
        if not chunk:
            break
        data += chunk
    return data


def test_over_tls_http11_a_refused_chunked_body_gets_its_413(tls_dir: Path,
                                                             fresh_engine: SimEngine) -> None:
    """Over TLS HTTP/1.1, a chunked body that crosses max_body_bytes (sent
    whole with its head, as curl sends a small one) gets the 413 with its JSON
    body, not an empty reply: the TLS close comes after the answer."""
    proxy = start_proxy(tls_dir, fresh_engine)
    try:
        with tls_socket(proxy.port, tls_dir / "ca.pem", "http/1.1") as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n"
                         + b"1388\r\n" + b"x" * 5000 + b"\r\n0\r\n\r\n")
            answer = read_all(sock, 10)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert b'"code": "request_too_large"' in answer
    finally:
        proxy.stop()


CHAT = "/v1/chat/completions"
AUTH = ("authorization", f"Bearer {KEY}")


def open_post(recorder: FrameRecorder, *headers: tuple[str, str]) -> int:
    """A POST stream's headers, its body to follow."""
    stream = int(recorder.h2.get_next_available_stream_id())
    recorder.h2.send_headers(stream, [(":method", "POST"), (":path", CHAT), (":scheme", "https"),
                                      (":authority", "127.0.0.1"), *headers])
    recorder.flush()
    return stream


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_fifty_open_post_streams_hold_no_file(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """50 POST streams without Content-Length, each with part of its body in
    (past Twisted's 100,000-byte file threshold for an unknown length), hold
    no file descriptor of the proxy."""
    proxy = start_proxy(tls_dir, fresh_engine, max_body_bytes=1 << 20)
    recorder = FrameRecorder(proxy.port, tls_dir / "ca.pem")
    try:
        recorder.until(lambda: any(True for _ in recorder.frames))
        before = fds(proxy.pid)
        opened = [open_post(recorder, AUTH, ("content-type", "application/json"))
                  for _ in range(50)]
        for stream in opened:
            recorder.h2.send_data(stream, b"x" * 1000)
        recorder.flush()
        time.sleep(1.0)
        recorder.read()
        assert not recorder.status            # none answered: all open
        assert fds(proxy.pid) - before < 5
    finally:
        recorder.close()
        proxy.stop()


def test_a_keyless_post_gets_401_before_its_body_ends(tls_dir: Path,
                                                      fresh_engine: SimEngine) -> None:
    """The door runs on the headers: 401 (the JSON error) while the body has
    not come, then RST_STREAM(NO_ERROR)."""
    proxy = start_proxy(tls_dir, fresh_engine)
    recorder = FrameRecorder(proxy.port, tls_dir / "ca.pem")
    try:
        stream = open_post(recorder, ("content-type", "application/json"))
        recorder.h2.send_data(stream, b'{"model": ')
        recorder.flush()
        recorder.until(lambda: stream in recorder.reset)
        assert recorder.status[stream] == 401 and stream in recorder.ended
        assert b"invalid_api_key" in recorder.data[stream]
        assert recorder.reset[stream] == 0
    finally:
        recorder.close()
        proxy.stop()


def test_a_32_mib_upload_gets_an_early_413(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """A 32 MiB Content-Length is answered 413 before its body (raw frames);
    curl, uploading 32 MiB over HTTP/2, gets the 413 without sending it all."""
    proxy = start_proxy(tls_dir, fresh_engine)
    recorder = FrameRecorder(proxy.port, tls_dir / "ca.pem")
    try:
        stream = open_post(recorder, AUTH, ("content-length", str(32 << 20)))
        recorder.until(lambda: stream in recorder.ended)
        assert recorder.status[stream] == 413 and b"request_too_large" in recorder.data[stream]
    finally:
        recorder.close()
    big = tls_dir / "big.json"
    big.write_bytes(b"x" * (32 << 20))
    try:
        done = subprocess.run(
            ["curl", "-sS", "--http2", "--cacert", str(tls_dir / "ca.pem"), "--resolve",
             f"localhost:{proxy.port}:127.0.0.1", "-H", f"authorization: Bearer {KEY}",
             "--data-binary", f"@{big}", "-w", "\\n%{http_code} %{http_version} %{size_upload}",
             f"https://localhost:{proxy.port}{CHAT}"],
            capture_output=True, text=True, timeout=30, check=False)
        body, _, written = done.stdout.rpartition("\n")
        code, version, uploaded = written.split()
        assert (done.returncode, code, version) == (0, "413", "2"), done.stderr
        assert "request_too_large" in body and int(uploaded) < (32 << 20)
    finally:
        proxy.stop()


def test_a_stalled_body_gets_408(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """client_body_timeout_seconds (1 s here) without a DATA frame: 408, and
    the stream is reset; a stream that keeps sending is not timed out."""
    proxy = start_proxy(tls_dir, fresh_engine, client_body_timeout_seconds=1)
    recorder = FrameRecorder(proxy.port, tls_dir / "ca.pem")
    try:
        stalled = open_post(recorder, AUTH)
        recorder.h2.send_data(stalled, b'{"model": ')
        recorder.flush()
        started = time.monotonic()
        recorder.until(lambda: stalled in recorder.ended, timeout=10)
        assert time.monotonic() - started >= 0.9
        assert recorder.status[stalled] == 408 and b"request_timeout" in recorder.data[stalled]
        assert recorder.reset[stalled] == 0
    finally:
        recorder.close()
        proxy.stop()
