"""Every combination of the client-side speedups (none, response_writes)
against the reference ProxySite: the same bytes in, however they are split
over reads, give the same bytes out, the same requests seen, the same
connection state and the same client timers; and a guard that fails leaves
its speedup out of the site."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from llmproxy.speedups import REFERENCE, Selection, responsewrites, select
from llmproxy.speedups.responsewrites import GatheringChannel, SendingRequest
from llmproxy.speedups.site import site_class
from llmproxy.testing.fakes import Connection
from llmproxy.web.site import ProxyRequest, ProxySite

COMBINATIONS = [(), ("response_writes",)]
MAX_BODY = 64


class Echo(Resource):
    """Answers by path: a streamed answer, an empty one, a refused body's 413,
    or the body it got."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, ...]] = []

    def render(self, request: Request) -> Any:
        assert request.content is not None
        body = request.content.read()
        self.seen.append((request.method, request.uri, request.clientproto,
                          sorted(request.requestHeaders.getAllRawHeaders()), body))
        if isinstance(request, ProxyRequest) and request.state.body_too_large:
            request.setResponseCode(413)
            request.setHeader(b"connection", b"close")
            return b"too large"
        if request.path == b"/stream":
            request.write(b"data: 1\n\n")
            request.write(b"data: 2\n\n")
            request.finish()
            return NOT_DONE_YET
        if request.path == b"/empty":
            request.setResponseCode(204)
            return b""
        return b"got " + body


def serve(names: tuple[str, ...], data: bytes, cuts: list[int]) -> tuple[Any, ...]:
    """`data` sent in pieces (cut at `cuts`) to a site with the speedups `names`:
    what the client got and everything the comparison looks at."""
    root = Echo()
    clock = Clock()
    site = site_class(Selection(True, names))(root, MAX_BODY, reactor=clock)
    conn = Connection(site)
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(data)}), len(data)]
    for start, end in itertools.pairwise(bounds):
        if conn.closed:
            break
        conn.channel.dataReceived(data[start:end])
    clock.advance(0)
    timers = conn.channel.timers
    # The site dates its answers by its reactor (the Clock's epoch here); an
    # answer to `*` has Twisted's own Date, by the wall clock, on every path.
    out = re.sub(rb"Date: (?!Thu, 01 Jan 1970 00:00:00 GMT)[^\r]*", b"Date: (now)",
                 conn.transport.value())
    return (out, root.seen, conn.closed, conn.transport.write_closed,
            conn.transport.producerState, timers.phase, timers.heard)


def test_each_combination_has_its_classes() -> None:
    """The site mixes in exactly the speedups selected; none is the reference."""
    assert site_class(REFERENCE) is ProxySite
    assert site_class(Selection(True, ())) is ProxySite
    for names in COMBINATIONS[1:]:
        cls = site_class(Selection(True, names))
        assert issubclass(cls, ProxySite)
        assert issubclass(cls.protocol, GatheringChannel) == ("response_writes" in names)
        assert issubclass(cls.requestFactory, SendingRequest) == ("response_writes" in names)
        assert site_class(Selection(True, names)) is cls      # made once


@pytest.mark.parametrize("module", [responsewrites])
def test_a_failing_guard_leaves_its_speedup_out(module: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A Twisted whose code differs from the one a speedup follows: the
    selection leaves it off (saying why) and the site is made without it."""
    name = next(iter(module.SOURCES))
    monkeypatch.setitem(module.SOURCES, name, "0" * 16)
    chosen = select({})
    assert module.SPEEDUP.name in chosen.off and name in chosen.off[module.SPEEDUP.name]
    cls = site_class(chosen)
    assert not issubclass(cls.protocol, GatheringChannel)


GET = b"GET /a HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
CASES = [
    GET,
    GET + GET,
    b"POST /a HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\nhi" + GET,
    b"POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\nhi",
    b"GET /stream HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /empty HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + GET,
    b"HEAD /a HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n" + GET,
    b"POST /a HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b"x" * 100,
    b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n50\r\n" + b"x" * 80 + b"\r\n",
    b"POST /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi",
    b"GET /a HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" + GET,
    b"GET /a?q=%20 HTTP/1.1\r\nCookie: a=1\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + GET,
    b"GET /a HTTP/1.1\r\nBad Name: x\r\n\r\n",
    b"POST /a HTTP/1.1\r\nContent-Length: lots\r\n\r\n",
    b"GET /a HTTP/1.1\r\n" + b"X-A: b\r\n" * 501 + b"\r\n",
    b"\r\nGET /a HTTP/1.1\r\nX-A: one\r\n two\r\n\r\n",
]

# Pieces for requests the cases above do not have.
METHODS = st.sampled_from([b"GET", b"POST", b"HEAD", b"get", b"PUT"])
PATHS = st.sampled_from([b"/a", b"/stream", b"/empty", b"/a?b=c", b"/a%2Fb", b"*", b"/\x7f"])
VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0"])
HEADERS = st.lists(st.sampled_from([
    b"Host: 127.0.0.1", b"Connection: close", b"Connection: keep-alive", b"Cookie: a=1; b",
    b"Expect: 100-continue", b"Transfer-Encoding: identity", b"Transfer-Encoding: gzip",
    b"Content-Length: 1", b"Content-Length: -1", b"X-A: a\x00b", b" folded", b"No colon",
    b"X-Long: " + b"y" * 200]), max_size=4)
BODIES = st.binary(max_size=80)


@st.composite
def request_bytes(draw: st.DrawFn) -> bytes:
    """A request, plainly valid or not, framed by its body's length or chunked."""
    head = [draw(METHODS) + b" " + draw(PATHS) + b" " + draw(VERSIONS), *draw(HEADERS)]
    body = draw(BODIES)
    framing = draw(st.sampled_from(["length", "chunked", "none"]))
    if framing == "length":
        head.append(b"Content-Length: %d" % len(body))
    elif framing == "chunked":
        head.append(b"Transfer-Encoding: chunked")
        body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    else:
        body = b""
    return b"\r\n".join(head) + b"\r\n\r\n" + body


@pytest.mark.parametrize("data", CASES)
@pytest.mark.parametrize("names", COMBINATIONS[1:])
def test_known_cases_come_out_as_on_the_reference_path(data: bytes,
                                                       names: tuple[str, ...]) -> None:
    """Each case whole, and a byte at a time, as on the reference path."""
    assert serve(names, data, []) == serve((), data, [])
    every = list(range(len(data)))
    assert serve(names, data, every) == serve((), data, every)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(request_bytes(), min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=4))
def test_any_bytes_come_out_as_on_the_reference_path(requests: list[bytes],
                                                     cuts: list[int]) -> None:
    """Pipelined requests, hostile ones among them, split anywhere: every
    combination of speedups answers as the reference path answers."""
    data = b"".join(requests)
    reference = serve((), data, cuts)
    for names in COMBINATIONS[1:]:
        assert serve(names, data, cuts) == reference, names


class Held(Resource):
    """Answers nothing yet: keeps the request."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []

    def render(self, request: Request) -> Any:
        self.requests.append(request)
        return NOT_DONE_YET


@pytest.mark.parametrize("names", COMBINATIONS)
def test_a_request_whose_client_left_says_so(names: tuple[str, ...]) -> None:
    """`state.client_gone` (what routes reads when a bug cuts a request short) is
    set once the connection is lost under an unfinished request, on every path."""
    root = Held()
    conn = Connection(site_class(Selection(True, names))(root, MAX_BODY, reactor=Clock()))
    conn.channel.dataReceived(GET)
    [request] = root.requests
    assert isinstance(request, ProxyRequest) and not request.state.client_gone
    conn.disconnect()
    assert request.state.client_gone
