"""The request head as the site takes it (Twisted's HTTPChannel, on both paths):
what every response carries, and where the path goes."""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.web.resource import Resource
from twisted.web.server import Request

from llmproxy.testing.fakes import Connection
from llmproxy.web.site import ProxySite


class Recorder(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.postpaths: list[list[bytes]] = []

    def render(self, request: Request) -> bytes:
        self.postpaths.append(request.postpath)
        return b"ok"


def run(data: bytes, clock: Clock) -> tuple[Recorder, Any]:
    root = Recorder()
    conn = Connection(ProxySite(root, 1 << 20, reactor=clock))
    conn.channel.dataReceived(data)
    return root, conn


def test_responses_carry_server_and_the_reactors_date_made_once_a_second() -> None:
    """Every response says Server, and the Date of the site's reactor."""
    clock = Clock()
    clock.advance(1_000_000_000.25)
    get = b"GET /a HTTP/1.1\r\nHost: p\r\n\r\n"
    _, conn = run(get, clock)
    clock.advance(0.5)
    conn.channel.dataReceived(get)
    clock.advance(0.5)
    conn.channel.dataReceived(get)
    out = conn.transport.value()
    assert out.count(b"Server: TwistedWeb/") == 3
    assert out.count(b"Date: Sun, 09 Sep 2001 01:46:40 GMT\r\n") == 2
    assert out.count(b"Date: Sun, 09 Sep 2001 01:46:41 GMT\r\n") == 1


def test_the_path_is_unquoted_into_postpath_as_twisted_does() -> None:
    root, _ = run(b"GET /v1/a%20b/%2Fc?q=%20 HTTP/1.1\r\nHost: p\r\n\r\n"
                  b"GET /v1/models HTTP/1.1\r\nHost: p\r\n\r\n", Clock())
    assert root.postpaths == [[b"v1", b"a b", b"/c"], [b"v1", b"models"]]
