"""The pieces of an engine exchange around the connection (engineconnection):
a request's head, a body producer's chunk framing, the responses read
(`ResponseParse`: web.enginehead's rules, then httptools), and the response as
the proxy's code sees it (Twisted's IResponse: `code`, `phrase`, `headers`,
`length`, `deliverBody`), which holds body bytes that arrive before
`deliverBody`. What a response head may hold is web.enginehead's (BadResponse
is its error)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers, InvalidHeaderName, _nameEncoder
from twisted.web.iweb import UNKNOWN_LENGTH

from llmproxy.web.enginehead import BadResponse, HeadWatch

try:
    from httptools import (
        HttpParserCallbackError,
        HttpParserError,
        HttpParserUpgrade,
        HttpResponseParser,
    )
except ImportError:     # engineclient's guard keeps the speedup off, and says why
    HttpResponseParser = None  # type: ignore[assignment,misc]

MAX_FRAMING = 64 * 1024       # bytes of a chunked body's framing in a row, without data
MAX_TRAILERS = 64 * 1024      # a chunked body's trailers (Twisted's decoder's bound)


def checked_name(name: bytes) -> bytes:
    """A header name Headers has not seen yet, canonicalized; BadResponse if it
    is not a token."""
    try:
        return _nameEncoder.encode(name)
    except InvalidHeaderName:
        raise BadResponse(f"bad header name: {name[:100]!r}") from None


# The names Headers has canonicalized so far (its own cache), looked up first.
canonical = getattr(_nameEncoder, "_canonicalHeaderCache", {}).get
# Kept out of a response's `headers`: the framing headers and Keep-Alive, which
# the connection reads itself (Twisted's client keeps them apart too).
# Connection stays in, for the relay to drop it and the headers it names (RFC
# 9110 §7.6.1).
FRAMING_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"keep-alive"})


def keep_alive_timeout(value: bytes) -> float | None:
    """The seconds a server keeps an idle connection open, as a `Keep-Alive`
    header's `timeout` says (llama-server's cpp-httplib sends `timeout=5,
    max=100`); None without a timeout of whole seconds."""
    for part in value.split(b","):
        name, equals, seconds = part.partition(b"=")
        seconds = seconds.strip()
        if equals and name.strip().lower() == b"timeout" and seconds.isdigit() \
                and len(seconds) <= 9:
            return float(seconds)
    return None


def request_head(method: bytes, path: bytes, host: bytes, headers: Headers,
                 length: int | None) -> bytes:
    """A request's head: `length` None for no body, -1 for a chunked one."""
    out = [method, b" ", path, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    for name, values in headers._rawHeaders.items():   # getAllRawHeaders, without its generator
        for value in values:
            out += (name, b": ", value, b"\r\n")
    if length == -1:
        out.append(b"Transfer-Encoding: chunked\r\n")
    elif length is not None:
        out.append(b"Content-Length: %d\r\n" % length)
    out.append(b"\r\n")
    return b"".join(out)


class _Stop(Exception):
    """A parser callback stops the parser: the response ended at its head (a
    HEAD request's), or bytes came after it."""


class ResponseParse:
    """A connection's responses as they are read: each read of a head held to
    web.enginehead's rules (HeadWatch), then every read parsed by httptools
    (llhttp), whose callbacks record what it found for the connection to act
    on after the read (H1Connection._feed): the final response's head (`head`:
    code, phrase, headers, length; `idle`: its Keep-Alive timeout), the body
    data the read carried (`pieces`), the end (`complete`; `keep`: the
    connection may carry another request; `after`: bytes came after it).
    Interim (1xx) heads are passed over. `expect(no_body)` before each
    request's answer; `close()` once the connection is gone (the parser keeps
    this object's methods).

    Bounds llhttp does not keep: a chunked body's framing (size lines,
    extensions, trailers) runs MAX_FRAMING bytes at most in the reads after
    the last that carried data, and its trailers hold MAX_TRAILERS bytes at
    most (httptools holds a trailer whole until it ends)."""

    def __init__(self) -> None:
        self.parser: Any = HttpResponseParser(self)
        self.watch = HeadWatch()
        self.idle: float | None = None
        self.expect(False)

    def expect(self, no_body: bool) -> None:
        """A request went out: its answer comes next (`no_body`: a HEAD's)."""
        self.watch.expect(no_body)
        self.no_body = no_body
        self.head: tuple[int, bytes, Headers, int | object] | None = None
        self.pieces: list[bytes] = []
        self.complete = self.keep = self.after = self.close_delimited = False
        self._run = self._trailers = 0
        self._message()

    def close(self) -> None:
        self.parser = None

    def feed(self, data: bytes) -> str | None:
        """A read through the rules and the parser: why they refuse it, or None."""
        in_body = self.head is not None
        if not in_body:
            watch = self.watch
            why = watch.feed(data)
            watch.rest = b""
            if why is not None:
                return why
        fault = self._parse(data)
        if self.pieces:
            self._run = 0
        elif in_body and self._chunked and not self.complete:
            self._run += len(data)
            if self._run > MAX_FRAMING and fault is None:
                fault = f"chunked body: over {MAX_FRAMING} bytes of framing without data"
        return fault

    def _parse(self, data: bytes) -> str | None:
        """`data` through the parser: why it refused it, or None (a callback
        that stops it is no refusal; a bug in one is raised)."""
        try:
            self.parser.feed_data(data)
        except HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, BadResponse):
                return str(cause)
            if not isinstance(cause, _Stop):
                raise
        except (HttpParserError, HttpParserUpgrade) as e:
            return str(e) or type(e).__name__
        return None

    def _message(self) -> None:
        """A message (an interim head, or the final response) begins."""
        self._phrase = b""
        self._raw: dict[bytes, list[bytes]] = {}
        self._length: int | None = None
        self._chunked = False
        self._idle: float | None = None

    # httptools' callbacks: each records what it found.
    def on_message_begin(self) -> None:
        if self.complete:
            self.after = True           # another message after the response
            raise _Stop
        self._message()

    def on_status(self, phrase: bytes) -> None:
        self._phrase += phrase          # in pieces, when a read cuts it

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head is not None:       # a trailer: the proxy passes none on
            self._trailers += len(name) + len(value) + 4
            if self._trailers > MAX_TRAILERS:
                raise BadResponse(f"chunked body: trailers over {MAX_TRAILERS} bytes")
            return
        lower = name.lower()
        if lower in FRAMING_HEADERS:    # (HeadWatch let through only valid ones)
            if lower == b"content-length":
                self._length = int(value)
            elif lower == b"transfer-encoding":
                self._chunked = True
            else:
                self._idle = keep_alive_timeout(value)
            return
        # As Headers.addRawHeader: a canonical name (the value has no CR or LF).
        name = canonical(name) or checked_name(name)
        value = value.rstrip(b" \t")    # llhttp drops the whitespace before a value only
        values = self._raw.get(name)
        if values is None:
            self._raw[name] = [value]
        else:
            values.append(value)

    def on_headers_complete(self) -> None:
        code = self.parser.get_status_code()
        if code < 200:
            return                      # an interim head (HeadWatch counted it): passed over
        headers = Headers()
        headers._rawHeaders, self._raw = self._raw, {}
        length: int | object = self._length
        if code in (204, 304) or self.no_body:
            length = 0
        elif self._chunked or length is None:
            self.close_delimited = not self._chunked
            length = UNKNOWN_LENGTH
        self.idle = self._idle
        self.head = (code, self._phrase, headers, length)
        if self.no_body:
            # The parser cannot be told that this answer has no body: it ends
            # here, and the connection with it (the parser would read one).
            self.complete, self.keep = True, False
            raise _Stop

    def on_body(self, data: bytes) -> None:
        if data:
            self.pieces.append(data)

    def on_message_complete(self) -> None:
        if self.head is not None:       # (not an interim head's)
            self.complete = True
            self.keep = self.parser.should_keep_alive()


class _BodyTransport:
    """What a body protocol sees as its transport: pause, resume or stop the
    engine connection (stop closes it: the rest of the body is not wanted), and
    where the body's data goes (`take_data`)."""

    def __init__(self, connection: Any, response: UpstreamResponse) -> None:
        self._connection = connection
        self._response = response

    def take_data(self, handler: Callable[[bytes], None] | None) -> None:
        """From now on the body's data goes to `handler` (as `dataReceived`
        takes it); None: to the protocol's `dataReceived` again."""
        response = self._response
        protocol = response._protocol
        if protocol is not None:              # (after the body's end, nowhere)
            response.receive = protocol.dataReceived if handler is None else handler

    def pauseProducing(self) -> None:
        self._connection.transport.pauseProducing()

    def resumeProducing(self) -> None:
        self._connection.transport.resumeProducing()

    def stopProducing(self) -> None:
        self._connection.transport.abortConnection()

    abortConnection = stopProducing


def _nowhere(*_: object) -> None:
    """Where a body's bytes would go after its end (nowhere: none come)."""


class UpstreamResponse:
    """An engine's response: status, headers and the body, delivered once. Its
    connection hands it the data of each read in one piece (`receive`)."""

    version = (b"HTTP", 1, 1)
    request = None
    previousResponse = None

    def __init__(self, code: int, phrase: bytes, headers: Headers, length: int | object,
                 connection: Any) -> None:
        self.code, self.phrase, self.headers, self.length = code, phrase, headers, length
        self._connection = connection
        self._protocol: Protocol | None = None
        self._early: list[bytes] = []          # body bytes before deliverBody
        self._end: Failure | None = None       # how the body ended, before deliverBody
        # Where body bytes go: held until deliverBody, then straight to the
        # protocol (or where it asked, see _BodyTransport.take_data).
        self.receive: Callable[[bytes], None] = self._early.append

    def deliverBody(self, protocol: Protocol) -> None:
        self._protocol = protocol
        self.receive = protocol.dataReceived
        protocol.makeConnection(_BodyTransport(self._connection, self))
        early, self._early = self._early, []
        for data in early:
            self.receive(data)
        if self._end is not None:
            self._let_go()
            protocol.connectionLost(self._end)

    def _ended(self, reason: Failure) -> None:
        protocol = self._protocol
        if protocol is None:
            self._end = reason
        else:
            self._let_go()
            protocol.connectionLost(reason)

    def _let_go(self) -> None:
        """The body is over: the response lets go of its protocol (and of its
        own methods), so it, the protocol and their body transport are freed by
        their reference counts when the exchange is over, not left as a cycle
        for the garbage collector (a request's whole record hangs off a relay)."""
        self._protocol = None
        self.receive = _nowhere


class ChunkedConsumer:
    """A request body's consumer that frames each write as a chunk."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        if data:
            self._transport.writeSequence([b"%x\r\n" % len(data), data, b"\r\n"])

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass
