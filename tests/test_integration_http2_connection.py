"""One HTTP/2 client against a real proxy (twistd, TLS, ALPN h2) and a real
engine: it cannot grow the proxy's memory after a protocol error, nor hold a
core with a shut flow-control window, nor read a stream cut by a dying
engine as a whole answer (RST_STREAM INTERNAL_ERROR; curl --http2 fails);
its hostile frames end its connection with one log line, no traceback, and
headers over the HTTP/1.1 limits get the 431 HTTP/1.1 gives them."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import h2.settings
import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import ContinuationFrame, HeadersFrame, PriorityFrame

from tests.procs import Proxy, SimEngine
from tests.test_integration_http2 import (
    CHAT,
    ENGINE_MODELS,
    KEY,
    FrameRecorder,
    chat,
    start_proxy,
    tls_dir,
)

pytestmark = pytest.mark.integration
__all__ = ["ENGINE_MODELS", "tls_dir"]   # shared with test_integration_http2

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def rss(pid: int) -> int:
    """The resident memory of process `pid`, in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) process `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def h2_socket(proxy: Proxy, cafile: Path) -> ssl.SSLSocket:
    """A TLS connection that chose h2 by ALPN."""
    context = ssl.create_default_context(cafile=str(cafile))
    context.set_alpn_protocols(["h2"])
    sock = context.wrap_socket(socket.create_connection(("127.0.0.1", proxy.port), timeout=10),
                               server_hostname="localhost")
    assert sock.selected_alpn_protocol() == "h2"
    return sock


def test_bytes_after_a_protocol_error_are_not_kept(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """65 CONTINUATION frames, then the client sends as fast as it can without
    reading: the proxy's memory stays within a small bound of where it was
    (Twisted's connection kept every byte: a GiB in seconds), the
    connection is aborted within seconds (not at the idle timeout), and the
    log says why in one line, with no traceback."""
    proxy = start_proxy(tls_dir, fresh_engine)
    try:
        sock = h2_socket(proxy, tls_dir / "ca.pem")
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        flood = HeadersFrame(1, data=b"\x82", flags=["END_STREAM"]).serialize()
        flood += b"".join(ContinuationFrame(1, data=b"\x84").serialize() for _ in range(65))
        sock.sendall(flood)
        before = rss(proxy.pid)
        chunk, sent, started = b"\x00" * 65536, 0, time.monotonic()
        try:
            while time.monotonic() - started < 30:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        lasted = time.monotonic() - started
        grown = rss(proxy.pid) - before
        assert sent > 128 * MIB, f"only {sent} bytes sent in {lasted:.1f}s"
        assert grown < 48 * MIB, f"RSS grew {grown / MIB:.0f} MiB after {sent / MIB:.0f} MiB"
        assert lasted < 20, "the connection outlived its close by far"
        proxy.wait_for(r"http2 127\.0\.0\.1:\d+: connection closed: ProtocolError")
        sock.close()
    finally:
        proxy.stop()
    assert "Traceback" not in proxy.output()


def test_a_shut_window_holds_no_core(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE 0 and a GET whose answer is finished at
    once: over two seconds the proxy uses a small fraction of the CPU time
    that passed (Twisted's sending loop used all of it), and at
    client_write_stall_seconds the stream is reset (INTERNAL_ERROR), one line
    saying so."""
    proxy = start_proxy(tls_dir, fresh_engine, client_write_stall_seconds=4)
    recorder = FrameRecorder(proxy.port, tls_dir / "ca.pem", acknowledge=False)
    try:
        recorder.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        stream = recorder.request("/v1/models", method="GET",
                                  headers=[("authorization", f"Bearer {KEY}")])
        recorder.until(lambda: recorder.status.get(stream))
        assert not recorder.data.get(stream)
        window, spent = 2.0, cpu_seconds(proxy.pid)
        time.sleep(window)
        spent = cpu_seconds(proxy.pid) - spent
        assert spent < 0.25 * window, f"{spent:.2f}s of CPU in {window}s"
        recorder.until(lambda: stream in recorder.reset, timeout=20)
        assert recorder.reset[stream] == ErrorCodes.INTERNAL_ERROR
        proxy.wait_for(rf"http2 127\.0\.0\.1:\d+: stream {stream} reset: its client read "
                       r"nothing of it for 4s")
    finally:
        recorder.close()
        proxy.stop()
    assert "Traceback" not in proxy.output()


def curl_http2() -> str | None:
    """curl, if it is here and speaks HTTP/2."""
    curl = shutil.which("curl")
    if curl is None:
        return None
    version = subprocess.run([curl, "--version"], check=False, capture_output=True,
                             text=True).stdout
    return curl if "HTTP2" in version else None


def test_a_stream_cut_by_a_dying_engine_is_an_error(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """The engine dies after 3 chunks: the client's stream is reset with
    INTERNAL_ERROR (not NO_ERROR, which reads as a whole answer), after
    what the engine sent."""
    proxy = start_proxy(tls_dir, fresh_engine)
    recorder = FrameRecorder(proxy.port, tls_dir / "ca.pem")
    try:
        body, headers = chat(20, 0.05)
        stream = recorder.request(CHAT, body, [*headers, ("x-sim-die-after", "3")])
        recorder.until(lambda: stream in recorder.reset or stream in recorder.ended)
        assert recorder.reset == {stream: ErrorCodes.INTERNAL_ERROR}
        assert stream not in recorder.ended and b"tok2" in recorder.data[stream]
    finally:
        recorder.close()
        proxy.stop()


@pytest.mark.skipif(curl_http2() is None, reason="no curl with HTTP/2 here")
def test_curl_sees_the_cut_as_an_error(tls_dir: Path, fresh_engine: SimEngine) -> None:
    """curl --http2 exits with an error on a stream cut by a dying engine
    (it exited 0 on Twisted's NO_ERROR), as it does over HTTP/1.1."""
    proxy = start_proxy(tls_dir, fresh_engine)
    try:
        body, _ = chat(20, 0.05)
        run = subprocess.run(
            [str(curl_http2()), "-sS", "--http2", "--cacert", str(tls_dir / "ca.pem"),
             "-o", "/dev/null", "-H", f"authorization: Bearer {KEY}",
             "-H", "content-type: application/json", "-H", "x-sim-tokens: 20",
             "-H", "x-sim-delay: 0.05", "-H", "x-sim-die-after: 3",
             "--data-binary", body.decode(), f"https://127.0.0.1:{proxy.port}{CHAT}"],
            check=False, capture_output=True, text=True, timeout=30)
        assert run.returncode != 0 and "INTERNAL_ERROR" in run.stderr, run
    finally:
        proxy.stop()


def test_hostile_frames_close_with_one_line_and_big_heads_get_431(
        tls_dir: Path, fresh_engine: SimEngine) -> None:
    """PRIORITY frames for 1,001 idle streams: the connection ends with
    GOAWAY ENHANCE_YOUR_CALM and one log line, no traceback. 1,500 headers on
    another connection: 431, as HTTP/1.1 answers more than 500."""
    proxy = start_proxy(tls_dir, fresh_engine)
    try:
        flood = FrameRecorder(proxy.port, tls_dir / "ca.pem")
        flood.sock.sendall(b"".join(PriorityFrame(2 * i + 1, depends_on=0, stream_weight=15)
                                    .serialize() for i in range(1001)))
        flood.until(lambda: flood.goaways)
        assert flood.goaways[0].error_code == ErrorCodes.ENHANCE_YOUR_CALM
        flood.close()
        proxy.wait_for(r"http2 127\.0\.0\.1:\d+: connection closed: TooManyStreamsError")
        big = FrameRecorder(proxy.port, tls_dir / "ca.pem")
        stream = big.request("/v1/models", method="GET", headers=[
            ("authorization", f"Bearer {KEY}"), *[(f"x-h{i}", "v") for i in range(1500)]])
        big.until(lambda: stream in big.ended)
        assert big.status[stream] == 431
        assert b"request_header_fields_too_large" in big.data[stream]
        big.close()
    finally:
        proxy.stop()
    assert "Traceback" not in proxy.output()
