"""One HTTP/1.1 connection to an engine (speedups/engineconnection: httptools
behind web.enginehead's HeadWatch), on a StringTransport: the request's bytes,
every response framing split at every byte, each read's data handed on in one
piece, the malformed responses it refuses, and how a connection ends, is
reused or is closed."""

from __future__ import annotations

import gc
import itertools
import socket
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from twisted.internet import main
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionAborted, ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IConsumer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IBodyProducer
from zope.interface import implementer

from llmproxy.speedups.engineconnection import H1Connection
from llmproxy.speedups.enginemessage import MAX_FRAMING, UpstreamResponse, _BodyTransport
from llmproxy.web.enginehead import MAX_HEAD, BadResponse

LENGTH_BODY = b"{\"a\": \"b\"}\n"
LENGTH = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"
          + LENGTH_BODY)
CHUNKED = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
           b"Content-Type: text/event-stream\r\n\r\n"
           b"5\r\nhello\r\n1;ext=1\r\n \r\n4\r\n\r\n\r\n\r\n"
           b"A;name=\"v\"\r\n0123456789\r\n0\r\nX-Trailer: t\r\nY: z\r\n\r\n")
CHUNKED_BODY = b"hello \r\n\r\n0123456789"


class Body(Protocol):
    """A body protocol that records what it is given and how the body ended."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.reasons: list[Failure] = []

    def dataReceived(self, data: bytes) -> None:
        assert not self.reasons, "data after the end of the body"
        self.data.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.reasons.append(reason)

    def end(self) -> Failure:
        [reason] = self.reasons
        return reason


def inner(failure: Failure) -> Failure:
    """The one reason inside a ResponseFailed or ResponseNeverReceived."""
    assert isinstance(failure.value, ResponseFailed | ResponseNeverReceived)
    [reason] = failure.value.reasons
    assert isinstance(reason, Failure)
    return reason


class Exchange:
    """A connection on a StringTransport, its request, and what came back."""

    def __init__(self, deliver: bool = True) -> None:
        self.idle: list[H1Connection] = []
        self.lost: list[H1Connection] = []
        self.conn = H1Connection(self.idle.append, self.lost.append)
        self.transport = StringTransport()
        self.conn.makeConnection(self.transport)
        self.deliver, self.body = deliver, Body()
        self.responses: list[UpstreamResponse] = []
        self.failures: list[Failure] = []

    def request(self, body: bytes | IBodyProducer | None = None) -> Deferred[UpstreamResponse]:
        d = self.conn.request(b"POST", b"/v1/x", b"h", Headers(), body)
        d.addCallbacks(self._got, self.failures.append)
        return d

    def _got(self, response: UpstreamResponse) -> UpstreamResponse:
        self.responses.append(response)
        if self.deliver:
            response.deliverBody(self.body)
        return response

    def feed(self, *parts: bytes) -> Exchange:
        for part in parts:
            self.conn.dataReceived(part)
        return self

    @property
    def received(self) -> bytes:
        return b"".join(self.body.data)

    def assert_reused(self, body: bytes, why: object = "") -> None:
        """The body whole, ended with ResponseDone, and the connection idle again."""
        assert self.received == body and self.body.end().check(ResponseDone), why
        assert self.idle == [self.conn] and self.conn.state == "QUIESCENT", why
        assert self.conn.usable() and not self.transport.disconnecting, why

    def assert_closed(self, body: bytes) -> None:
        """The body whole and ResponseDone, and the connection closed, not reused."""
        assert self.received == body and self.body.end().check(ResponseDone)
        assert self.idle == [] and not self.conn.usable()
        assert self.transport.disconnecting and not self.transport.disconnected

    def never_received(self) -> Failure:
        """The request failed without a response: the reason inside."""
        [failure] = self.failures
        assert self.responses == [] and failure.check(ResponseNeverReceived)
        return inner(failure)


def exchange(*parts: bytes) -> Exchange:
    ex = Exchange()
    ex.request()
    return ex.feed(*parts)


def registered(transport: StringTransport) -> object:
    return transport.producer


@implementer(IBodyProducer)
class Producer:
    """A request body the test writes through its consumer, then ends."""

    def __init__(self, length: Any) -> None:
        self.length, self.stopped = length, False
        self.consumer: IConsumer | None = None
        self.done: Deferred[None] = Deferred()

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        self.consumer = consumer
        return self.done

    def pauseProducing(self) -> None: ...

    def resumeProducing(self) -> None: ...

    def stopProducing(self) -> None:
        self.stopped = True


def test_producer_bodies_chunked_or_by_length() -> None:
    """UNKNOWN_LENGTH: chunked, a chunk per write (none for b""), the last chunk
    when its Deferred fires; a length: Content-Length, the bytes as they are."""
    ex, producer = Exchange(), Producer(UNKNOWN_LENGTH)
    ex.request(producer)
    assert ex.transport.value() == (b"POST /v1/x HTTP/1.1\r\nHost: h\r\n"
                                    b"Transfer-Encoding: chunked\r\n\r\n")
    assert registered(ex.transport) is producer and producer.consumer is not None
    ex.transport.clear()
    for data in (b"hello world!", b"", b"x"):
        producer.consumer.write(data)
    assert ex.transport.value() == b"c\r\nhello world!\r\n1\r\nx\r\n"
    producer.done.callback(None)
    assert ex.transport.value().endswith(b"\r\n1\r\nx\r\n0\r\n\r\n")
    assert registered(ex.transport) is None
    ex.feed(LENGTH).assert_reused(LENGTH_BODY)
    ex, producer = Exchange(), Producer(5)
    ex.request(producer)
    assert producer.consumer is not None
    producer.consumer.write(b"abcde")
    producer.done.callback(None)
    assert ex.transport.value() == (b"POST /v1/x HTTP/1.1\r\nHost: h\r\n"
                                    b"Content-Length: 5\r\n\r\nabcde")
    assert registered(ex.transport) is None


def test_content_length_response_split_at_every_byte() -> None:
    """Whole or cut in two at any byte: the exact body, ResponseDone, on_idle
    once, the connection idle and usable; connection headers kept out."""
    ex = exchange(LENGTH)
    ex.assert_reused(LENGTH_BODY)
    [response] = ex.responses
    assert (response.code, response.phrase, response.length) == (200, b"OK", 11)
    assert response.headers.getRawHeaders(b"content-type") == [b"application/json"]
    assert not response.headers.hasHeader(b"content-length")
    for at in range(1, len(LENGTH)):
        exchange(LENGTH[:at], LENGTH[at:]).assert_reused(LENGTH_BODY, at)


def test_header_names_are_canonical_and_the_connection_header_stays() -> None:
    """Header names come out canonical, repeated ones in order; the Connection
    header stays among them (the relay drops it and what it names), Keep-Alive
    and the framing headers do not."""
    ex = exchange(b"HTTP/1.1 200 OK\r\nx-ONE: a\r\nconnection: x-one, Keep-Alive\r\n"
                  b"Keep-Alive: timeout=5\r\nx-one: d\r\nContent-Length: 0\r\n\r\n")
    [response] = ex.responses
    assert dict(response.headers.getAllRawHeaders()) == {
        b"X-One": [b"a", b"d"], b"Connection": [b"x-one, Keep-Alive"]}
    assert ex.conn.keep_alive == 5.0


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\nSet-Cookie: evil\r\nContent-Length: 0",
    b"HTTP/1.1 200 OK\r\nX-One: a\nSet-Cookie: evil\r\nContent-Length: 0",
    b"HTTP/1.1 200 OK\rSet-Cookie: evil\r\nContent-Length: 0",
    b"HTTP/1.1 200 OK\r\nX-Two: b\rSet-Cookie: evil\r\nContent-Length: 0",
    b"HTTP/1.1 200 OK\r\nX-Two: b\x00c\r\nContent-Length: 0",
    b"HTTP/1.1 200 O\x00K\r\nContent-Length: 0",
], ids=["lf-status", "lf-value", "cr-status", "cr-value", "nul-value", "nul-phrase"])
def test_a_bare_lf_a_lone_cr_or_a_nul_in_the_head_is_refused_at_every_split(
        head: bytes) -> None:
    """Where Twisted's Headers would make a lone CR or LF a space (and keep a
    NUL), the engine connection refuses the head: ResponseNeverReceived around
    BadResponse, wherever the bytes are cut; with no end of head in sight too
    (an engine that never sends CRLFCRLF is not waited for)."""
    raw = head + b"\r\n\r\n"
    for parts in [(raw,), (head,)] + [(raw[:at], raw[at:]) for at in range(1, len(raw))]:
        ex = exchange(*parts)
        assert ex.never_received().check(BadResponse), parts
        assert ex.transport.disconnected


def test_chunked_response_split_at_every_byte_and_byte_by_byte() -> None:
    """Chunk extensions, CRLFs inside chunk data, uppercase hex, trailers: the
    exact body, ResponseDone, on_idle, however the bytes arrive."""
    ex = exchange(CHUNKED)
    ex.assert_reused(CHUNKED_BODY)
    [response] = ex.responses
    assert response.length is UNKNOWN_LENGTH
    assert not response.headers.hasHeader(b"transfer-encoding")
    assert not response.headers.hasHeader(b"x-trailer")
    for at in range(1, len(CHUNKED)):
        exchange(CHUNKED[:at], CHUNKED[at:]).assert_reused(CHUNKED_BODY, at)
    exchange(*(CHUNKED[i:i + 1] for i in range(len(CHUNKED)))).assert_reused(CHUNKED_BODY)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT = b"data: {}\n\n" * 2 + b"data: [" + b"x" * 17 + b"]\n\n"     # 47 bytes: 2f


@pytest.mark.parametrize("size_line", [b"2f", b"2F", b"002f", b"2f;ext=1", b"2F;x", b'2f;e="q s"'])
def test_a_read_of_one_whole_chunk_goes_to_the_body_as_it_is(size_line: bytes) -> None:
    """An engine writes each event as one chunk, read alone: its data goes to the
    body in that read, whatever the (valid) spelling of its size line; the next
    reads and the end are read as before."""
    ex = exchange(STREAM_HEAD)
    ex.feed(size_line + b"\r\n" + EVENT + b"\r\n")
    assert ex.body.data == [EVENT]
    ex.feed(b"2f\r\n" + EVENT + b"\r\n", b"0\r\n\r\n")
    ex.assert_reused(EVENT * 2)


RUN = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in (EVENT, b"data: 2\n\n", EVENT))
RUN_DATA = EVENT + b"data: 2\n\n" + EVENT


def test_the_data_of_a_read_goes_on_in_one_piece() -> None:
    """Several chunks in one read (the head's included), whole or cut, with
    extensions or not: their data goes to the body in one piece per read, in
    order, decoded (the engine's framing never goes on)."""
    ex = exchange(STREAM_HEAD + RUN + b"5;x\r\nhello\r\n3\r\nab", b"c\r\n" + RUN,
                  RUN + b"0\r\n\r\n")
    assert ex.body.data == [RUN_DATA + b"helloab", b"c" + RUN_DATA, RUN_DATA]
    assert ex.body.end().check(ResponseDone) and ex.idle == [ex.conn]


def test_data_before_deliverBody_is_held_and_given_in_order() -> None:
    """Data that came with the head, before anyone took the body: held, given
    to the protocol in order when it comes, then its end."""
    ex = Exchange(deliver=False)
    ex.request()
    ex.feed(STREAM_HEAD + RUN, b"0\r\n\r\n")
    [response] = ex.responses
    response.deliverBody(ex.body)
    assert ex.body.data == [RUN_DATA] and ex.body.end().check(ResponseDone)


def test_a_stream_split_anywhere_reaches_the_body_whole_and_in_order() -> None:
    """Whole chunks, extensions, a trailer: however the reads cut the body, the
    body protocol gets exactly the body's data, in order, one piece per read
    that carried data, and the connection is reused."""
    raw = STREAM_HEAD + RUN + b"2;e=1\r\nok\r\n" + RUN + b"0\r\nX-T: 1\r\n\r\n"
    data = RUN_DATA + b"ok" + RUN_DATA
    for cuts in [(at,) for at in range(1, len(raw))] + [tuple(range(1, len(raw)))]:
        ex = Exchange()
        ex.request()
        bounds = (0, *cuts, len(raw))
        ex.feed(*(raw[a:b] for a, b in itertools.pairwise(bounds)))
        assert ex.received == data and all(ex.body.data), cuts
        assert ex.body.end().check(ResponseDone) and ex.idle == [ex.conn]


@pytest.mark.parametrize("size_line", [b"2e", b"30", b"0x2f", b"+2f", b"2_f", b"-2f"])
def test_a_read_whose_size_line_does_not_match_its_chunk_is_not_taken_whole(
        size_line: bytes) -> None:
    """A size line that says another size, or is not hex, fails the body."""
    ex = exchange(STREAM_HEAD, size_line + b"\r\n" + EVENT + b"\r\n", b"0\r\n\r\n")
    assert ex.body.end().check(ResponseFailed)
    assert ex.transport.disconnecting and ex.idle == []


@pytest.mark.parametrize(("response", "body"), [
    (LENGTH, LENGTH_BODY), (CHUNKED, CHUNKED_BODY),
    (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b""),
], ids=["length", "chunked", "204", "length-0"])
def test_bytes_after_the_body_close_the_connection(response: bytes, body: bytes) -> None:
    """More bytes than the response (even an empty body) in the same read: the
    body is exact, but the connection is not clean: closed, never reused."""
    exchange(response + b"HTTP/1.1 200 OK\r\n").assert_closed(body)


def test_until_close_body_ends_with_potential_data_loss() -> None:
    """No length, not chunked: the body runs until the connection closes and
    ends with PotentialDataLoss; the connection is never offered for reuse."""
    ex = exchange(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nabc", b"def")
    assert ex.responses[0].length is UNKNOWN_LENGTH and ex.received == b"abcdef"
    assert ex.body.reasons == [] and not ex.conn.usable()
    ex.conn.connectionLost(Failure(ConnectionDone()))
    assert ex.body.end().check(PotentialDataLoss) and ex.received == b"abcdef"
    assert ex.idle == [] and ex.lost == [] and ex.conn.lost.called


@pytest.mark.parametrize("response", [
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, Close\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
], ids=["close", "close-listed", "http10", "http10-chunked"])
def test_connection_close_and_http10_close_after_the_body(response: bytes) -> None:
    """The engine will not keep the connection: closed (gracefully) after the
    body, on_idle not called, and its loss is not an idle loss."""
    ex = exchange(response)
    ex.assert_closed(b"ok")
    ex.conn.connectionLost(Failure(ConnectionDone()))
    assert ex.lost == [] and len(ex.body.reasons) == 1


def test_100_continue_is_skipped_at_every_split_and_204_304_have_no_body() -> None:
    """An interim 100 Continue is passed over wherever the bytes are cut; the
    request fires once, with the real response. 204 and 304: no body at all."""
    raw = b"HTTP/1.1 100 Continue\r\nX-Interim: 1\r\n\r\n" + LENGTH
    for parts in [(raw,)] + [(raw[:at], raw[at:]) for at in range(1, len(raw))]:
        ex = exchange(*parts)
        ex.assert_reused(LENGTH_BODY, parts)
        [response] = ex.responses
        assert response.code == 200 and not response.headers.hasHeader(b"x-interim")
    for code in (204, 304):
        ex = exchange(b"HTTP/1.1 %d X\r\nContent-Length: 50\r\n\r\n" % code)
        ex.assert_reused(b"")
        assert ex.responses[0].length == 0


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
], ids=["length", "chunked", "close", "interim"])
def test_a_head_requests_answer_has_no_body_and_closes_its_connection(head: bytes) -> None:
    """The answer to a HEAD request has no body, whatever its head says: the
    response (length 0) ends at its head with ResponseDone. The parser cannot
    be told so, so the connection is closed after it, never reused."""
    ex = Exchange()
    d = ex.conn.request(b"HEAD", b"/v1/x", b"h", Headers(), None)
    d.addCallbacks(ex._got, ex.failures.append)
    assert ex.transport.value().startswith(b"HEAD /v1/x HTTP/1.1\r\n")
    ex.feed(head)
    [response] = ex.responses
    assert response.length == 0
    ex.assert_closed(b"")


@pytest.mark.parametrize("head", [
    b"HTTX/1.1 200 OK", b"HTTP/1.1 2000 OK", b"HTTP/1.1 OK", b"HTTP/2 200 OK", b"",
    b"HTTP/1.1 200 OK\r\nNoColon", b"HTTP/1.1 200 OK\r\n Folded: x",
    b"HTTP/1.1 200 OK\r\nName : v", b"HTTP/1.1 200 OK\r\n: v",
    b"HTTP/1.1 200 OK\r\nBad(Name): v", b"HTTP/1.1 200 OK\r\nX\x00Y: v",
    b"HTTP/1.1 200 OK\r\nContent-Length: abc", b"HTTP/1.1 200 OK\r\nContent-Length: -1",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked",
])
def test_malformed_head_fails_the_request_and_aborts(head: bytes) -> None:
    """A status line or header the proxy cannot read: ResponseNeverReceived
    around BadResponse, the connection aborted; its later loss changes nothing."""
    ex = exchange(head + b"\r\n\r\nbody")
    assert ex.never_received().check(BadResponse)
    assert ex.transport.disconnected and not ex.conn.usable()
    ex.conn.connectionLost(Failure(ConnectionAborted()))
    assert len(ex.failures) == 1 and ex.idle == [] and ex.lost == []


@pytest.mark.parametrize("parts", [
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD,),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (MAX_HEAD // 2), b"a" * (MAX_HEAD // 2)),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD + b"\r\n\r\n",),
], ids=["no-end", "no-end-two-reads", "with-end"])
def test_headers_over_max_head_are_refused(parts: tuple[bytes, ...]) -> None:
    """A head over MAX_HEAD bytes is refused, however it arrives."""
    ex = exchange(*parts)
    assert ex.never_received().check(BadResponse) and ex.transport.disconnected


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n"


@pytest.mark.parametrize("tail", [
    b"zz\r\n", b"0x10\r\n", b"1_0\r\n", b"+5\r\n", b"-1\r\n", b"\r\n", b" \r\n",
    b"3\r\nabcd\r\n", b"3\r\nabc\n\r\n", b"1" * 17 + b"\r\n", b"3 \r\n", b"3 ;a\r\n",
    b'3;a="\x01"\r\n', b"3;\r\n", b"0\r\nNo colon\r\n\r\n", b"0\r\nContent-Length: 0\r\n\r\n",
], ids=["zz", "0x10", "1_0", "+5", "-1", "empty", "space", "longer", "lf", "over-64-bits",
        "trailing-space", "space-before-ext", "ext-control", "ext-empty", "bad-trailer",
        "length-trailer"])
def test_malformed_chunked_body_ends_with_response_failed(tail: bytes) -> None:
    """Good headers, bad chunked body (in one read or byte by byte): at most the
    good bytes, then ResponseFailed around BadResponse; connection aborted."""
    for parts in ((CHUNKED_HEAD + tail,), tuple(bytes([b]) for b in CHUNKED_HEAD + tail)):
        ex = exchange(*parts)
        assert b"okabc".startswith(ex.received)
        assert ex.body.end().check(ResponseFailed) and inner(ex.body.end()).check(BadResponse)
        assert ex.transport.disconnected and ex.idle == []


@pytest.mark.parametrize("start", [b"1;", b"0\r\nX-T: "], ids=["extension", "trailer"])
def test_framing_without_data_is_bounded(start: bytes) -> None:
    """A chunk extension or a trailer that never ends (llhttp bounds neither,
    and httptools holds a trailer whole): once the reads after the last data
    have brought MAX_FRAMING bytes of framing, the body ends with
    ResponseFailed around BadResponse and the connection is aborted; up to
    then it is read on."""
    ex = exchange(CHUNKED_HEAD)
    run = start + b"a" * (MAX_FRAMING - len(start))
    for at in range(0, len(run), 4096):
        ex.feed(run[at:at + 4096])
        assert not ex.body.reasons
    ex.feed(b"a")
    assert ex.received == b"ok" and inner(ex.body.end()).check(BadResponse)
    assert ex.transport.disconnected and ex.idle == []


@pytest.mark.parametrize(("cut", "received"), [
    (CHUNKED[:CHUNKED.index(b"0123") + 4], b"hello \r\n\r\n0123"),
    (CHUNKED[:-5], CHUNKED_BODY),
    (LENGTH[:-3], b"{\"a\": \"b"),
], ids=["chunked", "chunked-trailer", "length"])
def test_connection_lost_mid_body_ends_with_response_failed(cut: bytes, received: bytes) -> None:
    """Lost in a body that has an end: the bytes so far, then ResponseFailed
    with the loss inside."""
    ex = exchange(cut)
    ex.conn.connectionLost(Failure(ConnectionLost()))
    assert ex.received == received and ex.lost == [] and ex.idle == []
    assert ex.body.end().check(ResponseFailed) and inner(ex.body.end()).check(ConnectionLost)


def test_body_before_deliver_body_is_kept_in_order() -> None:
    """Bytes that came before deliverBody are given to it in order, then the
    rest as it comes; an end before deliverBody is delivered too."""
    ex = Exchange(deliver=False)
    ex.request()
    ex.feed(CHUNKED[:-40], CHUNKED[-40:-25])
    ex.responses[0].deliverBody(ex.body)
    ex.feed(CHUNKED[-25:]).assert_reused(CHUNKED_BODY)
    late = Exchange(deliver=False)
    late.request()
    late.feed(b"HTTP/1.1 200 OK\r\n\r\nab", b"cd")
    late.conn.connectionLost(Failure(ConnectionDone()))
    late.responses[0].deliverBody(late.body)
    assert late.body.data == [b"ab", b"cd"] and late.body.end().check(PotentialDataLoss)


def test_request_ends_before_the_headers_lost_cancelled_or_failed() -> None:
    """Lost: ResponseNeverReceived around the loss, not an idle loss. Cancelled:
    aborted, producer stopped, CancelledError. A producer fails: its reason."""
    ex = exchange(b"HTTP/1.1 200 OK\r\nContent-")
    ex.conn.connectionLost(Failure(ConnectionLost()))
    assert ex.never_received().check(ConnectionLost)
    assert ex.lost == [] and ex.idle == [] and ex.conn.lost.called
    ex, producer = Exchange(), Producer(UNKNOWN_LENGTH)
    ex.request(producer).cancel()
    [failure] = ex.failures
    assert failure.check(CancelledError)
    assert ex.transport.disconnected and producer.stopped and registered(ex.transport) is None
    ex.conn.connectionLost(Failure(ConnectionAborted()))
    assert ex.responses == [] and len(ex.failures) == 1 and ex.idle == [] and ex.lost == []
    ex, producer = Exchange(), Producer(UNKNOWN_LENGTH)
    ex.request(producer)
    producer.done.errback(Failure(ValueError("no body")))
    [failure] = ex.failures
    assert failure.check(ValueError)
    assert ex.transport.disconnected and registered(ex.transport) is None


def test_body_transport_pauses_resumes_and_stops_the_connection() -> None:
    """The body protocol's transport is the connection's flow control: pause and
    resume reach it; stop aborts it and the body ends with ResponseFailed."""
    ex = exchange(CHUNKED[:-30])
    body_transport: Any = ex.body.transport
    assert isinstance(body_transport, _BodyTransport)
    body_transport.pauseProducing()
    paused = ex.transport.producerState
    body_transport.resumeProducing()
    assert (paused, ex.transport.producerState) == ("paused", "producing")
    body_transport.stopProducing()
    assert ex.transport.disconnected
    ex.conn.connectionLost(Failure(ConnectionAborted()))
    assert ex.body.end().check(ResponseFailed)


def test_data_while_idle_aborts_the_connection() -> None:
    """Bytes from the engine when no request is out, before the first request
    or after a response ended: the connection cannot carry a request."""
    for ex in (exchange(LENGTH), Exchange()):
        ex.feed(b"HTTP/1.1 200 OK\r\n")
        assert ex.transport.disconnected and not ex.conn.usable()


def test_keep_alive_connection_carries_the_next_request_and_reports_idle_loss() -> None:
    """After a response the same connection carries a second request; lost while
    idle it calls on_lost, and its `lost` fires."""
    ex = exchange(LENGTH)
    ex.transport.clear()
    ex.body = Body()
    ex.request(b"again")
    assert ex.transport.value().startswith(b"POST /v1/x HTTP/1.1\r\n")
    ex.feed(CHUNKED)
    assert ex.received == CHUNKED_BODY and ex.idle == [ex.conn, ex.conn]
    ex.conn.connectionLost(Failure(ConnectionDone()))
    assert ex.lost == [ex.conn] and ex.conn.lost.called and not ex.conn.usable()


def test_response_before_the_request_body_is_sent_closes_the_connection() -> None:
    """The engine answered (say 413) while the request body was still being
    produced: the request was never finished; the connection must not be reused."""
    ex, producer = Exchange(), Producer(10)
    ex.request(producer)
    ex.feed(b"HTTP/1.1 413 Too Large\r\nContent-Length: 4\r\n\r\nbig!")
    assert ex.responses[0].code == 413 and ex.received == b"big!"
    assert producer.stopped and registered(ex.transport) is None
    assert ex.idle == [] and not ex.conn.usable() and ex.transport.disconnecting


class PausingBody(Body):
    """A body protocol whose client is slow: it pauses the connection at its
    first bytes (as the relay's backpressure does) and never resumes it."""

    def dataReceived(self, data: bytes) -> None:
        super().dataReceived(data)
        assert self.transport is not None
        self.transport.pauseProducing()    # type: ignore[attr-defined]


def test_a_connection_paused_by_its_last_body_reads_again_when_idle() -> None:
    """The relay pauses the engine connection when the client's socket is full;
    if that happens on the read that also ends the body, the connection goes back
    to the pool reading again, or its next request would never see an answer."""
    ex = Exchange()
    ex.body = PausingBody()
    ex.request()
    ex.feed(CHUNKED)
    assert ex.body.end().check(ResponseDone)
    assert ex.idle == [ex.conn]
    assert ex.transport.producerState == "producing"


class IdleAtEnd(Body):
    """A Body that notes the pool's idle connections when its end arrives."""

    def __init__(self, idle: list[H1Connection]) -> None:
        super().__init__()
        self.idle = idle
        self.idle_at_end: list[list[H1Connection]] = []

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.idle_at_end.append(list(self.idle))
        super().connectionLost(reason)


@pytest.mark.parametrize("response", [LENGTH, CHUNKED, b"HTTP/1.1 204 No Content\r\n\r\n"],
                         ids=["length", "chunked", "empty"])
def test_the_connection_is_idle_before_the_end_of_its_body_is_delivered(
        response: bytes) -> None:
    """Whatever the body's end lets go on at once (the next request in the host's
    queue, as this one's lease is released) finds the connection in the pool, and
    may send its request on it there and then."""
    ex = Exchange()
    ex.body = IdleAtEnd(ex.idle)
    ex.request()
    ex.feed(response)
    assert ex.body.idle_at_end == [[ex.conn]]
    assert ex.body.end().check(ResponseDone)
    ex.conn.request(b"POST", b"/v1/y", b"h", Headers(), b"next")
    assert ex.transport.value().endswith(b"next") and ex.conn.state == "WAITING"


class SocketTransport(StringTransport):
    """A StringTransport whose reads come from a real socket (what `_read` reads)."""

    bufferSize = 65536

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock

    def fileno(self) -> int:
        return self._sock.fileno()


@contextmanager
def over_a_socket() -> Iterator[tuple[Exchange, socket.socket, Callable[[bytes], object]]]:
    """A request on a connection that reads a real socket (`_read`); the peer's
    end, and `read(data)`: the peer sends `data`, the connection reads once."""
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    try:
        ex = Exchange()
        ex.conn.transport = SocketTransport(ours)
        ex.request()

        def read(data: bytes) -> object:
            peer.sendall(data)
            return ex.conn._read()

        yield ex, peer, read
    finally:
        ours.close()
        peer.close()


def test_read_hands_each_reads_data_to_the_body_in_one_piece() -> None:
    """`_read` (the connection reading its TCP socket itself): the head, then
    each read's data in one piece (the body's reads straight to the parser, not
    through dataReceived); nothing to read is no loss, end of file is the end."""
    with over_a_socket() as (ex, peer, read):
        passed: list[bytes] = []                  # what went through dataReceived
        received = ex.conn.dataReceived
        ex.conn.dataReceived = lambda data: (  # type: ignore[method-assign]
            passed.append(data), received(data))[1]
        assert read(STREAM_HEAD) is None and len(ex.responses) == 1
        assert read(b"2f\r\n" + EVENT + b"\r\n") is None
        assert read(b"2f;x\r\n" + EVENT + b"\r\n2\r\nok\r\n") is None
        assert ex.body.data == [EVENT, EVENT + b"ok"] and passed == [STREAM_HEAD]
        assert ex.conn._read() is None                  # nothing to read (EWOULDBLOCK)
        assert read(b"0\r\n\r\n") is None and ex.body.end().check(ResponseDone)
        peer.close()
        assert ex.conn._read() is main.CONNECTION_DONE


def test_a_body_that_takes_its_data_gets_each_read_until_it_lets_go() -> None:
    """`take_data(handler)` (what the relay asks once a stream is under way):
    from then on each read's data goes to `handler`, no longer to the
    protocol's dataReceived; `take_data(None)` gives it back; after the body's
    end nothing goes anywhere."""
    with over_a_socket() as (ex, _peer, read):
        taken: list[bytes] = []
        chunk = b"2f\r\n" + EVENT + b"\r\n"
        assert read(STREAM_HEAD) is None
        assert read(chunk) is None and ex.body.data == [EVENT]
        transport = ex.body.transport
        assert isinstance(transport, _BodyTransport)
        transport.take_data(taken.append)
        assert read(chunk) is None and read(chunk + chunk) is None
        assert taken == [EVENT, EVENT * 2] and ex.body.data == [EVENT]
        transport.take_data(None)
        assert read(chunk) is None and len(taken) == 2 and ex.body.data == [EVENT, EVENT]
        assert read(b"0\r\n\r\n") is None and ex.body.end().check(ResponseDone)
        transport.take_data(taken.append)
        assert ex.responses[0].receive is not taken.append


@contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic garbage collector off: what is freed is freed by reference counts."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("how", ["ended", "ended before deliverBody", "cut"])
def test_a_response_and_its_body_protocol_are_freed_at_the_end_without_the_collector(
        how: str) -> None:
    """A body protocol keeps its transport, which keeps the response, which kept
    the protocol (a relay, and the request's whole record hanging off it): once
    the body is over, however it ends, the response lets go of the protocol, so
    both go with their last reference, not at the next garbage collection."""
    with collector_off():
        ex = Exchange(deliver=how != "ended before deliverBody")
        ex.request()
        if how == "cut":
            ex.feed(STREAM_HEAD, b"2f\r\n" + EVENT + b"\r\n")
            ex.conn.connectionLost(Failure(ConnectionLost()))
        else:
            ex.feed(CHUNKED)
        [response] = ex.responses
        if how == "ended before deliverBody":
            response.deliverBody(ex.body)
        assert ex.body.transport is not None and ex.body.reasons
        gone = weakref.ref(response), weakref.ref(ex.body)
        del response, ex.responses[:]
        ex.body = Body()
        assert [ref() for ref in gone] == [None, None]
