"""Every status the proxy sends goes out with its standard reason phrase, on the
reference site and on the speedups' (issue 45, item 9): Twisted's own table
lacks 424, 429 and 431, which would say `Unknown Status`."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock
from twisted.web.resource import Resource
from twisted.web.server import Request

from llmproxy.speedups import Selection
from llmproxy.speedups.site import site_class
from llmproxy.testing.fakes import Connection
from llmproxy.web.errors import reason, write_error
from llmproxy.web.site import ProxySite

SITES = {"reference": ProxySite,
         "speedups": site_class(Selection(True, ("response_writes",)))}
REQUEST = b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


class Answer(Resource):
    isLeaf = True

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status

    def render(self, request: Request) -> int:
        write_error(request, self.status, "no", "no")
        return 1


@pytest.mark.parametrize("site", SITES, ids=str)
@pytest.mark.parametrize(("status", "phrase"), [
    (424, b"Failed Dependency"), (429, b"Too Many Requests"),
    (431, b"Request Header Fields Too Large"), (404, b"Not Found"),
    (503, b"Service Unavailable"), (409, b"Conflict")])
def test_the_status_line_has_the_standard_phrase(site: str, status: int,
                                                 phrase: bytes) -> None:
    """An error answered through the site starts with `HTTP/1.1 <status> <phrase>`."""
    conn = Connection(SITES[site](Answer(status), 1 << 20, reactor=Clock()))
    conn.channel.dataReceived(REQUEST)
    head = conn.transport.value().split(b"\r\n", 1)[0]
    assert head == b"HTTP/1.1 %d %s" % (status, phrase)


def test_no_status_the_proxy_sends_is_unknown() -> None:
    """The table knows every status written anywhere in llmproxy/ (and 1xx-5xx
    registered ones); only an unregistered one is `Unknown Status`."""
    for status in (200, 204, 400, 401, 403, 404, 405, 408, 409, 413, 424, 429, 431,
                   500, 502, 503, 504):
        assert reason(status) != b"Unknown Status", status
    assert reason(599) == b"Unknown Status"
