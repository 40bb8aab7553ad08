"""One HTTP/1.1 connection of the proxy: Twisted's `HTTPChannel` with every
change the proxy makes to it in one class, `ProxyChannel`, on public Twisted
alone (the reference path; llmproxy/speedups/responsewrites.py subclasses it,
and a llmproxy.compat entry may be mixed in before it).

Its head limits answer 431 (and 400 for a second Host header) with the
proxy's JSON, not Twisted's bare 400 (the answers: headerlimits.py); its body
limit refuses a body over max_body_bytes before reading it and lingers
half-closed after the 413 (the chunk-size watch: bodylimit.py); its client
timers (timers.py) hear of every step of its requests; the site (site.py)
tracks it so a stop can close it when idle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall, ISSLTransport
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web import http
from zope.interface import implementer

from llmproxy.web.bodylimit import LINGER_SECONDS, BodyLimitRequest, ChunkSizes, IBodyRefusal
from llmproxy.web.errors import raw_error
from llmproxy.web.headerlimits import TWO_HOSTS, header_fields_too_large
from llmproxy.web.timers import FIELDS, HEADER, IDLE, STALL, ChannelTimers

if TYPE_CHECKING:
    from llmproxy.web.site import ProxyRequest, ProxySite


@implementer(IBodyRefusal)
class ProxyChannel(http.HTTPChannel):
    """An HTTP/1.1 connection the site keeps track of, so a stop can close the
    idle ones and make the busy ones close after their current response. Its
    requests are the site's `ProxyRequest`s.

    What it overrides of `HTTPChannel`, and why:

    - `connectionMade`, `connectionLost`: the site tracks it; its timers start,
      and stop with any linger after a refused body.
    - `dataReceived`: nothing is read once it is closing; its timers hear that
      bytes arrived (an idle connection starts its next request's header timer).
    - `lineReceived`: counts the head's bytes as Twisted does (its lines without
      their line breaks): 431 past `totalHeadersSize`, answered before Twisted
      would; nothing more is read of a connection whose head was refused.
    - `headerReceived`: 431 past `maxHeaders`; 400 for a second Host header.
    - `lineLengthExceeded`: 431 for a line over the line length limit.
    - `allHeadersReceived`: the head's counts start again for the next request;
      a chunked body's size lines are watched from now on (`ChunkSizes`); its
      timers hear the head is in.
    - `rawDataReceived`: its timers hear more of the body; a chunked body's
      bytes are checked before Twisted's decoder reads them, and a refused
      body's dropped until its 413 is dispatched.
    - `allContentReceived`: its timers hear the request is answered; the
      chunked body's watch ends.
    - `requestDone`: its timers hear the connection is idle.
    - `loseConnection`: after a refused body, half-closed and aborted
      LINGER_SECONDS later, not closed with the body unread (a reset).
    - `pauseProducing`, `resumeProducing`: its timers hear of the pause (the
      write stall).
    - `checkPersistence`: not persistent once the site stops.
    - `getPeer`, `getHost`: asked for by every request; read once.
    """

    site: ProxySite
    requests: list[ProxyRequest]
    transport: Any
    timers: ChannelTimers
    dispatched = 0      # requests on this connection handed to the resource so far
    head_size = 0       # of the request line and headers so far
    head_count = 0      # headers so far
    chunk_sizes: ChunkSizes | None = None   # the chunked body being read, watched
    _head_refused = False   # answered: nothing more is read of this connection
    _refusing: BodyLimitRequest | None = None   # its body is over the limit: answered, then closed
    _linger: IDelayedCall | None = None
    _peer: Any = None
    _host: Any = None

    @property
    def closing(self) -> bool:
        return self.site.closing

    @property
    def idle(self) -> bool:
        """A keep-alive connection between requests: it served one, and nothing
        of the next has arrived."""
        return self.dispatched > 0 and not self.requests

    @property
    def unserved(self) -> bool:
        """Accepted, but its first request is not in yet: closing it would lose
        a request the client has probably already sent."""
        return self.dispatched == 0

    def getPeer(self) -> Any:
        if self._peer is None:
            self._peer = self.transport.getPeer()
        return self._peer

    def getHost(self) -> Any:
        if self._host is None:
            self._host = self.transport.getHost()
        return self._host

    def connectionMade(self) -> None:
        super().connectionMade()
        self.site.channels.add(self)
        self.timers = ChannelTimers(self.callLater, self.site.timeouts, self.timed_out,
                                    self.unsent, self.site.reactor.seconds)
        self.timers.awaiting_headers()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.site.channels.discard(self)
        self.timers.stop()
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
        super().connectionLost(reason)
        self.site.channel_changed()

    def unsent(self) -> int | None:
        """How much of the response the transport still holds for the client,
        when the channel can tell (for the write stall: a paused response whose
        buffer shrank has a reader, if a slow one). Twisted's transports do not
        say, so on this path None: a response the transport holds paused for
        the whole bound is stalled."""
        return None

    def malformed_request_answer(self) -> bytes:
        """The whole answer to a malformed request (its connection then
        closes): the OpenAI-style JSON every other error has. Twisted answers
        with its own bare 400 unless llmproxy.compat.badrequest is on."""
        return raw_error(400, "Bad Request", "malformed HTTP request", "bad_request")

    # -- the head ------------------------------------------------------------------
    def dataReceived(self, data: bytes) -> None:
        # Nothing more is read of a connection the channel is closing (it
        # answered a malformed or refused request, or its last response said
        # close): the reactor still delivers a read it had polled before the
        # close, which would be parsed as more of the connection (a second 400,
        # or a refused request dispatched after its 400).
        if self.transport.disconnecting:
            return
        # Bytes arrived (a read; and what the channel replays of the next
        # request once one is done).
        self.timers.data()
        super().dataReceived(data)

    def lineReceived(self, line: bytes) -> None:
        if self._head_refused:
            return
        if self.head_size + len(line) > self.totalHeadersSize:
            self._refuse_head(header_fields_too_large(
                f"request headers over {self.totalHeadersSize} bytes"))
            return
        self.head_size += len(line)
        super().lineReceived(line)

    def headerReceived(self, line: bytes) -> bool:
        if self.head_count + 1 > self.maxHeaders:
            self._refuse_head(header_fields_too_large(
                f"more than {self.maxHeaders} request headers"))
            return False
        ok = bool(super().headerReceived(line))
        if ok:
            self.head_count += 1
            # A header name is a token (Twisted refused any other): "host:" starts
            # a Host header whatever its case, and only one.
            if line[:5].lower() == b"host:" and \
                    len(self.requests[-1].requestHeaders.getRawHeaders(b"host") or ()) > 1:
                self._refuse_head(TWO_HOSTS)
                return False
        return ok

    def lineLengthExceeded(self, line: bytes) -> None:
        self._refuse_head(header_fields_too_large(
            "a request line or header over the line length limit"))

    def _refuse_head(self, answer: bytes) -> None:
        """The head is refused: `answer` (the whole response), then closed;
        nothing more is read of this connection."""
        if not self._head_refused:
            self._head_refused = True
            self.transport.write(answer)
            self.transport.loseConnection()

    def allHeadersReceived(self) -> None:
        # The head is in: the next request's is counted from nothing.
        self.head_size = self.head_count = 0
        super().allHeadersReceived()
        request = self.requests[-1] if self.requests else None
        if self.length is None and request is not None and not request.state.body_too_large:
            self.chunk_sizes = ChunkSizes(request.body_limit())     # chunked
        # The end of the request's headers (and of its body's refusal).
        self.timers.headers_done(body_follows=self.length != 0)

    # -- the body ------------------------------------------------------------------
    def rawDataReceived(self, data: bytes) -> None:
        # More of a body (the timer restarts), or of the next request while
        # this one is answered (no body timer runs then: nothing to restart).
        self.timers.body_read()
        # A chunked body's bytes are watched before the decoder reads them; a
        # refused body's are dropped until its 413 is dispatched (the decoder,
        # out of step, would answer them with a 400 of its own).
        sizes = self.chunk_sizes
        if sizes is not None and not sizes.fits(data):
            self.chunk_sizes = None
            self.requests[-1].refuse_body()
            return
        refusing = self._refusing
        if refusing is not None and not refusing.state.dispatched:
            return
        super().rawDataReceived(data)

    def allContentReceived(self) -> None:
        # The whole request is in: it is answered.
        self.timers.answering()
        self.chunk_sizes = None
        super().allContentReceived()

    def body_refused(self, request: BodyLimitRequest) -> None:
        """`request`'s body is over the limit: read no more of this connection,
        and answer now (413, see routes), not once the body is in. With a
        Content-Length the channel dispatches it at the end of the headers (the
        length it sees is 0); a chunked body is cut where it crosses the limit."""
        self._refusing = request
        self.persistent = False
        self.transport.pauseProducing()
        if self.length is None:
            # Chunked, mid-body: dispatch once the decoder is off the stack.
            self.callLater(0, lambda: self._dispatch_refused(request))
        else:
            self.length = 0

    def _dispatch_refused(self, request: BodyLimitRequest) -> None:
        if not request.state.dispatched and self.requests and self.requests[-1] is request:
            self.allContentReceived()

    def loseConnection(self) -> None:
        if self._refusing is None:
            return super().loseConnection()  # type: ignore[no-any-return]
        if self._linger is not None:
            return None
        # The client may still be sending the body we refused: a close with
        # unread data resets the connection, and a reset can destroy the 413
        # before the client reads it. Half-close after the answer instead, read
        # nothing more, and abort after LINGER_SECONDS. Over TLS the answer
        # may still sit in the TLS layer (its writes go out on the next turn),
        # and a TCP half-close now would drop it: the TLS close (the answer,
        # then close_notify) ends the writing side there.
        transport: Any = self.transport
        transport.unregisterProducer()
        transport.pauseProducing()
        if ISSLTransport.providedBy(transport):
            transport.loseConnection()
        else:
            transport.loseWriteConnection()
        self._linger = self.callLater(LINGER_SECONDS, transport.abortConnection)
        return None

    # -- between requests, and the response ----------------------------------------
    def requestDone(self, request: Any) -> None:
        if self.persistent:
            # Idle from now on, unless Twisted replays what arrived of the next
            # request meanwhile: it does so through dataReceived, which starts
            # that request's header timer.
            self.timers.between_requests(next_started=False)
        super().requestDone(request)

    def pauseProducing(self) -> None:
        super().pauseProducing()
        self.timers.paused()

    def resumeProducing(self) -> None:
        super().resumeProducing()
        self.timers.resumed()

    def checkPersistence(self, request: Any, version: bytes) -> bool:
        if self.site.closing:
            # The header alone would not do: Twisted would read the next request.
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        return bool(super().checkPersistence(request, version))

    def timed_out(self, kind: str) -> None:
        """A timer of `kind` ran out: a 408 for a request under way, a silent
        close for an idle connection, an abort for a stalled reader."""
        seconds = self.site.timeouts.seconds(kind)
        if kind == STALL:
            # Its request ends as client-stalled: the upstream is cancelled and
            # any engine lease released as for a client that left.
            for request in self.requests:
                exchange = request.state.exchange
                if exchange is not None:
                    exchange.stalled(seconds)
            self.transport.abortConnection()
            return
        if kind != IDLE and self.timers.heard:
            what = "request headers" if kind == HEADER else "request body"
            self.transport.write(raw_error(
                408, "Request Timeout", f"{what} not received within {seconds:g}s "
                f"({FIELDS[kind]})", "request_timeout"))
        self.persistent = False
        self.loseConnection()
