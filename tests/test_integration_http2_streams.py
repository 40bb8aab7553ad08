"""HTTP/2 streams and request bodies on the TLS listener, with real processes
and real clients: a stream's body is refused or timed out as an HTTP/1.1
request's is, before the proxy reads it; open streams hold no file; and over
TLS HTTP/1.1 a refused body's 413 reaches the client."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import pytest

from tests.procs import SimEngine
from tests.test_integration_http2 import engine, start_proxy, tls_dir

pytestmark = pytest.mark.integration
__all__ = ["engine", "tls_dir"]     # the fixtures, shared with test_integration_http2


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
                                                             engine: SimEngine) -> None:
    """Over TLS HTTP/1.1, a chunked body that crosses max_body_bytes (sent
    whole with its head, as curl sends a small one) gets the 413 with its JSON
    body, not an empty reply: the TLS close comes after the answer."""
    proxy = start_proxy(tls_dir, engine)
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
