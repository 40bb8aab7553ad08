"""A chunked body's framing, held to llhttp's rules on both engine clients:
the fast one parses with httptools (llhttp) itself, the reference one holds
Twisted's decoder to them through web.enginewatch's ChunkWatch. ChunkWatch
refuses exactly the size lines, extensions and trailers llhttp refuses (a
property test against httptools itself); a fault either client finds gives
the body's data before it, then the body's end in ResponseFailed around
BadResponse and an aborted connection, wherever the reads are cut."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import ResponseFailed

from llmproxy.web.enginehead import BadResponse
from llmproxy.web.enginewatch import MAX_SIZE_LINE, ChunkWatch
from tests.test_engine_heads import CLIENTS, URL, Side

CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
# Faults llhttp finds and Twisted's decoder does not (the watch finds them for it).
FAULTS = {
    "space-after-semicolon": b"5; a=b\r\nworld\r\n0\r\n\r\n",
    "empty-extension": b"5;\r\nworld\r\n0\r\n\r\n",
    "semicolon-at-the-end": b"5;a=b;\r\nworld\r\n0\r\n\r\n",
    "unquoted-obs-text": b"5;a=\xff\r\nworld\r\n0\r\n\r\n",
    "over-64-bits": b"10000000000000000\r\nworld\r\n0\r\n\r\n",
    "trailer-without-colon": b"0\r\nNocolon\r\n\r\n",
    "trailer-control": b"0\r\nX-T: a\x01\r\n\r\n",
    "length-trailer": b"0\r\nContent-Length: 0\r\n\r\n",
    "bare-lf-trailer": b"0\r\nX-T: 1\n\r\n",
    "bare-lf-size": b"5\nworld\r\n0\r\n\r\n",
}


class Body(Protocol):
    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.ends: list[Failure] = []

    def dataReceived(self, data: bytes) -> None:
        self.data.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.ends.append(reason)


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_framing_fault_ends_the_body_after_the_data_before_it(client: str, fault: str) -> None:
    """A chunk, then a framing llhttp refuses, in one read or cut in two at any
    byte: the body gets `hello`, then ends with ResponseFailed around
    BadResponse, and the engine connection is aborted."""
    raw = CHUNKED + b"5\r\nhello\r\n" + FAULTS[fault]
    for at in [len(raw), *range(len(CHUNKED), len(raw))]:
        side = Side(client)
        got: list[Any] = []
        side.http.request("POST", URL, data=b"{}").addBoth(got.append)
        engine = side.connect()
        engine.dataReceived(raw[:at])
        [response] = got
        body = Body()
        response.deliverBody(body)
        if at < len(raw):
            engine.dataReceived(raw[at:])
        assert b"".join(body.data) == b"hello", at
        [end] = body.ends
        assert end.check(ResponseFailed), (at, end)
        assert any(reason.check(BadResponse) for reason in end.value.reasons), (at, end)
        assert side.transports[-1].disconnected, at


def test_the_watch_holds_a_line_until_its_end_within_twisteds_bounds() -> None:
    """A size line is looked at once whole (a read may cut it anywhere): the
    watch holds one no longer than Twisted's bound, past it the line is
    refused; after the last chunk's empty line nothing is looked at."""
    watch = ChunkWatch()
    assert watch.feed(b"5;a") == -1 and watch.feed(b"=b\r") == -1
    assert watch.feed(b"\nhel") == -1 and watch.feed(b"lo\r\n0\r\n\r\n") == -1
    assert watch.done and watch.feed(b"\n\0 anything") == -1
    long = ChunkWatch()
    assert long.feed(b"5;" + b"e" * (MAX_SIZE_LINE - 2)) == -1
    assert long.feed(b"e") == 0 and "too long" in long.why


httptools = pytest.importorskip("httptools")


def llhttp_takes(body: bytes) -> bool:
    """Whether llhttp reads `body` (after a chunked head) to its end."""
    ended: list[bool] = []

    class Protocol:
        def on_message_complete(self) -> None:
            ended.append(True)

    parser = httptools.HttpResponseParser(Protocol())
    try:
        parser.feed_data(CHUNKED + body)
    except httptools.HttpParserError:
        return bool(ended)
    return bool(ended)


def watch_takes(body: bytes, cut: int) -> bool:
    watch = ChunkWatch()
    return watch.feed(body[:cut]) < 0 and watch.feed(body[cut:]) < 0 and watch.done


PIECES = st.sampled_from([b"a", b"Z", b"0", b"!", b"=", b";", b'"', b"\\", b" ", b"\t", b"\x01",
                          b"\x7f", b"\xff", b"(", b",", b"\r", b"\n", b"f", b":"])
SIZES = st.sampled_from([b"5", b"05", b"0000000000000000005", b"ffffffffffffffff",
                         b"10000000000000000"])


@settings(max_examples=500, deadline=None)
@given(size=SIZES, extension=st.lists(PIECES, max_size=10).map(b"".join), cut=st.integers(0, 80))
def test_the_watch_takes_the_size_lines_llhttp_takes(size: bytes, extension: bytes,
                                                      cut: int) -> None:
    """Any chunk size and extension: the watch refuses it exactly when llhttp
    does, however a read cuts it."""
    body = size + extension + b"\r\nhello\r\n0\r\n\r\n"
    assert watch_takes(body, cut) == llhttp_takes(body), body


@settings(max_examples=500, deadline=None)
@given(trailers=st.lists(PIECES | st.sampled_from([b"Content-Length", b"X-T", b"\r\n"]),
                         max_size=10).map(b"".join), cut=st.integers(0, 40))
def test_the_watch_takes_the_trailers_llhttp_takes(trailers: bytes, cut: int) -> None:
    """Any trailer lines: the watch refuses them exactly when llhttp does."""
    body = b"5\r\nhello\r\n0\r\n" + trailers + b"\r\n\r\n"
    assert watch_takes(body, cut) == llhttp_takes(body), body
