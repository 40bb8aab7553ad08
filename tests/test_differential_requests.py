"""Equivalence of the two paths on the way in (issue 33, point 4): the same
client bytes sent to a proxy with every speedup this Twisted allows
(`select({})`) and to one on the reference path (`REFERENCE`), both built here
whatever LLMPROXY_SPEEDUPS says, give the client the same answers, the engine
the same requests and the access log the same events. Valid requests (JSON
completions, a body in the head's read or split from it, pipelined, kept
alive) and hostile ones (framing conflicts, odd Transfer-Encodings, bad chunk
sizes, folded or bare-LF or NUL headers, oversized heads), sent whole or cut
into reads at any point. Where one path forwards and the other refuses, the
engine's records differ and the test fails.

What is normalized, and why (everything else is compared byte for byte):

- The engine's view (differential_views.engine_view):
  - Host and Content-Length are compared by value, not by position: Twisted's
    Agent writes Content-Length first and Host last, the fast client the other
    way round.
  - Both ask for `Accept-Encoding: identity` alone, whatever the client asked
    (asserted): the reference's treq adds `gzip`, which web/treqlayers.py
    replaces.
  - The request target is compared percent-encoded as
    web.engineclient.request_target encodes it (bytes outside 0x21-0x7e, and
    `#`): the reference encodes them for hyperlink, the fast client sends the
    client's bytes raw (as request_target's docstring says).
  - X-Request-Id is checked to be a request id, then blanked: each proxy has
    its own random id prefix.
- The client's view: the Date header is dropped (the two runs may straddle a
  second) and X-Request-Id blanked as above. Nothing follows the channel's
  answer to a malformed request (400 bad_request, Connection: close): a read
  the reactor had already polled when the channel closed is not parsed, on
  either path (`test_a_malformed_request_is_answered_once` and
  `test_a_refused_request_is_not_dispatched`).

Harness (tests/differential.py): both proxies, the engine and the client run in
this process on the reactor pytest-twisted runs, over real sockets on
127.0.0.1. `@given` wraps an `async def` marked `pytest_twisted.ensureDeferred`:
pytest-twisted replaces hypothesis' `inner_test` so that each example runs as a
Deferred on the reactor's greenlet and is waited for (`blockon` is refused
there, hence no synchronous `@given`), so an example awaits real network
events and no sleep is needed; the proxies and the engine are a module-scoped
async fixture, made once. Each exchange ends with a `GET /healthz` carrying
`Connection: close`, so every connection ends with the proxy's close: that
close is the event the client waits for (bounded: a hang fails the test).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.web.resource import Resource

from llmproxy.compat import channel_mixins
from llmproxy.compat import select as select_compat
from llmproxy.speedups.site import site_class
from tests.differential import MAX_BODY, Rig, both, cut, selections
from tests.differential_views import assert_same, replies

pytestmark = pytest.mark.integration

SENTINEL = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
CHAT = b"/v1/chat/completions"


def post(extra: bytes = b"", body: bytes = BODY, path: bytes = CHAT,
         version: bytes = b"HTTP/1.1") -> bytes:
    """A POST of `body` by its length, with `extra` header lines."""
    return (b"POST %s %s\r\nHost: 127.0.0.1\r\n%sContent-Length: %d\r\n\r\n%s"
            % (path, version, extra, len(body), body))


def chunked(size_line: bytes, extra: bytes = b"", data: bytes = BODY) -> bytes:
    """A POST of `data` in one chunk whose size line is `size_line`."""
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sTransfer-Encoding: chunked\r\n\r\n"
            b"%s\r\n%s\r\n0\r\n\r\n" % (CHAT, extra, size_line, data))


def framed(encoding: bytes) -> bytes:
    """A chunked body under the Transfer-Encoding value `encoding`."""
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Transfer-Encoding: %s\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
            % (CHAT, encoding, len(BODY), BODY))


HUGE = b"POST %s HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n%s" % (
    CHAT, b"x" * (MAX_BODY + 100))
SIZE = b"%x" % len(BODY)
# name: (pieces, the status codes the client gets, on either path)
CASES: dict[str, tuple[list[bytes], list[int]]] = {
    "one read": ([post()], [200, 200]),
    "body in its own read": ([post()[:-len(BODY)], BODY], [200, 200]),
    "head cut mid-line": ([post()[:20], post()[20:]], [200, 200]),
    "pipelined": ([post() + post(b"X-Second: 1\r\n")], [200, 200, 200]),
    "pipelined after a split body": ([post()[:-5], post()[-5:] + post()], [200, 200, 200]),
    "keep-alive, then chunked": ([post(), chunked(SIZE)], [200, 200, 200]),
    "http/1.0": ([post(version=b"HTTP/1.0")], [200]),
    "expect 100-continue": ([post(b"Expect: 100-continue\r\n")], [100, 200, 200]),
    "content-length and transfer-encoding": ([post(b"Transfer-Encoding: chunked\r\n")], [400]),
    "two equal content-lengths": ([post(b"Content-Length: %d\r\n" % len(BODY))], [400]),
    "two different content-lengths": ([post(b"Content-Length: 3\r\n")], [400]),
    "te chunked, identity": ([framed(b"chunked, identity")], [400]),
    "te xchunked": ([framed(b"xchunked")], [400]),
    "te CHUNKED": ([framed(b"CHUNKED")], [200, 200]),
    "te chunked with trailing spaces": ([framed(b"chunked   ")], [200, 200]),
    "te identity beside a length": ([post(b"Transfer-Encoding: identity\r\n")], [200, 200]),
    "chunk size not hex": ([chunked(b"zz")], [400]),
    "chunk size negative": ([chunked(b"-" + SIZE)], [400]),
    "chunk size 0x": ([chunked(b"0x" + SIZE)], [400]),
    "chunk size with a space": ([chunked(SIZE + b" ")], [400]),
    "chunk size upper case, zeros": ([chunked(b"00" + SIZE.upper())], [200, 200]),
    "chunk extension": ([chunked(SIZE + b';a=b;c="d e"')], [200, 200]),
    "chunk extension bad": ([chunked(SIZE + b";a=\x01")], [400]),
    "chunk size huge": ([HUGE], [413]),
    "obs-fold": ([post(b"X-A: one\r\n two\r\n")], [200, 200]),
    "bare LF head": ([post().replace(b"\r\n", b"\n")], [400]),
    "one bare LF": ([post(b"X-A: b\nX-B: c\r\n")], [400]),
    "NUL in a value": ([post(b"X-A: a\x00b\r\n")], [400]),
    "a header line without a colon": ([post(b"Nocolon\r\n")], [400]),
    "space before the colon": ([post(b"X-A : b\r\n")], [400]),
    "an oversized header": ([post(b"X-A: " + b"y" * 20000 + b"\r\n")], [431]),
    "too many headers": ([post(b"X-A: b\r\n" * 600)], [431]),
    "a body over the limit": ([post(body=b"x" * (MAX_BODY + 1))], [413]),
    "empty line first": ([b"\r\n" + post()], [200, 200]),
    "hop-by-hop and named headers": (
        [post(b"Connection: keep-alive, X-Foo\r\nX-Foo: 1\r\nTE: trailers\r\nUpgrade: h2c\r\n"
              b"Proxy-Authorization: x\r\nKeep-Alive: 5\r\n")], [200, 200]),
    "duplicate and odd-case headers": (
        [post(b"x-lower: a\r\nX-A: 1\r\nCONTENT-TYPE: application/json\r\nX-A: 2\r\n"
              b"X-Forwarded-For: 1.2.3.4\r\nCookie: a=1\r\nX-Tab:\tv\t\r\n")], [200, 200]),
    "target with a query, # and high bytes": (
        [post(path=CHAT + b"?q=%20&r=\x7f\x80\xb0#frag")], [200, 200]),
    "accept-encoding from the client": ([post(b"Accept-Encoding: br\r\n")], [200, 200]),
    "invalid json": ([post(body=b"{nope")], [400, 200]),
    "unknown model": ([post(body=b'{"model": "nope"}')], [404, 200]),
    "lower-case method": ([post().replace(b"POST", b"post", 1)], [405, 200]),
    "absolute-form target": ([post(path=b"http://p" + CHAT)], [404, 200]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest_twisted.ensureDeferred
async def test_each_known_request_is_answered_and_forwarded_alike(rig: Rig, name: str) -> None:
    """Each case above: the client gets the codes the table says on the
    reference path, and the speedups' path gives the client, the engine and
    the access log the same (the case is what its name says: a hostile one is
    refused, a valid one forwarded)."""
    pieces, codes = CASES[name]
    reference, fast = await both(rig, [*pieces[:-1], pieces[-1] + SENTINEL])
    assert [r.code for r in replies(reference.received)] == codes
    assert_same(reference, fast)


def sent(data: bytes, cuts: list[float]) -> list[bytes]:
    """`data` cut at `cuts` (fractions of its length), the sentinel after its end."""
    pieces = cut(data, cuts)
    pieces[-1] += SENTINEL
    return pieces


@st.composite
def completions(draw: st.DrawFn) -> bytes:
    """A valid JSON completion, by its length or chunked, with some of the
    headers clients send."""
    doc = {"model": "m", "stream": draw(st.booleans()),
           "messages": [{"role": "user", "content": draw(st.text(max_size=40))}]}
    body = json.dumps(doc).encode()
    path = draw(st.sampled_from([CHAT, b"/v1/completions", b"/v1/embeddings", CHAT + b"?a=1"]))
    extra = b"".join(draw(st.lists(st.sampled_from([
        b"Content-Type: application/json\r\n", b"Authorization: Bearer sk-x\r\n",
        b"User-Agent: OpenAI/Python 1.0\r\n", b"Accept: */*\r\n", b"X-Trace: abc\r\n",
        b"Connection: keep-alive\r\n", b"Accept-Encoding: gzip, deflate\r\n"]), max_size=4)))
    if draw(st.booleans()):
        return post(extra, body, path)
    sizes = draw(st.lists(st.integers(1, 30), max_size=3))
    chunks, at = b"", 0
    for size in [*sizes, len(body)]:
        piece, at = body[at:at + size], at + size
        chunks += b"%x\r\n%s\r\n" % (len(piece), piece) if piece else b""
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"%sTransfer-Encoding: chunked\r\n\r\n%s0\r\n\r\n"
            % (path, extra, chunks))


CUTS = st.lists(st.floats(0, 1, exclude_max=True), max_size=4)
SETTINGS = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(requests=st.lists(completions(), min_size=1, max_size=3), cuts=CUTS)
@pytest_twisted.ensureDeferred
async def test_valid_completions_reach_the_engine_alike(rig: Rig, requests: list[bytes],
                                                        cuts: list[float]) -> None:
    """Valid completions, pipelined on one kept-alive connection and cut into
    reads anywhere: every one is answered 200 and reaches the engine once, on
    both paths, as the same bytes."""
    reference, fast = await both(rig, sent(b"".join(requests), cuts))
    assert [r.code for r in replies(reference.received)] == [200] * (len(requests) + 1)
    assert len(reference.engine) == len(requests)
    assert_same(reference, fast)


HOSTILE_HEADERS = st.sampled_from([
    b"X-A: b", b"Content-Type: application/json", b"Accept: */*", b"X-A: b", b"X-B:  c ",
    b"Content-Length: 3", b"Content-Length: 0", b"Content-Length: +5", b"Content-Length: 1 2",
    b"Transfer-Encoding: chunked", b"Transfer-Encoding: identity", b"Transfer-Encoding: gzip",
    b"Transfer-Encoding: chunked, identity", b"Transfer-Encoding: xchunked",
    b"Transfer-Encoding: Chunked ", b" folded", b"\tfolded", b"X-A: a\x00b", b"X-A: a\nb",
    b"Nocolon", b"X-A : b", b"X:", b"X-High: \xe9\xff", b"Expect: 100-continue",
    b"Connection: close", b"Connection: X-A, keep-alive", b"Host: q",
    b"X-Long: " + b"z" * 17000])
SIZE_LINES = st.sampled_from([b"%x", b"%x", b"%X", b"00%x", b"%x;a=b", b'%x;a="b c"', b"%x;a=\x01",
                              b"zz", b"-%x", b"0x%x", b" %x", b"%x ", b"%x\t", b"+%x"])


@st.composite
def hostile(draw: st.DrawFn) -> bytes:
    """A request that may be valid or not: an odd request line, hostile
    headers, a body framed by its length, chunked (its size line mangled, or
    huge with a body past the limit) or not at all, lines ended by CRLF or LF."""
    line = b" ".join([draw(st.sampled_from([b"POST"] * 5 + [b"GET", b"post", b"P@ST"])),
                      draw(st.sampled_from([CHAT] * 4 + [b"/v1/completions", b"*", b"/v1/\x7f",
                                            CHAT + b"?x=\xa0#y"])),
                      draw(st.sampled_from([b"HTTP/1.1"] * 5 + [b"HTTP/1.0", b"HTTP/1.2"]))])
    head = [line, *draw(st.lists(HOSTILE_HEADERS, max_size=2))]
    body = draw(st.sampled_from([BODY, BODY, b"{bad", b'{"model": "nope"}', b""]))
    framing = draw(st.sampled_from(["length", "length", "chunked", "chunked", "huge", "none"]))
    if framing == "length":
        head.append(b"Content-Length: %d" % len(body))
    elif framing == "chunked":
        size = draw(SIZE_LINES).replace(b"%x", b"%x" % len(body)).replace(
            b"%X", b"%X" % len(body))
        head.append(b"Transfer-Encoding: chunked")
        body = b"%s\r\n%s\r\n0\r\n\r\n" % (size, body) if body else b"0\r\n\r\n"
    elif framing == "huge":
        head.append(b"Transfer-Encoding: chunked")
        body = b"ffffffffffffffffff\r\n" + b"x" * (MAX_BODY + 100)
    else:
        body = b""
    eol = draw(st.sampled_from([b"\r\n"] * 5 + [b"\n"]))
    return eol.join(head) + eol + eol + body


@SETTINGS
@given(requests=st.lists(st.one_of(hostile(), completions()), min_size=1, max_size=3),
       cuts=CUTS)
@pytest_twisted.ensureDeferred
async def test_any_requests_are_answered_and_forwarded_alike(rig: Rig, requests: list[bytes],
                                                             cuts: list[float]) -> None:
    """Hostile requests among valid ones, pipelined and cut into reads
    anywhere: both paths answer the client alike, forward exactly the same
    requests to the engine (none that the other refuses) and log the same."""
    reference, fast = await both(rig, sent(b"".join(requests), cuts))
    assert reference.received.startswith(b"HTTP/1.")
    assert_same(reference, fast)


class TCPLike(StringTransport):
    """A StringTransport that, like a TCP transport, lets a closing channel
    unregister a producer it never registered and pause or resume reading."""

    def unregisterProducer(self) -> None:
        self.producer = None

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass


class Rendered(Resource):
    """Records the path of every request rendered."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[bytes] = []

    def render(self, request: Any) -> bytes:
        self.paths.append(request.path)
        return b"rendered"


def closed_by_a_400(name: str, first: bytes) -> tuple[Any, TCPLike, Rendered]:
    """Path `name`'s site (in memory) after `first`, answered 400: its channel,
    transport and resource."""
    root = Rendered()
    site = site_class(selections()[name], channel_mixins(select_compat()))(
        root, MAX_BODY, reactor=Clock())
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    transport = TCPLike()
    channel.makeConnection(transport)
    channel.dataReceived(first)
    assert transport.disconnecting and transport.value().count(b" 400 ") == 1
    return channel, transport, root


@pytest.mark.parametrize("name", ["reference", "speedups"])
def test_a_malformed_request_is_answered_once(name: str) -> None:
    """In memory, each path's site: a chunked body with a bad size is answered
    400 and the connection closes; a read that still comes is not answered
    again (the failed chunk decoder is not fed again: no second 400)."""
    channel, transport, _ = closed_by_a_400(
        name, b"POST %s HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n" % CHAT)
    channel.dataReceived(b"0\r\n\r\n")
    assert transport.value().count(b" 400 ") == 1


@pytest.mark.parametrize("name", ["reference", "speedups"])
def test_a_refused_request_is_not_dispatched(name: str) -> None:
    """In memory, each path's site: a head with a line that is not a header is
    answered 400 and the connection closes; a read that still comes and ends
    that head does not get the refused request dispatched (rendered, and
    answered, after the 400)."""
    channel, _, root = closed_by_a_400(
        name, b"GET /v1/models HTTP/1.1\r\nNocolon\r\nX-A: b\r\n")
    channel.dataReceived(b"\r\n")
    assert root.paths == []
