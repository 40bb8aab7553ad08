"""One HTTP/1.1 connection to an engine: a request out, its response in.

The engine_client speedup's connection, in place of the layers of Twisted's
Agent the reference client (web/engineclient.py) goes through (URI objects,
Deferred chains, a line parser, a generic transfer decoder per body, a stateful
dispatcher). It is the part of HTTP/1.1
an engine connection needs, in one protocol: the request written in one piece
(head and a whole body; a producer's body streams, by its length or chunked), the
status line and headers parsed at once, the body decoded (Content-Length,
chunked, or until close) and handed on one piece per read. Whole chunks at a
read's start (one: a stream's usual read) go on framed as they came, in one
piece (a relay sends them on as they are). Over plain TCP the connection reads
its socket itself (`_read`: Twisted's doRead without the two calls between).

The response looks like Twisted's (`code`, `phrase`, `headers`, `length`,
`deliverBody`), and its body ends the way Twisted's does: `ResponseDone`,
`PotentialDataLoss` for a body that ends with the connection, `ResponseFailed`
when it is cut short; a request whose response never came fails with
`ResponseNeverReceived` (`CrossedClose` when the engine's close of a reused
connection crossed it). The framing headers (Content-Length,
Transfer-Encoding, Keep-Alive) are kept out of `headers`; Connection stays (the
relay drops it and what it names). A head is held to web.enginehead's rules
(no bare LF, no CR or NUL in it, at most MAX_INTERIM interim 1xx heads, no 101),
else the request fails with BadResponse.
"""

from __future__ import annotations

from collections.abc import Callable
from errno import EWOULDBLOCK
from os import read as _os_read
from typing import Any

from twisted.internet import main, tcp
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionAborted, ConnectionDone, ConnectionLost
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IBodyProducer

from llmproxy.speedups.enginemessage import (
    MAX_SIZE_LINE,
    ChunkedConsumer,
    UpstreamResponse,
    chunk_size,
    request_head,
    response_headers,
    whole_chunks,
)
from llmproxy.speedups.socketwrites import READ_AS_KNOWN, no_delay, send_now
from llmproxy.web.engineclient import CrossedClose
from llmproxy.web.enginehead import MAX_HEAD, BadResponse, check_bytes, interim, status_code

# How every whole body ends: one Failure for all of them, as Twisted's
# `connectionDone` is one for every clean close (it has no traceback, and its
# `parents` are worked out once).
RESPONSE_DONE = Failure(ResponseDone("Response body fully received"))
QUIESCENT, WAITING, BODY, CLOSING, CONNECTION_LOST = (
    "QUIESCENT", "WAITING", "BODY", "CLOSING", "CONNECTION_LOST")
_SIZE, _DATA, _CRLF, _TRAILER = range(4)     # where a chunked body is


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
    _interim = 0              # interim (1xx) heads of this request so far

    def __init__(self, on_idle: Callable[[H1Connection], None],
                 on_lost: Callable[[H1Connection], None]) -> None:
        self.on_idle, self.on_lost = on_idle, on_lost
        self.state = QUIESCENT
        self.lost: Deferred[None] = Deferred()
        self._buf = b""
        self._waiting: Deferred[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._producer: IBodyProducer | None = None
        self._keep = True
        self._left = 0           # Content-Length: bytes to come; chunked: of this chunk
        self._framing = ""       # "length", "chunked", "close"
        self._chunk = _SIZE

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
        # The usual read of a stream, exactly one whole chunk (an engine writes
        # each event as one, its size line the data's length in hex): straight
        # to the body's protocol, framed as it came. What `_body` finds
        # (`whole_chunks`), without the three calls between: once per event.
        if self.state == BODY and self._framing == "chunked" and not self._buf and \
                self._chunk == _SIZE:
            eol = data.find(b"\r\n")
            size = len(data) - eol - 4
            if 0 < eol <= MAX_SIZE_LINE and size > 0 and data.endswith(b"\r\n") and (
                    data[:eol] == b"%x" % size or data[:eol] == b"%X" % size):
                self._response.chunk(data, size)  # type: ignore[union-attr]
                return None
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
        self.state, self._interim = WAITING, 0
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
        if self.state == BODY:
            self._body(data)
        elif self.state == WAITING:
            self._buf += data
            self._head()
        else:
            # Bytes nobody asked for: this connection cannot carry a request.
            self.transport.abortConnection()

    def _head(self) -> None:
        while True:      # interim heads (1xx) in a loop, up to enginehead's cap
            buf = self._buf
            end = buf.find(b"\r\n\r\n")
            head = buf if end < 0 else buf[:end]
            try:
                check_bytes(head, more=end < 0)
                if len(head) > MAX_HEAD:
                    raise BadResponse(f"response headers over {MAX_HEAD} bytes")
                if end < 0:
                    return
                self._buf = buf[end + 4:]
                response = self._parse(head)
            except BadResponse as e:
                self._bad(str(e))
                return
            if response is not None:
                break
        rest, self._buf = self._buf, b""
        self._response = response
        self.state = BODY
        d, self._waiting = self._waiting, None
        if self._framing == "length" and self._left == 0:
            if rest:
                self._keep = False     # bytes after an empty body: not a clean connection
            self._finish()
        if d is not None:
            d.callback(response)
        if rest and self.state == BODY:
            self._body(rest)

    def _parse(self, head: bytes) -> UpstreamResponse | None:
        """The response a head (its bytes checked) begins; None for an interim one."""
        lines = head.split(b"\r\n")
        code = status_code(lines[0])
        if interim(code, self._interim):
            self._interim += 1
            return None
        self._keep = not lines[0].startswith(b"HTTP/1.0")
        headers, length, chunked, close, self.keep_alive = response_headers(lines)
        if close:
            self._keep = False
        if code in (204, 304):
            self._framing, self._left, length = "length", 0, 0
        elif chunked:
            self._framing, self._left, self._chunk, length = "chunked", 0, _SIZE, None
        elif length is not None:
            self._framing, self._left = "length", length
        else:
            self._framing, self._keep = "close", False
        return UpstreamResponse(code, lines[0][13:], headers,
                                UNKNOWN_LENGTH if length is None else length, self)

    def _body(self, data: bytes) -> None:
        if self._framing == "chunked":
            if not self._buf and self._chunk == _SIZE:
                data = self._whole_chunks(data)
            if data:
                self._chunks(data)
        elif self._framing == "close":
            self._receive(data)
        else:
            take = data[:self._left] if len(data) > self._left else data
            self._left -= len(take)
            if take:
                self._receive(take)
            if self._left == 0:
                if len(data) > len(take):
                    self._keep = False     # more than the body: not a clean connection
                self._finish()

    def _whole_chunks(self, data: bytes) -> bytes:
        """Whole chunks at the start of `data` on, framed, in one piece; the rest."""
        run, size = whole_chunks(data)
        if not run:
            return data
        self._response.chunk(data if run == len(data) else data[:run], size)  # type: ignore[union-attr]
        return b"" if self.state != BODY else data[run:]

    def _chunks(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        pos, end, out = 0, len(buf), []
        while pos < end:
            state = self._chunk
            if state == _DATA:
                take = min(self._left, end - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    self._chunk = _CRLF
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if end - pos > MAX_SIZE_LINE:
                    return self._bad("chunked body: a size or trailer line too long")
                break
            line, pos = buf[pos:eol], eol + 2
            if state == _CRLF:
                if line:
                    return self._bad("chunked body: a chunk is longer than its size")
                self._chunk = _SIZE
            elif state == _SIZE:
                size = chunk_size(line)
                if size < 0:
                    return self._bad(f"chunked body: bad chunk size {line[:40]!r}")
                after = pos + size
                if size and after + 2 <= end and buf[after:after + 2] == b"\r\n":
                    out.append(buf[pos:after])    # the whole chunk is here: in one step
                    pos = after + 2
                    continue
                self._left = size
                self._chunk = _DATA if size else _TRAILER
            elif not line:                     # the empty line after the last chunk
                return self._last_chunk(out, pos < end)
        self._buf = buf[pos:]
        if out:
            self._response_data(out)
        return None

    def _last_chunk(self, out: list[bytes], more: bool) -> None:
        if out:
            self._response_data(out)
        if more:
            self._keep = False     # bytes after the body: not a clean connection
        self._finish()

    def _response_data(self, out: list[bytes]) -> None:
        self._receive(out[0] if len(out) == 1 else b"".join(out))

    def _receive(self, data: bytes) -> None:
        self._response.receive(data)  # type: ignore[union-attr]

    def _finish(self) -> None:
        """The response is whole: the body ends; the connection is reused or closed."""
        response, self._response = self._response, None
        self._buf = b""
        # An answer before the whole request body went out (a 413, say): the
        # engine still waits for the rest, so the connection carries nothing more.
        unsent = self._producer is not None
        self._stop_producer()
        keep = self._keep and not unsent
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
            never = CrossedClose if self.crossed else ResponseNeverReceived
            self._fail_waiting(Failure(never([reason])))
        response, self._response = self._response, None
        if response is not None:
            if self._framing == "close" and not reason.check(BadResponse):
                response._ended(Failure(PotentialDataLoss()))
            else:
                response._ended(Failure(ResponseFailed([reason])))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        was = self.state
        self.state = CONNECTION_LOST
        transport = self.transport
        if type(transport) is tcp.Client:
            vars(transport).pop("doRead", None)    # no cycle left behind
            # Twisted's connector and this transport keep each other after a
            # close (connectionFailed drops it only after a failed connect), so
            # both waited for the garbage collector: the connector drops it here.
            connector: Any = getattr(transport, "connector", None)
            if getattr(connector, "transport", None) is transport:
                connector.transport = None
        self.crossed = was == WAITING and self.idle_for is not None and not self._buf and \
            reason.check(ConnectionDone, ConnectionLost) is not None and \
            reason.check(ConnectionAborted) is None     # (this side aborts)
        self._stop_producer()
        if was == QUIESCENT or self.crossed:
            self.on_lost(self)      # first: the pool learns before the request fails
        self._fail(reason)
        self.lost.callback(None)
