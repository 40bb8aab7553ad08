"""The response_writes speedup (speedups/responsewrites.py) against Twisted's
own Request.write (the reference ProxySite): the same request and the same
resource must put the same bytes on the wire both ways; what its first write
(`_head_and`) does not take (HEAD, 204/304, cookies, ETag, Last-Modified) goes
Twisted's way."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from typing import Any, cast

import pytest
from twisted.internet import tcp
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from llmproxy.speedups import Selection, responsewrites
from llmproxy.speedups.responsewrites import SendingRequest
from llmproxy.speedups.site import site_class
from llmproxy.testing.fakes import Connection
from llmproxy.web.site import ProxySite

# The response_writes speedup alone.
FAST = site_class(Selection(True, ("response_writes",)))

Render = Callable[[Request], Any]


class Answer(Resource):
    isLeaf = True

    def __init__(self, render: Render) -> None:
        super().__init__()
        self._render = render

    def render(self, request: Request) -> Any:
        return self._render(request)


def wire(render: Render, request: bytes, lean: bool,
         monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, int]:
    """The bytes a client gets, and how many first writes took the lean path
    (`lean`: the speedup; else the reference path)."""
    taken: list[bytes] = []
    head_and = SendingRequest._head_and

    def spy(self: SendingRequest, data: bytes) -> bytes:
        taken.append(data)
        return head_and(self, data)

    monkeypatch.setattr(SendingRequest, "_head_and", spy)
    conn = Connection((FAST if lean else ProxySite)(Answer(render), 1 << 20, reactor=Clock()))
    conn.channel.dataReceived(request)
    monkeypatch.undo()
    return conn.transport.value(), len(taken)


def bytes_body(request: Request) -> bytes:
    request.setHeader(b"content-type", b"application/json")
    return b'{"ok": true}'


def chunks(request: Request) -> object:
    request.setHeader(b"x-request-id", b"r1")
    request.responseHeaders.addRawHeader(b"x-many", b"one")
    request.responseHeaders.addRawHeader(b"x-many", b"two")
    request.write(b"data: 1\n\n")
    request.write(b"data: 2\n\n")
    request.finish()
    return NOT_DONE_YET


def empty_first(request: Request) -> object:
    request.write(b"")
    request.write(b"after")
    request.finish()
    return NOT_DONE_YET


def finish_only(request: Request) -> object:
    request.setResponseCode(202, b"Taken")
    request.finish()
    return NOT_DONE_YET


def not_found(request: Request) -> bytes:
    request.setResponseCode(404)
    return b"nothing here"


def zero_length(request: Request) -> object:
    request.setHeader(b"content-length", b"0")
    request.write(b"")
    request.finish()
    return NOT_DONE_YET


def no_content(request: Request) -> object:
    request.setResponseCode(204)
    request.finish()
    return NOT_DONE_YET


def with_cookie(request: Request) -> bytes:
    request.addCookie(b"k", b"v")
    return b"cookie"


def with_etag(request: Request) -> bytes:
    request.setETag(b"abc")
    return b"etag"


GET = b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
GET10 = b"GET /x HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"
POST = b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\nhi"
HEAD = b"HEAD /x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

LEAN = [
    (bytes_body, GET), (bytes_body, POST), (bytes_body, GET10), (chunks, GET),
    (chunks, GET10), (empty_first, GET), (finish_only, POST), (not_found, GET),
    (zero_length, GET),
]
TWISTED = [(bytes_body, HEAD), (chunks, HEAD), (no_content, GET), (with_cookie, GET),
           (with_etag, GET)]


@pytest.mark.parametrize(("render", "request_bytes", "lean_path"),
                         [(*case, 1) for case in LEAN] + [(*case, 0) for case in TWISTED])
def test_the_first_write_puts_twisteds_bytes_on_the_wire(
        render: Render, request_bytes: bytes, lean_path: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """LEAN cases take the lean path once, TWISTED ones never; both ways give
    the bytes Twisted's own write gives."""
    lean, taken = wire(render, request_bytes, True, monkeypatch)
    twisted, _ = wire(render, request_bytes, False, monkeypatch)
    assert taken == lean_path
    assert lean == twisted
    version = request_bytes.split(b"\r\n")[0].split(b" ")[-1]
    assert lean.startswith(version + b" ")


def test_a_chunked_answer_is_framed_and_ends_with_the_last_chunk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lean, _ = wire(chunks, GET, True, monkeypatch)
    head, _, body = lean.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head.split(b"\r\n")
    assert b"X-Many: one\r\nX-Many: two" in head
    assert body == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a real TCP connection on 127.0.0.1: (server's, client's)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return server, client


def test_a_framed_piece_is_on_the_socket_at_once_and_queues_behind_what_waits() -> None:
    """send_chunk over a real TCP connection: with nothing buffered a piece is on
    the socket before any reactor turn; one the socket cannot take whole leaves
    its rest to the transport (watched for writing), and a piece after it
    queues behind it: the client gets every byte in order, each counted once."""
    ours, peer = _tcp_pair()
    reactor = MemoryReactorClock()
    held: list[SendingRequest] = []

    def first(request: Request) -> object:
        request.write(b"data: 1\n\n")
        held.append(cast(SendingRequest, request))
        return NOT_DONE_YET

    site = FAST(Answer(first), 1 << 20, reactor=Clock())
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    assert channel is not None
    transport = tcp.Server(ours, channel, ("127.0.0.1", 40000), None, 1,
                           reactor)  # type: ignore[arg-type]
    channel.makeConnection(transport)
    try:
        channel.dataReceived(GET)
        [request] = held
        peer.setblocking(False)
        head = peer.recv(65536)
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"9\r\ndata: 1\n\n\r\n")
        small = b"9\r\ndata: 2\n\n\r\n"
        assert request.send_chunk(small, 9)
        assert peer.recv(100) == small and not reactor.getWriters()
        big = b"x" * (8 << 20)                   # more than both socket buffers hold
        framed = b"%x\r\n%b\r\n" % (len(big), big)
        assert request.send_chunk(framed, len(big))
        assert transport._tempDataLen or transport.dataBuffer
        assert reactor.getWriters() == [transport]
        assert request.send_chunk(small, 9)      # behind the rest of the big one
        received = []
        while reactor.getWriters():
            with contextlib.suppress(BlockingIOError):
                received.append(peer.recv(1 << 20))
            transport.doWrite()
        while True:
            try:
                received.append(peer.recv(1 << 20))
            except BlockingIOError:
                break
        assert b"".join(received) == framed + small
        assert request.sentLength == 9 + 9 + len(big) + 9
    finally:
        ours.close()
        peer.close()


def test_the_twisted_code_it_follows_is_the_installed_one() -> None:
    """The guard holds the source of every Twisted function the speedup copies
    or stands in for, and of the TCP transport send_now writes to."""
    assert responsewrites.guard() is None, responsewrites.guard()
