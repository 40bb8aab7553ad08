"""One HTTP/1.1 connection to an engine: a request out, its response in.

The engine_client speedup's connection, in place of the layers of Twisted's
Agent the reference client (web/engineclient.py) goes through (URI objects,
Deferred chains, a line parser, a generic transfer decoder per body, a stateful
dispatcher). It is the part of HTTP/1.1 an engine connection needs, in one
protocol: the request written in one piece (head and a whole body; a
producer's body streams, by its length or chunked), the response read by
httptools (llhttp, a parser kept and fuzzed elsewhere: the status line, the
headers, the body by its Content-Length, chunked, or until the close), and the
data each read carries handed on in one piece. Over plain TCP the connection
reads its socket itself (`_read`: Twisted's doRead without the two calls
between).

Each read of a head passes web.enginehead's HeadWatch before the parser has it
(enginemessage.ResponseParse): the rules both engine clients share (no bare
LF, no CR or NUL, at most MAX_INTERIM interim 1xx heads, no 101, an unambiguous
framing...). A head they or the parser refuse fails the request with
BadResponse; a body whose framing the parser refuses (or that runs over
ResponseParse's bounds) ends with ResponseFailed around BadResponse, after the
data that came before the fault in its read. The answer to a HEAD request, a
204 and a 304 have no body.

The response looks like Twisted's (`code`, `phrase`, `headers`, `length`,
`deliverBody`), and its body ends the way Twisted's does: `ResponseDone`,
`PotentialDataLoss` for a body that ends with the connection (httptools has no
end of input: such a body ends at the close), `ResponseFailed` when it is cut
short; a request whose response never came fails with `ResponseNeverReceived`
(`CrossedClose` when the engine's close of a reused connection crossed it). The
framing headers (Content-Length, Transfer-Encoding, Keep-Alive) are kept out of
`headers`; Connection stays (the relay drops it and what it names).
"""

from __future__ import annotations

from collections.abc import Callable
from errno import EWOULDBLOCK
from os import read as _os_read
from typing import Any

from twisted.internet import main, tcp
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionAborted, ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IDelayedCall, IHalfCloseableProtocol, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IBodyProducer
from zope.interface import implementer

from llmproxy.speedups.enginemessage import (
    ChunkedConsumer,
    ResponseParse,
    UpstreamResponse,
    request_head,
)
from llmproxy.speedups.socketwrites import READ_AS_KNOWN, no_delay, send_now
from llmproxy.web.engineclient import RESENDABLE, CrossedClose
from llmproxy.web.enginehead import BadResponse
from llmproxy.web.enginewatch import close_after_eof

# How every whole body ends: one Failure for all of them, as Twisted's
# `connectionDone` is one for every clean close (it has no traceback, and its
# `parents` are worked out once).
RESPONSE_DONE = Failure(ResponseDone("Response body fully received"))
QUIESCENT, WAITING, BODY, CLOSING, CONNECTION_LOST = (
    "QUIESCENT", "WAITING", "BODY", "CLOSING", "CONNECTION_LOST")


@implementer(IHalfCloseableProtocol)
class H1Connection(Protocol):
    """A persistent connection to an engine, one request at a time. `on_idle(self)`
    when a response ended and the connection may carry the next request;
    `on_lost(self)` once it is gone while idle or `crossed`. `state` as Twisted's:
    QUIESCENT when idle. `idle_for`: idle time before this request, if reused;
    `keep_alive`: the idle timeout the last response's Keep-Alive header gave."""

    transport: Any = None
    idle_for: float | None = None
    keep_alive: float | None = None
    crossed = False

    def __init__(self, on_idle: Callable[[H1Connection], None],
                 on_lost: Callable[[H1Connection], None],
                 clock: IReactorTime | None = None) -> None:
        # `clock`: times the wait for an engine's reset after its close (none without).
        self.on_idle, self.on_lost, self._clock = on_idle, on_lost, clock
        self._settle: IDelayedCall | None = None
        self.state = QUIESCENT
        self.lost: Deferred[None] = Deferred()
        self._waiting: Deferred[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._producer: IBodyProducer | None = None
        self._parse = ResponseParse()
        self._heard = False           # a byte of the answer came
        self._resendable = False      # the request may go again if an idle close crossed it
        self._unread = False          # the engine closed, then reset the request unread

    def connectionMade(self) -> None:
        no_delay(self.transport)
        # The endpoint's wrapper only passes reads and the close on: out of the way.
        transport = self.transport
        if type(transport) is tcp.Client and \
                getattr(transport.protocol, "_wrappedProtocol", None) is self:
            transport.protocol = self
            if READ_AS_KNOWN:
                transport.doRead = self._read  # type: ignore[method-assign]

    def _read(self) -> ConnectionLost | ConnectionDone | None:
        """Twisted's tcp.Client.doRead for this connection: the same read with
        the same outcomes, handed to dataReceived without two calls between
        (a stream reads once per event), and read(2) for recv(2) without flags
        (see socketwrites.py)."""
        transport = self.transport
        try:
            data = _os_read(transport.fileno(), transport.bufferSize)
        except OSError as e:
            return None if e.args[0] == EWOULDBLOCK else main.CONNECTION_LOST
        if not data:
            return main.CONNECTION_DONE
        if self.state == BODY:
            self._feed(data)
        else:
            self.dataReceived(data)
        return None

    def usable(self) -> bool:
        """Idle, and neither closing nor closed on this side."""
        transport = self.transport
        return self.state == QUIESCENT and transport is not None and \
            bool(getattr(transport, "connected", True)) and \
            not getattr(transport, "disconnecting", False) and \
            not getattr(transport, "_aborting", False)

    # -- the request -------------------------------------------------------------
    def request(self, method: bytes, path: bytes, host: bytes, headers: Headers,
                body: bytes | IBodyProducer | None) -> Deferred[UpstreamResponse]:
        self.state, self._heard, self._unread = WAITING, False, False
        self._resendable = method in RESENDABLE
        self._parse.expect(method == b"HEAD")
        d: Deferred[UpstreamResponse] = Deferred(lambda _: self._cancel())
        self._waiting = d
        if body is None or isinstance(body, bytes):
            head = request_head(method, path, host, headers, None if body is None else len(body))
            send_now(self.transport, head + body if body else head)
        else:
            self._produce(method, path, host, headers, body)
        return d

    def _produce(self, method: bytes, path: bytes, host: bytes, headers: Headers,
                 producer: IBodyProducer) -> None:
        chunked = producer.length is UNKNOWN_LENGTH
        self.transport.write(request_head(method, path, host, headers,
                                          -1 if chunked else int(producer.length)))
        self._producer = producer
        consumer = ChunkedConsumer(self.transport) if chunked else self.transport
        self.transport.registerProducer(producer, True)
        done = producer.startProducing(consumer)

        def finished(_: object) -> None:
            if self._producer is producer:
                self._producer = None
                self.transport.unregisterProducer()
                if chunked:
                    self.transport.write(b"0\r\n\r\n")

        def failed(reason: Failure) -> None:
            if self._producer is producer:
                self._producer = None
                self.transport.unregisterProducer()
                self._fail_waiting(reason)
                self.transport.abortConnection()

        done.addCallbacks(finished, failed)

    def _cancel(self) -> None:
        self._stop_producer()
        self.transport.abortConnection()

    def _stop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            self.transport.unregisterProducer()
            producer.stopProducing()

    def _fail_waiting(self, reason: Failure) -> None:
        d, self._waiting = self._waiting, None
        if d is not None and not d.called:
            d.errback(reason)

    # -- the response ------------------------------------------------------------
    def dataReceived(self, data: bytes) -> None:
        state = self.state
        if state == BODY:
            self._feed(data)
        elif state == WAITING:
            self._heard = True
            self._feed(data)
        else:
            # Bytes nobody asked for: this connection cannot carry a request.
            self.transport.abortConnection()

    def _feed(self, data: bytes) -> None:
        """A read through the rules and the parser, then what they found, in
        order: the response at its head, the data of the read in one piece
        (before a fault the parser found after it), the end."""
        parse = self._parse
        fault = parse.feed(data)
        response = self._response
        if response is None:
            head = parse.head
            if head is None:
                if fault is not None:
                    self._bad(fault)
                return
            response = self._response = UpstreamResponse(*head, self)
            self.state, self.keep_alive = BODY, parse.idle
            d, self._waiting = self._waiting, None
            if d is not None:
                d.callback(response)
        pieces = parse.pieces
        if pieces:
            parse.pieces = []
            if self._response is response:
                response.receive(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if self._response is not response:
            return                      # it ended meanwhile (the connection was lost)
        if parse.complete:
            if fault is not None:
                parse.after = True      # bytes after the body, that the parser refused
            self._finish()
        elif fault is not None:
            self._bad(fault)

    def _finish(self) -> None:
        """The response is whole: the body ends; the connection is reused or closed."""
        response, self._response = self._response, None
        # An answer before the whole request body went out (a 413, say): the
        # engine still waits for the rest, so the connection carries nothing more.
        unsent = self._producer is not None
        self._stop_producer()
        parse = self._parse
        keep = parse.keep and not parse.after and not unsent
        self.state = QUIESCENT if keep else CLOSING
        if not keep:
            self.transport.loseConnection()
        elif self.usable():
            # A client that read slowly may have paused this connection's
            # reading (the body's backpressure) just before its last bytes: it
            # reads again before it carries the next request. It is idle before
            # the body's end is delivered: what that end lets go on at once (the
            # next request in a host's queue, granted as this one's lease is
            # released) finds it, instead of opening a connection while a later
            # request takes this one and reaches the engine first.
            self.transport.resumeProducing()
            self.on_idle(self)
        if response is not None:
            response._ended(RESPONSE_DONE)

    def _bad(self, why: str) -> None:
        self._fail(Failure(BadResponse(why)))
        self.transport.abortConnection()

    def _fail(self, reason: Failure) -> None:
        """The exchange ends badly: before the headers the request fails, after
        them the body is cut (a body that ends with the connection is whole)."""
        if self._waiting is not None:
            # Crossed, a GET or HEAD may go again; a POST the engine may have read never.
            # (a POST the engine refused unread, too: see refused_after_close)
            resend = self.crossed and (self._resendable or self._unread)
            never = CrossedClose if resend else ResponseNeverReceived
            self._fail_waiting(Failure(never([reason])))
        response, self._response = self._response, None
        if response is not None:
            if self._parse.close_delimited and not reason.check(BadResponse):
                response._ended(Failure(PotentialDataLoss()))
            else:
                response._ended(Failure(ResponseFailed([reason])))

    def readConnectionLost(self) -> None:
        """The engine closed (EOF): see web.enginewatch.close_after_eof."""
        self._settle = close_after_eof(self.transport, self._clock,
                                       self.state == WAITING and not self._heard, self._refused)

    def _refused(self) -> None:
        self._unread = True

    def writeConnectionLost(self) -> None:
        """Never half-closed here."""

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._settle is not None and self._settle.active():
            self._settle.cancel()
        was = self.state
        self.state = CONNECTION_LOST
        self._parse.close()
        transport = self.transport
        if type(transport) is tcp.Client:
            vars(transport).pop("doRead", None)    # no cycle left behind
            # Twisted's connector and this transport keep each other after a
            # close (connectionFailed drops it only after a failed connect), so
            # both waited for the garbage collector: the connector drops it here.
            connector: Any = getattr(transport, "connector", None)
            if getattr(connector, "transport", None) is transport:
                connector.transport = None
        self.crossed = was == WAITING and self.idle_for is not None and not self._heard and \
            reason.check(ConnectionDone, ConnectionLost) is not None and \
            reason.check(ConnectionAborted) is None     # (this side aborts)
        self._stop_producer()
        if was == QUIESCENT or self.crossed:
            self.on_lost(self)      # first: the pool learns before the request fails
        self._fail(reason)
        self.lost.callback(None)
