"""The request_head speedup (speedups/requesthead.py) against Twisted's
line-by-line path (the reference ProxySite): the same bytes, sent whole to
each and one byte at a time, must give the same requests, headers, bodies and
answers; what it does not take goes Twisted's way."""

from __future__ import annotations

from io import BytesIO
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.web.http import HTTPChannel
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import Request

from llmproxy.speedups import Selection, requesthead, select
from llmproxy.speedups.headparser import parse_head, request_line
from llmproxy.speedups.requesthead import HeadChannel
from llmproxy.speedups.site import site_class
from llmproxy.testing.fakes import Connection
from llmproxy.web import site
from llmproxy.web.site import ProxyChannel, ProxySite

# The request_head speedup alone (tests/test_writes.py has response_writes;
# tests/test_speedup_sites.py every combination).
FAST = site_class(Selection(True, ("request_head",)))


class Counting:
    """Mixed into a channel: counts the lines Twisted's parser took."""

    lines = 0
    raw: list[bytes]     # what went through raw mode (a body the decoder had)

    def lineReceived(self, line: bytes) -> None:
        self.lines += 1
        super().lineReceived(line)  # type: ignore[misc]

    def rawDataReceived(self, data: bytes) -> None:
        self.raw = [*getattr(self, "raw", []), data]
        super().rawDataReceived(data)  # type: ignore[misc]


class CountingChannel(Counting, FAST.protocol):  # type: ignore[misc, name-defined]
    pass


class CountingReference(Counting, ProxyChannel):
    pass


def fast_site(root: Resource, max_body: int = 1 << 20, clock: Clock | None = None,
              protocol: type = CountingChannel) -> ProxySite:
    """A Site with the request_head speedup, its channels `protocol`."""
    made = FAST(root, max_body, reactor=clock or Clock())
    made.protocol = protocol  # type: ignore[assignment]
    return made


class Recorder(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, ...]] = []
        self.postpaths: list[list[bytes]] = []

    def render(self, request: Request) -> bytes:
        assert request.content is not None
        body = request.content.read()
        self.seen.append((request.method, request.uri, request.clientproto,
                          sorted(request.requestHeaders.getAllRawHeaders()), body))
        self.postpaths.append(request.postpath)
        return b"got " + body


def run(data: bytes, whole: bool, max_body: int = 1 << 20,
        clock: Clock | None = None, fast: bool = True) -> tuple[Recorder, Connection]:
    """`data` sent to a new connection whole or a byte at a time, on the fast
    path or the reference one."""
    root = Recorder()
    if fast:
        site = fast_site(root, max_body, clock)
    else:
        site = ProxySite(root, max_body, reactor=clock or Clock())
        site.protocol = CountingReference  # type: ignore[assignment]
    conn = Connection(site)
    if whole:
        conn.channel.dataReceived(data)
    else:
        for i in range(len(data)):
            if conn.closed:
                break             # a TCP transport reads nothing more once closing
            conn.channel.dataReceived(data[i:i + 1])
    return root, conn


def both(data: bytes, max_body: int = 1 << 20) -> tuple[list[Any], bytes, int]:
    """Send `data` whole to the fast path, and whole and byte by byte to the
    reference one; assert all give the same; return the requests seen, the
    bytes answered and how many lines Twisted's parser took on the fast path."""
    fast, fast_conn = run(data, True, max_body)
    out = fast_conn.transport.value()
    for whole in (True, False):
        slow, slow_conn = run(data, whole, max_body, fast=False)
        assert fast.seen == slow.seen
        assert out == slow_conn.transport.value()
        assert fast_conn.closed == slow_conn.closed
    return fast.seen, out, fast_conn.channel.lines


POST = (b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: proxy\r\n"
        b"content-type: application/json\r\nX-Thing: a\r\nx-thing:  b \r\n"
        b"Content-Length: 11\r\n\r\n{\"model\":1}")


def test_a_post_with_its_body_in_the_same_read_takes_the_one_read_path() -> None:
    seen, out, lines = both(POST)
    assert lines == 0
    # The body went to the request with the head, without the decoder.
    assert not hasattr(run(POST, True)[1].channel, "raw")
    assert seen == [(b"POST", b"/v1/chat/completions?x=1", b"HTTP/1.1", [
        (b"Content-Length", [b"11"]), (b"Content-Type", [b"application/json"]),
        (b"Host", [b"proxy"]), (b"X-Thing", [b"a", b"b"])], b'{"model":1}')]
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b'got {"model":1}')


def test_pipelined_requests_and_a_body_in_a_later_read() -> None:
    get = b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\n\r\n"
    seen, out, _ = both(get + POST + get)
    assert [s[1] for s in seen] == [b"/v1/models", b"/v1/chat/completions?x=1", b"/v1/models"]
    assert out.count(b"HTTP/1.1 200 OK") == 3
    # The head whole in one read, its body in the next.
    fast, conn = run(POST[:POST.index(b"\r\n\r\n") + 4], True)
    conn.channel.dataReceived(b'{"model":1}')
    assert fast.seen[0][-1] == b'{"model":1}' and conn.channel.lines == 0
    assert conn.channel.raw == [b'{"model":1}']
    # Part of the body with the head: the decoder takes it, and the rest later.
    fast, conn = run(POST[:-3], True)
    conn.channel.dataReceived(POST[-3:])
    assert fast.seen[0][-1] == b'{"model":1}' and conn.channel.raw == [b'{"model"', b':1}']


def test_a_chunked_body() -> None:
    data = (b"POST /v1/x HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    seen, _, lines = both(data)
    assert lines == 0 and seen[0][-1] == b"hello world"


def test_http_1_0_and_connection_close_end_the_connection() -> None:
    for data in (b"GET /a HTTP/1.0\r\nHost: p\r\n\r\n",
                 b"GET /a HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n"):
        _, _, lines = both(data)
        assert lines == 0
        assert run(data, True)[1].closed


def test_expect_100_continue() -> None:
    data = b"POST /a HTTP/1.1\r\nHost: p\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    _, out, lines = both(data)
    assert lines == 0 and out == b"HTTP/1.1 100 Continue\r\n\r\n"


def test_a_body_over_the_limit_is_refused_the_same_way() -> None:
    data = b"POST /a HTTP/1.1\r\nHost: p\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
    _, _, lines = both(data, max_body=10)
    assert lines == 0


def test_expect_100_continue_with_the_body_already_there() -> None:
    data = (b"POST /a HTTP/1.1\r\nHost: p\r\nExpect: 100-continue\r\n"
            b"Content-Length: 2\r\n\r\nhi")
    seen, out, _ = both(data)
    assert seen[0][-1] == b"hi" and out.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")


def test_a_request_is_made_as_twisteds_init_makes_it() -> None:
    _, conn = run(b"", True)
    channel = conn.channel
    lean = requesthead.made_request(site.ProxyRequest, channel)
    twisted_made = site.ProxyRequest(channel)
    assert type(lean) is site.ProxyRequest

    def state(request: Request) -> dict[str, Any]:
        return {name: value._rawHeaders if isinstance(value, Headers) else value
                for name, value in vars(request).items()}

    assert state(lean) == state(twisted_made)
    assert lean.requestHeaders is not lean.responseHeaders
    assert not lean.notifications and lean.notifications is not twisted_made.notifications


class StateRecorder(Recorder):
    """Also keeps the request's and its channel's state as the resource sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def render(self, request: Request) -> bytes:
        def plain(value: Any) -> Any:
            if isinstance(value, Headers):
                return sorted(value.getAllRawHeaders())
            if hasattr(value, "getvalue"):             # the body: its bytes and position
                return value.getvalue(), value.tell()
            if hasattr(value, "getTime"):              # a timer: when it runs
                return "timer", value.getTime() if value.active() else None
            if isinstance(value, list):                # as it is now, not as it ends
                return [plain(item) for item in value]
            if isinstance(value, dict):
                return {key: plain(item) for key, item in value.items()}
            return value if isinstance(value, (bytes, str, int, float, bool, type(None))) \
                else type(value)
        channel = {k: plain(v) for k, v in vars(request.channel).items()}
        timers = request.channel.timers        # where the channel's timers are
        channel["timers"] = {k: plain(v) for k, v in vars(timers).items()}
        self.states.append(({k: plain(v) for k, v in vars(request).items()}, channel))
        return super().render(request)


WHOLE_CASES = [
    POST.replace(b"?x=1", b""),
    b"POST /a HTTP/1.1\r\nHost: p\r\nCookie: a=1; b=2\r\nContent-Length: 2\r\n\r\nhi",
    b"POST /a HTTP/1.1\r\nHost: p\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi",
    b"POST /a HTTP/1.1\r\nHost: p\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nhi",
    b"POST /a HTTP/1.0\r\nHost: p\r\nContent-Length: 2\r\n\r\nhi",
    b"POST /a%20b HTTP/1.1\r\nHost: p\r\nContent-Length: 2\r\n\r\nhi",
    # Over the body limit below: refused by the request's own gotLength.
    b"POST /a HTTP/1.1\r\nHost: p\r\nContent-Length: 40\r\n\r\n" + b"x" * 40,
]


@pytest.mark.parametrize("data", WHOLE_CASES)
def test_a_whole_request_is_left_as_twisteds_calls_leave_it(
        data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that came whole with its head: _whole leaves the request and the
    channel, when the resource gets it, as allHeadersReceived, the body,
    allContentReceived and requestReceived leave them, and answers the same."""
    def served(known: bool) -> tuple[StateRecorder, Connection]:
        if not known:       # the head parsed at once, then Twisted's calls
            monkeypatch.setattr(HeadChannel, "_plain", lambda *args: False)
        root = StateRecorder()
        conn = Connection(fast_site(root, 32))
        taken: list[bool] = []
        whole = conn.channel._whole

        def spy(*args: Any) -> bool:
            taken.append(True)
            return whole(*args)
        conn.channel._whole = spy
        conn.channel.dataReceived(data)
        assert bool(taken) == known
        if not conn.closed:     # and the connection goes on to the next request
            conn.channel.dataReceived(b"GET /next HTTP/1.1\r\nHost: p\r\n\r\n")
        return root, conn

    fused, fused_conn = served(True)
    twisteds, twisteds_conn = served(False)
    monkeypatch.undo()
    assert fused.seen == twisteds.seen and fused.states == twisteds.states
    assert fused.states and fused.states[0][0]["method"] == b"POST"
    assert fused_conn.transport.value() == twisteds_conn.transport.value()
    assert fused_conn.closed == twisteds_conn.closed


def test_a_query_a_timeout_or_a_form_take_twisteds_calls() -> None:
    """What _whole does not do (a query to parse, form parsing asked for)
    leaves the request to Twisted's calls; with Twisted's own timeout on, every
    head goes Twisted's way."""
    body = b"Host: p\r\nContent-Length: 2\r\n\r\nhi"
    _, conn = run(b"", True)
    channel = conn.channel
    request = FAST.requestFactory(channel)
    head = parse_head(b"POST /a HTTP/1.1\r\n" + body.split(b"\r\n\r\n")[0], 16384, 16384, 100)
    query = parse_head(b"POST /a?b=c HTTP/1.1\r\n" + body.split(b"\r\n\r\n")[0],
                       16384, 16384, 100)
    assert head is not None and query is not None
    assert channel._plain(request, head) and not channel._plain(request, query)
    request._parsePOSTFormSubmission = True
    assert not channel._plain(request, head)
    # The query is Twisted's to parse, and parsed.
    root, _ = run(POST, True)
    assert root.seen[0][1] == b"/v1/chat/completions?x=1"
    root, conn = run(b"", True)
    conn.channel.timeOut = 60
    conn.channel.dataReceived(POST)
    assert conn.channel.lines > 0 and root.seen[0][-1] == b'{"model":1}'


def test_a_twisted_whose_request_has_other_attributes_makes_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first request is made both ways and compared: the same attributes,
    and the lean way is taken from then on; others, and Twisted's is."""
    _, conn = run(b"", True)
    channel = conn.channel

    class Same(site.ProxyRequest):
        pass

    class Other(site.ProxyRequest):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.new_in_twisted = True

    made: list[type] = []
    lean = requesthead.made_request

    def spy(cls: Any, channel: Any) -> Any:
        made.append(cls)
        return lean(cls, channel)

    monkeypatch.setattr(requesthead, "made_request", spy)
    for cls in (Same, Other):
        requests = [requesthead.new_request(cls, channel) for _ in range(3)]
        assert all(type(r) is cls for r in requests)
    assert made == [Same, Same, Same, Other]    # Other: only the first comparison
    assert [getattr(r, "new_in_twisted", False) for r in requests] == [True] * 3


def test_an_empty_line_first_or_a_folded_header_go_twisteds_way_and_are_served() -> None:
    for data in (b"\r\nGET /a HTTP/1.1\r\nHost: p\r\n\r\n",
                 b"GET /a HTTP/1.1\r\nX-A: one\r\n two\r\nHost: p\r\n\r\n"):
        seen, out, lines = both(data)
        assert lines > 0 and len(seen) == 1 and out.startswith(b"HTTP/1.1 200 OK")
    assert parse_head(b"GET /a HTTP/1.1\r\nX-A: one\r\n two", 16384, 16384, 500) is None


@pytest.mark.parametrize("data", [
    b"GET /a HTTP/2.0\r\nHost: p\r\n\r\n",                         # not HTTP/1.x
    b"GET  /a HTTP/1.1\r\nHost: p\r\n\r\n",                        # a malformed request line
    b"GET /a HTTP/1.1\r\nNo colon here\r\n\r\n",
    b"GET /a HTTP/1.1\r\nBad Name: x\r\n\r\n",
    b"GET /a HTTP/1.1\r\nX-A: a\x00b\r\n\r\n",
    b"GET /a HTTP/1.1\r\nX-A: a\rb\r\n\r\n",                         # a lone CR in a value
    b"GET /a HTTP/1.1\r\nX-A: a\nb\r\n\r\n",                         # a lone LF in a value
    b"GET /a\n HTTP/1.1\r\nHost: p\r\n\r\n",                       # and in the request line
    b"POST /a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
    b"POST /a HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    b"POST /a HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"GET /a HTTP/1.1\r\n" + b"X-Big: " + b"y" * 17000 + b"\r\n\r\n",   # over 16 KiB
    b"GET /a HTTP/1.1\r\n" + b"X-A: b\r\n" * 501 + b"\r\n",            # over 500 headers
])
def test_a_bad_head_goes_twisteds_way_with_the_same_answer(data: bytes) -> None:
    assert parse_head(data[:data.index(b"\r\n\r\n")], 16384, 16384, 500) is None
    seen, out, lines = both(data)
    assert lines > 0 and seen == []
    assert out.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431"))


LINES = [b"GET /a HTTP/1.1", b"POST /v1/chat/completions?x=1 HTTP/1.0", b"get /a HTTP/1.1",
         b"M-SEARCH * HTTP/1.1", b"GET /a HTTP/1.1 ", b"GET /a  HTTP/1.1", b"GET  /a HTTP/1.1",
         b"GET HTTP/1.1", b" GET /a HTTP/1.1", b"GET /a HTTP/2.0", b"GET /a http/1.1",
         b"GET /a", b"", b"G(T /a HTTP/1.1", b"GET /\xb0 HTTP/1.1", b"GET /\xb1 HTTP/1.1",
         b"GET /\x7f HTTP/1.1", b"GET /a\tb HTTP/1.1", b"PO\xc3\xa9ST /a HTTP/1.1"]


@pytest.mark.parametrize("line", LINES + [b"GET /" + bytes([c]) + b" HTTP/1.1"
                                          for c in range(256) if c != 32])
def test_a_request_line_is_taken_only_as_twisted_takes_it(line: bytes) -> None:
    """Every line request_line takes, Twisted's _parseRequestLine takes the same
    way; a line with a target byte Twisted refuses is never taken; the usual
    lines are."""
    from twisted.web.http import _parseRequestLine

    ours = request_line(line)
    try:
        theirs: tuple[bytes, bytes, bytes] | None = _parseRequestLine(line)
    except ValueError:
        theirs = None
    assert ours is None or ours == theirs
    if theirs is not None and theirs[0].isalpha():
        assert ours == theirs
    if line in (b"GET /a HTTP/1.1", b"POST /v1/chat/completions?x=1 HTTP/1.0"):
        assert ours is not None


def test_a_request_after_a_non_persistent_one_is_dropped_the_same_way() -> None:
    first = b"GET /a HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n"
    seen, _, _ = both(first + b"GET /b HTTP/1.1\r\nHost: p\r\n\r\n")
    assert [s[1] for s in seen] == [b"/a"]


def test_transfer_encoding_identity_is_ignored_as_twisted_ignores_it() -> None:
    data = b"POST /a HTTP/1.1\r\nTransfer-Encoding: identity\r\nContent-Length: 2\r\n\r\nhi"
    seen, _, lines = both(data)
    assert lines == 0 and seen[0][-1] == b"hi"


@pytest.mark.parametrize("fast", [True, False])
def test_responses_carry_server_and_the_reactors_date_made_once_a_second(fast: bool) -> None:
    """Both paths say Server, and the Date of the site's reactor."""
    clock = Clock()
    clock.advance(1_000_000_000.25)
    get = b"GET /a HTTP/1.1\r\nHost: p\r\n\r\n"
    _, conn = run(get, True, clock=clock, fast=fast)
    clock.advance(0.5)
    conn.channel.dataReceived(get)
    clock.advance(0.5)
    conn.channel.dataReceived(get)
    out = conn.transport.value()
    assert out.count(b"Server: TwistedWeb/") == 3
    assert out.count(b"Date: Sun, 09 Sep 2001 01:46:40 GMT\r\n") == 2
    assert out.count(b"Date: Sun, 09 Sep 2001 01:46:41 GMT\r\n") == 1


@pytest.mark.parametrize("fast", [True, False])
def test_the_path_is_unquoted_into_postpath_as_twisted_does(fast: bool) -> None:
    root, _ = run(b"GET /v1/a%20b/%2Fc?q=%20 HTTP/1.1\r\nHost: p\r\n\r\n"
                  b"GET /v1/models HTTP/1.1\r\nHost: p\r\n\r\n", True, fast=fast)
    assert root.postpaths == [[b"v1", b"a b", b"/c"], [b"v1", b"models"]]


def test_the_twisted_code_it_follows_is_the_installed_one() -> None:
    """The guard holds the source of every Twisted function the speedup copies
    or stands in for (the Twisted it follows, 26.10, is the one installed)."""
    assert requesthead.guard() is None, requesthead.guard()


def test_a_guard_that_fails_leaves_every_head_to_twisted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Twisted whose code differs turns the speedup off: the site is the
    reference one, whose parser takes every head."""
    name = "twisted.web.http.HTTPChannel.lineReceived"
    monkeypatch.setitem(requesthead.SOURCES, name, "0" * 16)
    chosen = select({})
    assert not chosen.on("request_head") and name in chosen.off["request_head"]
    cls = site_class(chosen)
    assert not issubclass(cls.protocol, HeadChannel)
    root = Recorder()
    made = cls(root, 1 << 20, reactor=Clock())
    made.protocol = type("Counted", (Counting, made.protocol), {})  # type: ignore[assignment]
    conn = Connection(made)
    conn.channel.dataReceived(POST)
    assert conn.channel.lines > 0 and root.seen[0][-1] == b'{"model":1}'


class ContentRecorder(Recorder):
    """Also keeps what kind of file each request's content was."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[type] = []

    def render(self, request: Request) -> bytes:
        self.kinds.append(type(request.content))
        return super().render(request)


@pytest.mark.parametrize(("size", "max_body", "one_step"), [
    (11, 1 << 20, True),            # the usual: in memory, in one step
    (99_999, 1 << 20, True),
    (100_000, 1 << 20, False),      # Twisted keeps this one in a temporary file
    (40, 32, False),                # over the limit: refused by gotLength
])
def test_a_whole_body_within_the_limit_is_the_content_in_one_step(
        size: int, max_body: int, one_step: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that came whole with its head and is kept in memory becomes the
    request's content in one step (no gotLength, no write, no seek), read from
    its start; a body Twisted would keep on disk, or one over the limit, goes
    through gotLength as before; each answered as Twisted's calls answer it."""
    lengths: list[int | None] = []
    got_length = site.ProxyRequest.gotLength

    def spy(request: Any, length: int | None) -> None:
        lengths.append(length)
        got_length(request, length)
    monkeypatch.setattr(site.ProxyRequest, "gotLength", spy)
    body = b"x" * size
    data = b"POST /a HTTP/1.1\r\nHost: p\r\nContent-Length: %d\r\n\r\n%b" % (size, body)
    outs = []
    for known in (True, False):        # the fast path, then the reference one
        root = ContentRecorder()
        proxy_site = fast_site(root, max_body) if known else \
            ProxySite(root, max_body, reactor=Clock())
        conn = Connection(proxy_site)
        lengths.clear()
        conn.channel.dataReceived(data)
        outs.append(conn.transport.value())
        if known:
            assert lengths == ([] if one_step else [size])
            if size <= max_body:
                assert root.seen[0][-1] == body
                assert (root.kinds[0] is BytesIO) == (size < 100_000)   # else a temporary file
    assert outs[0] == outs[1]


@pytest.mark.parametrize("version", [b"HTTP/1.1", b"HTTP/1.0"])
@pytest.mark.parametrize("connection", [None, b"close", b"keep-alive", b"Keep-Alive, close"])
@pytest.mark.parametrize("fast", [True, False])
def test_persistence_is_twisteds_answer(version: bytes, connection: bytes | None,
                                        fast: bool) -> None:
    """The channel's answer on keeping the connection (on the fast path, an
    HTTP/1.1 request without a Connection header answered at once) is
    Twisted's, with the same response headers; and while the site closes, no
    request keeps it."""
    _, conn = run(b"", True, fast=fast)
    channel = conn.channel
    answers = []
    for check in (channel.checkPersistence, lambda r, v: HTTPChannel.checkPersistence(
            channel, r, v)):
        request = site.ProxyRequest(channel)
        if connection is not None:
            request.requestHeaders.setRawHeaders(b"Connection", [connection])
        answers.append((bool(check(request, version)),
                        sorted(request.responseHeaders.getAllRawHeaders())))
    assert answers[0] == answers[1]
    channel.site.closing = True
    request = site.ProxyRequest(channel)
    assert channel.checkPersistence(request, version) is False


class Parent(Resource):
    """A root that is not a leaf: its child renders."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Recorder()
        self.putChild(b"a", self.child)


def test_a_leaf_root_is_the_resource_without_a_traversal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's root takes every path: it is the resource, without the
    site's traversal (getResourceFor); a root with children is traversed."""
    traversed: list[bytes] = []
    get_resource_for = ProxySite.getResourceFor

    def spy(self: ProxySite, request: Any) -> Any:
        traversed.append(request.path)
        return get_resource_for(self, request)
    monkeypatch.setattr(ProxySite, "getResourceFor", spy)
    root, conn = run(POST.replace(b"?x=1", b""), True)
    assert traversed == [] and root.seen and conn.transport.value().endswith(b'got {"model":1}')
    parent = Parent()
    conn = Connection(fast_site(parent))
    conn.channel.dataReceived(b"POST /a HTTP/1.1\r\nHost: p\r\nContent-Length: 2\r\n\r\nhi")
    assert traversed == [b"/a"] and parent.child.seen[0][-1] == b"hi"
