"""Equivalence of the two paths on the way out (issue 33, point 4): the same
engine response bytes, read by the fast engine client (`select({})`, every
speedup this Twisted allows) and by the reference one (treq, `REFERENCE`),
both chosen here whatever LLMPROXY_SPEEDUPS says, give the client the same
status code, headers and body, end its response the same way (whole, or cut
short) and log the same outcome. Responses framed by Content-Length, chunked
(extensions, trailers, sizes in upper case or with leading zeros) or by the
close, after 1xx answers, cut into reads at any point; and malformed ones: a
body shorter than its length, a close mid-response, garbage after the body, a
bad first chunk size or extension, a missing last chunk, a bad status line or
header, an ambiguous framing (web.enginehead's rules, which both clients
apply; web.enginewatch holds the reference's chunked framing to llhttp's).

What is normalized, and why (everything else is compared as the client read it):

- Bodies are compared de-chunked, not by their framing: both paths frame what
  they relay anew (never the engine's framing), the fast one each read's data
  as one chunk (speedups/relaychunks.py), the reference each piece Twisted's
  decoder hands it (a chunk's data, or part of one).
- The status phrase is not asserted (the engine's phrase is passed on as it
  came, a known defect fixed separately): a difference is reported as a
  `PhraseDiffers` warning.
- The proxy's own 502 `upstream_failed` answer is compared without its message
  (and so its Content-Length, the access line's bytes and its detail's words):
  the message quotes the engine client's exception, treq's words on one path,
  the fast parser's on the other, for the same fault.
- Date dropped, X-Request-Id checked and blanked, the engine's view as in
  test_differential_requests.py.

The known differences are the `KNOWN` cases, each asserting equality under a
strict xfail that names it; the hypothesis strategies do not draw them.

Harness: tests/differential.py, as test_differential_requests.py describes it.
The engine writes its scripted pieces a few reactor turns apart (so the proxy
reads them apart), then closes the connection; the client's request says
`Connection: close`, so the proxy's close ends each exchange.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass

import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.differential import Outcome, Rig, Script, both, cut
from tests.differential_views import Reply, assert_same, replies

pytestmark = pytest.mark.integration


def request(stream: bool = False) -> bytes:
    body = json.dumps({"model": "m", "stream": stream}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


async def relayed(rig: Rig, pieces: list[bytes], stream: bool = False) -> tuple[Outcome, Outcome]:
    """The engine answering with `pieces`, then closing, on both paths."""
    return await both(rig, [request(stream)], Script(pieces, close=True))


def chunks(*datas: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(d), d) for d in datas) + b"0\r\n\r\n"


H = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
CH = H + b"Transfer-Encoding: chunked\r\n\r\n"
OK2 = H + b"Content-Length: 2\r\n\r\nok"
USAGE = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}'
# name: (pieces, the codes the client reads and how the access line ends, on the reference)
CASES: dict[str, tuple[list[bytes], list[int], str]] = {
    "content-length": ([H + b"Content-Length: 5\r\n\r\nhello"], [200], "completed"),
    "content-length, cut in reads": ([H + b"Content-Le", b"ngth: 5\r\n\r\nhe", b"llo"], [200],
                                     "completed"),
    "chunked, cut in reads": ([CH + b"5\r\nhel", b"lo\r\n5\r", b"\nworld\r\n0\r\n", b"\r\n"],
                              [200], "completed"),
    "close-delimited": ([H + b"\r\nhello", b" world"], [200], "completed"),
    "100 then the answer": ([b"HTTP/1.1 100 Continue\r\n\r\n", OK2], [200], "completed"),
    "103 with headers then the answer": (
        [b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK2], [200], "completed"),
    "trailers": ([CH + b"5\r\nhello\r\n0\r\nX-T: 1\r\nX-U: 2\r\n\r\n"], [200], "completed"),
    "chunk extensions": ([CH + b'5;a=b;c="d e"\r\nhello\r\n0;x\r\n\r\n'], [200], "completed"),
    "sizes in upper case, leading zeros": ([CH + b"000A\r\nhelloworld\r\n0\r\n\r\n"], [200],
                                           "completed"),
    "chunk size not hex": ([CH + b"zz\r\nhello\r\n0\r\n\r\n"], [], "upstream-failed"),
    "chunk size negative": ([CH + b"-5\r\nhello\r\n0\r\n\r\n"], [], "upstream-failed"),
    "chunk size 0x": ([CH + b"0x5\r\nhello\r\n0\r\n\r\n"], [], "upstream-failed"),
    "a bad size after a whole chunk": ([CH + b"5\r\nhello\r\nzz\r\n"], [200], "upstream-failed"),
    "body shorter than its length": ([H + b"Content-Length: 10\r\n\r\nhello"], [200],
                                     "upstream-failed"),
    "no last chunk": ([CH + b"5\r\nhello\r\n"], [200], "upstream-failed"),
    "garbage after a length": ([H + b"Content-Length: 5\r\n\r\nhelloGARBAGE"], [200],
                               "completed"),
    "garbage after chunks": ([CH + chunks(b"hello") + b"GARBAGE"], [200], "completed"),
    "a second response after the body": ([OK2 + OK2], [200], "completed"),
    # The framing (web.enginehead: one Transfer-Encoding, `chunked`; one
    # Content-Length of digits, never beside it).
    "two equal lengths": ([H + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello"], [502],
                          "upstream-failed"),
    "two different lengths": ([H + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"],
                              [502], "upstream-failed"),
    "a Content-Length list": ([H + b"Content-Length: 5, 5\r\n\r\nhello"], [502],
                              "upstream-failed"),
    "a Content-Length of 19 digits": ([H + b"Content-Length: 0000000000000000005\r\n\r\nhello"],
                                      [502], "upstream-failed"),
    "length and chunked": ([H + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                            + chunks(b"hello")], [502], "upstream-failed"),
    "an invalid Content-Length beside chunked": (
        [CH.replace(b"\r\n\r\n", b"\r\nContent-Length: x\r\n\r\n") + chunks(b"ok")], [502],
        "upstream-failed"),
    "an invalid Content-Length": ([H + b"Content-Length: 2\r\nContent-Length: x\r\n\r\nok"],
                                  [502], "upstream-failed"),
    "gzip, then chunked": ([H + b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
                            + chunks(b"ok")], [502], "upstream-failed"),
    "chunked, then a second Transfer-Encoding": (
        [CH.replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: gzip\r\n\r\n") + chunks(b"ok")],
        [502], "upstream-failed"),
    "chunked twice": ([CH.replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n")
                       + chunks(b"ok")], [502], "upstream-failed"),
    "a coding list": ([H + b"Transfer-Encoding: gzip, chunked\r\n\r\n" + chunks(b"ok")], [502],
                      "upstream-failed"),
    "transfer-encoding identity": ([H + b"Transfer-Encoding: identity\r\n\r\nhello"], [502],
                                   "upstream-failed"),
    "a control character in a header value": ([H + b"X-A: a\x01b\r\n" + OK2[len(H):]], [502],
                                              "upstream-failed"),
    "HTTP/1.2": ([b"HTTP/1.2 200 OK\r\nContent-Length: 2\r\n\r\nok"], [502], "upstream-failed"),
    "an HTTP/1.0 interim response": ([b"HTTP/1.0 100 Continue\r\n\r\n", OK2], [502],
                                     "upstream-failed"),
    "an interim response that closes": (
        [b"HTTP/1.1 100 Continue\r\nConnection: close\r\n\r\n", OK2], [502], "upstream-failed"),
    # The chunked framing (llhttp's, which web.enginewatch holds the reference to).
    "a chunk size of 16 hex digits": ([CH + b"0000000000000005\r\nhello\r\n0\r\n\r\n"], [200],
                                      "completed"),
    "a chunk size over 64 bits": ([CH + b"10000000000000000\r\nhello\r\n0\r\n\r\n"], [],
                                  "upstream-failed"),
    "a chunk size with a trailing space": ([CH + b"5 \r\nhello\r\n0\r\n\r\n"], [],
                                           "upstream-failed"),
    "whitespace before a chunk extension": ([CH + b"5 ;a=b\r\nhello\r\n0\r\n\r\n"], [],
                                            "upstream-failed"),
    "whitespace after a chunk extension's `;`": ([CH + b"5; a=b\r\nhello\r\n0\r\n\r\n"], [],
                                                 "upstream-failed"),
    "an empty chunk extension": ([CH + b"5;\r\nhello\r\n0\r\n\r\n"], [], "upstream-failed"),
    "a chunk extension with a control character": ([CH + b'5;a="\x01"\r\nhello\r\n0\r\n\r\n'],
                                                   [], "upstream-failed"),
    "a chunk extension's unquoted obs-text": ([CH + b"5;a=\xff\r\nhello\r\n0\r\n\r\n"], [],
                                              "upstream-failed"),
    "data before a framing error, in its read": ([CH + b"3\r\nhello\r\n0\r\n\r\n"], [200],
                                                 "upstream-failed"),
    "data before a bad size, in its read": ([CH + b"5\r\nhel", b"lo\r\nzz\r\n"], [200],
                                            "upstream-failed"),
    "data before a bad extension, in its read": (
        [CH + b"5\r\nhello\r\n5; a\r\nworld\r\n0\r\n\r\n"], [200], "upstream-failed"),
    "a trailer without a colon": ([CH + b"5\r\nhello\r\n0\r\nNocolon\r\n\r\n"], [200],
                                  "upstream-failed"),
    "a Content-Length trailer": ([CH + b"5\r\nhello\r\n0\r\nContent-Length: 5\r\n\r\n"], [200],
                                 "upstream-failed"),
    "a bare LF in the trailers": ([CH + b"5\r\nhello\r\n0\r\nX-T: 1\n\r\n"], [200],
                                  "upstream-failed"),
    "trailers over 64 KiB": ([CH + b"5\r\nhello\r\n0\r\nX-T: " + b"t" * 70000 + b"\r\n\r\n"],
                             [200], "upstream-failed"),
    "http/1.0, close-delimited": ([b"HTTP/1.0 200 OK\r\n\r\nhello"], [200], "completed"),
    "204 with a body": ([b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello"], [204],
                        "completed"),
    "an engine 500": ([b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops"],
                      [500], "completed"),
    "a bad status line": ([b"HTTP/1.1 abc OK\r\nContent-Length: 2\r\n\r\nok"], [502],
                          "upstream-failed"),
    "not http": ([b"SSH-2.0-OpenSSH\r\n\r\n"], [502], "upstream-failed"),
    "bare LF": ([b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok"], [502], "upstream-failed"),
    "a folded header": ([H + b"X-A: one\r\n two\r\nContent-Length: 2\r\n\r\nok"], [502],
                        "upstream-failed"),
    "a header without a colon": ([H + b"Nocolon\r\nContent-Length: 2\r\n\r\nok"], [502],
                                 "upstream-failed"),
    "a NUL in a header": ([H + b"X-A: a\x00b\r\nContent-Length: 2\r\n\r\nok"], [502],
                          "upstream-failed"),
    "headers over 64 KiB": ([H + b"X-Big: " + b"a" * 70000 + b"\r\n\r\n"], [502],
                            "upstream-failed"),
    "closed before a byte": ([], [502], "upstream-failed"),
    "closed mid-head": ([b"HTTP/1.1 200 OK\r\nContent-Le"], [502], "upstream-failed"),
    "hop-by-hop headers": ([H + b"Connection: close, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5"
                            b"\r\nSet-Cookie: a=1\r\nContent-Encoding: \r\nContent-Length: 2"
                            b"\r\n\r\nok"], [200], "completed"),
    "usage at the end": ([H + b"Content-Length: %d\r\n\r\n%s" % (len(USAGE), USAGE)], [200],
                         "completed"),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest_twisted.ensureDeferred
async def test_each_known_response_reaches_the_client_alike(rig: Rig, name: str) -> None:
    """Each case above: on the reference path the client reads the codes the
    table says and the access line ends as it says; the fast client gives the
    client and the access log the same."""
    pieces, codes, outcome = CASES[name]
    reference, fast = await relayed(rig, pieces)
    assert [r.code for r in replies(reference.received)] == codes
    assert [e.outcome for e in reference.ended] == [outcome]
    assert_same(reference, fast)


GZIP = gzip.compress(b'{"a": 1}')
KNOWN = {
    "a quoted-pair in a chunk extension": (
        [CH + b'5;a="b\\"c"\r\nhello\r\n0\r\n\r\n'],
        "llhttp takes a quoted-pair (RFC 9112 7.1.1) in a chunk extension's value; Twisted's "
        "decoder refuses any backslash in an extension, so the reference cuts the response "
        "(the reference can be made stricter, not laxer)"),
    "a chunk size line over 1024 bytes": (
        [CH + b"5;" + b"e" * 1100 + b"\r\nhello\r\n0\r\n\r\n"],
        "Twisted refuses a chunk size line of 1024 bytes or more; llhttp reads one of any "
        "length and keeps none of it (httptools has no extension callback to count it by): "
        "the fast client bounds only a run of MAX_FRAMING bytes of framing without data"),
}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=why))
    for name, (_, why) in KNOWN.items()])
@pytest_twisted.ensureDeferred
async def test_known_differences(rig: Rig, name: str) -> None:
    """The differences found between the paths, each a minimal reproduction:
    equality is asserted, and each fails (strict xfail) until llmproxy is
    fixed; the day one passes, its xfail has to go."""
    reference, fast = await relayed(rig, KNOWN[name][0])
    assert_same(reference, fast)


def header(reply: Reply, name: bytes) -> list[bytes]:
    return [v for n, v in reply.headers if n.lower() == name]


# 64 KiB of gzip that inflates to 64 MiB: what treq's decoder would hand on at once.
BOMB = gzip.compress(b"\0" * (64 << 20), compresslevel=9)


@pytest.mark.parametrize("name", ["gzip", "a gzip bomb"])
@pytest_twisted.ensureDeferred
async def test_a_gzip_answer_passes_undecoded_on_both_paths(rig: Rig, name: str) -> None:
    """No content decoding on either path (web/treqlayers.py under treq's
    ContentDecoderAgent): an engine that answers gzip although it was asked for
    identity has its bytes relayed as it sent them, with their Content-Encoding
    and length, whole; a gzip bomb costs the proxy its compressed size, never
    the 64 MiB it inflates to."""
    body = GZIP if name == "gzip" else BOMB
    head = H + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body)
    reference, fast = await relayed(rig, [head + body])
    for out in (reference, fast):
        [passed] = replies(out.received)
        assert (passed.code, passed.body == body, passed.complete) == (200, True, True)
        assert header(passed, b"content-encoding") == [b"gzip"]
        assert header(passed, b"content-length") == [b"%d" % len(body)]
    assert [e.outcome for e in reference.ended] == [e.outcome for e in fast.ended] == ["completed"]
    assert_same(reference, fast)


@pytest_twisted.ensureDeferred
async def test_the_proxys_own_headers_stand_on_both_paths(rig: Rig) -> None:
    """An engine that answers with X-Request-Id, Retry-After, x-ratelimit-* and
    X-LLMProxy-* headers changes none of the proxy's: the client reads the
    proxy's request id and none of the others, alike on both paths."""
    head = (H + b"X-Request-Id: engine-7\r\nRetry-After: 99999\r\n"
            b"x-ratelimit-remaining-requests: 1000000\r\nX-LLMProxy-Model: other\r\n"
            b"X-Kept: 1\r\n")
    reference, fast = await relayed(rig, [head + b"Content-Length: 2\r\n\r\nok"])
    for out in (reference, fast):
        [reply] = replies(out.received)
        names = [name.lower() for name, _ in reply.headers]
        assert b"retry-after" not in names and b"x-llmproxy-model" not in names
        assert b"x-ratelimit-remaining-requests" not in names
        assert header(reply, b"x-kept") == [b"1"]
        [request_id] = header(reply, b"x-request-id")
        assert request_id != b"engine-7"
    assert_same(reference, fast)


STATUS_LINES = st.sampled_from([
    b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", b"HTTP/1.1 201 Created", b"HTTP/1.1 200",
    b"HTTP/1.1 404 Not Found", b"HTTP/1.1 500 Internal Server Error", b"HTTP/1.1 503 Busy Now",
    b"HTTP/1.0 200 OK", b"HTTP/1.1 299 Odd"])
HEADERS = st.lists(st.sampled_from([
    b"Content-Type: application/json", b"Content-Type: text/event-stream", b"X-A: b",
    b"Set-Cookie: a=1", b"Connection: keep-alive", b"Connection: close", b"Keep-Alive: timeout=5",
    b"Server: llama.cpp", b"X-Dup: 1", b"X-Dup: 2", b"x-lower: v", b"X-Space:  v  ",
    b"Access-Control-Allow-Origin: *"]), max_size=4)
INTERIM = st.lists(st.sampled_from([b"HTTP/1.1 100 Continue\r\n\r\n",
                                    b"HTTP/1.1 102 Processing\r\n\r\n",
                                    b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"]),
                   max_size=2)
EVENTS = st.lists(st.sampled_from([
    b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n', b": ping\n\n",
    b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\n',
    b"data: [DONE]\n\n"]), min_size=1, max_size=5).map(b"".join)
SIZE_FORMS = st.sampled_from([b"%x", b"%x", b"%X", b"00%x", b"%x;a=b", b'%x;e="q s"'])
TRAILERS = st.sampled_from([b"", b"", b"X-T: 1\r\n", b"X-T: 1\r\nX-U: 2\r\n"])


@st.composite
def chunked_body(draw: st.DrawFn, body: bytes) -> tuple[bytes, bytes]:
    """`body` in chunks of drawn sizes, each size line in a drawn (valid)
    form; and the last chunk, with or without trailers."""
    out, at = [], 0
    while at < len(body):
        size = min(draw(st.integers(1, 120)), len(body) - at)
        form = draw(SIZE_FORMS)
        line = form.replace(b"%x", b"%x" % size).replace(b"%X", b"%X" % size)
        out.append(b"%s\r\n%s\r\n" % (line, body[at:at + size]))
        at += size
    last = draw(st.sampled_from([b"0", b"0", b"000", b"0;x=y"]))
    return b"".join(out), last + b"\r\n" + draw(TRAILERS) + b"\r\n"


@dataclass
class Response:
    """A well-formed engine response, in its parts: 1xx answers, the head (its
    status line first), the body's framing (`chunks`, then `end`: the last
    chunk and trailers) and the body it carries."""

    interim: bytes
    head: bytes
    chunks: bytes
    end: bytes
    body: bytes
    framing: str

    @property
    def data(self) -> bytes:
        return self.interim + self.head + b"\r\n" + self.chunks + self.end

    @property
    def code(self) -> int:
        return int(self.head[9:12])


@st.composite
def responses(draw: st.DrawFn) -> Response:
    head = draw(STATUS_LINES) + b"\r\n" + b"".join(h + b"\r\n" for h in draw(HEADERS))
    body = draw(st.one_of(st.binary(max_size=300), EVENTS))
    framing = draw(st.sampled_from(["length", "chunked", "chunked", "close"]))
    chunks, end = body, b""
    if framing == "length":
        head += b"Content-Length: %d\r\n" % len(body)
    elif framing == "chunked":
        chunks, end = draw(chunked_body(body))
        head += b"Transfer-Encoding: chunked\r\n"
    return Response(b"".join(draw(INTERIM)), head, chunks, end, body, framing)


CUTS = st.lists(st.floats(0, 1, exclude_max=True), max_size=5)
SETTINGS = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(response=responses(), cuts=CUTS, stream=st.booleans())
@pytest_twisted.ensureDeferred
async def test_well_formed_responses_reach_the_client_alike(
        rig: Rig, response: Response, cuts: list[float], stream: bool) -> None:
    """A well-formed response cut into reads anywhere: on the reference path
    the client reads the engine's code and its whole body and the access line
    says completed; the fast client gives the client and the log the same."""
    reference, fast = await relayed(rig, cut(response.data, cuts), stream)
    [reply] = replies(reference.received)
    assert (reply.code, reply.body, reply.complete) == (response.code, response.body, True)
    assert [e.outcome for e in reference.ended] == ["completed"]
    assert_same(reference, fast)


BAD_SIZES = st.sampled_from([b"zz", b"-5", b"0x5", b"", b"+1", b"g"])
BAD_STATUS = st.sampled_from([b"HTTP/1.1 abc OK", b"SSH-2.0-x", b"HTTP/2 200", b"HTTP/1.1 99 X",
                              b"HTTP/1.1 2000 OK", b"ICY 200 OK"])
BAD_HEADERS = st.sampled_from([b"X A: b", b"Nocolon", b"X-A : b", b" folded", b"X-A: a\x00b",
                               b"X-A: a\x7fb", b"Content-Length: 1, 1", b"Transfer-Encoding: gzip"])
BAD_EXTENSIONS = st.sampled_from([b" ;a", b"; a", b";", b";a=b;", b';a="\x01"', b";a=\xff",
                                  b";a==b", b";a=(b)"])


@st.composite
def malformed(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A response spoilt one way: (its bytes, whether the reference must see
    it fail). Cut short anywhere, garbage after it, a body shorter than its
    length, a bad first chunk size or extension, no last chunk, a bad status
    line or header (an ambiguous framing among them)."""
    r = draw(responses())
    defect = draw(st.sampled_from(["cut", "garbage", "short", "size", "extension", "no end",
                                   "status", "header"]))
    if defect == "short" and r.framing == "length" and r.body:
        return r.data[:-draw(st.integers(1, len(r.body)))], True
    if defect == "size" and r.framing == "chunked":
        payload = r.chunks + r.end
        bad = draw(BAD_SIZES) + payload[payload.index(b"\r\n"):]
        return r.interim + r.head + b"\r\n" + bad, True
    if defect == "extension" and r.framing == "chunked" and r.chunks:
        line, rest = r.chunks.split(b"\r\n", 1)
        bad = line.split(b";")[0] + draw(BAD_EXTENSIONS) + b"\r\n" + rest
        return r.interim + r.head + b"\r\n" + bad + r.end, True
    if defect == "no end" and r.framing == "chunked":
        return r.interim + r.head + b"\r\n" + r.chunks, True
    if defect == "status":
        head = draw(BAD_STATUS) + r.head[r.head.index(b"\r\n"):]
        return r.interim + head + b"\r\n" + r.chunks + r.end, True
    if defect == "header":
        return r.interim + r.head + draw(BAD_HEADERS) + b"\r\n\r\n" + r.chunks + r.end, True
    if defect == "garbage":
        return r.data + draw(st.sampled_from([b"GARBAGE", OK2, b"\r\n", b"0\r\n\r\n"])), False
    return r.data[:draw(st.integers(0, len(r.data)))], False


@SETTINGS
@given(response=malformed(), cuts=CUTS, stream=st.booleans())
@pytest_twisted.ensureDeferred
async def test_malformed_responses_end_alike(rig: Rig, response: tuple[bytes, bool],
                                             cuts: list[float], stream: bool) -> None:
    """A malformed response cut into reads anywhere: the fast client gives the
    client the same bytes (the same status, the same body cut at the same
    point, or none) and the log the same outcome as the reference, which logs
    the failure of every response that cannot be read whole."""
    data, fails = response
    reference, fast = await relayed(rig, cut(data, cuts), stream)
    if fails:
        assert [e.outcome for e in reference.ended] == ["upstream-failed"]
    assert_same(reference, fast)
