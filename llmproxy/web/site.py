"""The Site and its connections: a request that counts what it writes into its
record and refuses an oversized body as soon as it knows (before reading it);
channels the site tracks so a stop can close the idle ones and make the busy
ones close after their response."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes as unquote

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web import resource as web_resource
from twisted.web.http import datetimeToString
from twisted.web.resource import Resource
from twisted.web.server import Request, Site
from twisted.web.server import version as server_version

from llmproxy.core.timing import PerSecond, within
from llmproxy.web.bodylimit import BodyLimitChannel, BodyLimitRequest
from llmproxy.web.errors import raw_error
from llmproxy.web.headerlimits import HeaderLimits
from llmproxy.web.headfast import OneReadHead, new_request
from llmproxy.web.timers import (
    FIELDS,
    HEADER,
    IDLE,
    STALL,
    ChannelTimers,
    ClientTimeouts,
    unsent_bytes,
)
from llmproxy.web.writes import GatheringChannel, SendingRequest

if TYPE_CHECKING:
    from llmproxy.observe.requests import Exchange

# What ProxyRequest._process takes from twisted.web.server.Request.process;
# a Twisted without it gets its own process() back.
_PROCESS_AS_KNOWN = hasattr(web_resource, "_IEncodingResource") and all(
    hasattr(Request, name) for name in ("_handleStar", "processingFailed", "_encoder")) and \
    Site.getResourceFor.__code__.co_names == (
        "site", "copy", "prepath", "sitepath", "resource", "getChildForRequest")
# checkPersistence's answer to an HTTP/1.1 request without Connection, as
# Twisted 26.10 has it (a Twisted whose code differs gets it called).
_PERSISTENCE_AS_KNOWN = http.HTTPChannel.checkPersistence.__code__.co_names == (
    "requestHeaders", "getRawHeaders", "split", "responseHeaders", "setRawHeaders")


class ProxyRequest(BodyLimitRequest, SendingRequest):
    """A request that refuses a body over max_body_bytes as soon as it knows
    (its Content-Length, or the chunk that crosses the limit), says
    `Connection: close` on a response that starts while the proxy stops, and
    counts every byte it writes into its record (`exchange`). Its writes go out
    at once (see writes.py)."""

    dispatched = False
    exchange: Exchange | None = None

    def process(self) -> None:
        # The whole request is in: from now on it is an exchange in flight. The
        # drain hears of it once the exchange is registered (after process()),
        # and from the channel as it was (a finished request lets go of it).
        channel = self.channel
        self.dispatched = True
        if _PROCESS_AS_KNOWN:
            self._process()
        else:
            super().process()
        if isinstance(channel, ProxyChannel):
            channel.dispatched += 1
            channel.site.channel_changed()

    def _process(self) -> None:
        """twisted.web.server.Request.process, with its Server and Date headers
        stored as they are (going through setHeader costs an encode and a
        sanitize per header, every request), the Date made once a second, and
        the path unquoted only when it has something to unquote."""
        site = self.site = self.channel.site
        raw = self.responseHeaders._rawHeaders
        raw[b"Server"] = [server_version]
        raw[b"Date"] = [site.date() if isinstance(site, ProxySite) else datetimeToString()]
        path = self.path
        self.prepath = []
        segments = path[1:].split(b"/")
        self.postpath = [unquote(s) for s in segments] if path.find(b"%") >= 0 else segments
        if path == b"*":
            self._handleStar()
            return
        try:
            root = site.resource
            if root.isLeaf:            # getResourceFor, for a root that takes every path
                self.sitepath = self.prepath[:]
                resrc = root
            else:
                resrc = site.getResourceFor(self)
            if web_resource._IEncodingResource.providedBy(resrc):
                encoder = resrc.getEncoder(self)
                if encoder is not None:
                    self._encoder = encoder
            self.render(resrc)
        except BaseException:
            self.processingFailed(Failure())

    def starting(self) -> None:
        if getattr(self.channel, "closing", False):
            self.setHeader(b"connection", b"close")
            self.channel.persistent = False

    def counted(self, size: int) -> None:
        if self.exchange is not None:
            self.exchange.wrote(self.code, size)


class ProxyChannel(OneReadHead, HeaderLimits, BodyLimitChannel, GatheringChannel):
    """An HTTP/1.1 connection the site keeps track of, so a stop can close the
    idle ones and make the busy ones close after their current response."""

    site: ProxySite
    timers: ChannelTimers
    dispatched = 0      # requests on this connection handed to the resource so far
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

    def _new_request(self) -> Any:
        if self.requestFactory is ProxyRequest:
            return new_request(ProxyRequest, self)
        return super()._new_request()

    def getPeer(self) -> Any:
        # Asked by every request on the connection; it never changes.
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
        self.timers = ChannelTimers(self.callLater, self.site.timeouts, self._timed_out,
                                    lambda: unsent_bytes(self.transport),
                                    self.site.reactor.seconds)
        self.timers.awaiting_headers()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.site.channels.discard(self)
        self.timers.stop()
        self.stop_lingering()
        super().connectionLost(reason)
        self.site.channel_changed()

    # -- what the timers hear of ---------------------------------------------------
    def bytes_arrived(self) -> None:
        self.timers.data()

    def request_in(self) -> None:
        self.timers.request_in()

    def headers_received(self) -> None:
        self.timers.headers_done(body_follows=self.length != 0)

    def rawDataReceived(self, data: bytes) -> None:
        if not self._handlingRequest:
            self.timers.body_read()
        super().rawDataReceived(data)

    def content_received(self) -> None:
        self.timers.answering()

    def requestDone(self, request: Any) -> None:
        if self.persistent:
            # Before Twisted replays what arrived of the next request meanwhile.
            # (It holds b"" after a body with a Content-Length.)
            self.timers.between_requests(next_started=any(self._dataBuffer))
        super().requestDone(request)

    def pauseProducing(self) -> None:
        super().pauseProducing()
        self.timers.paused()

    def resumeProducing(self) -> None:
        super().resumeProducing()
        self.timers.resumed()

    def _timed_out(self, kind: str) -> None:
        seconds = self.site.timeouts.seconds(kind)
        if kind == STALL:
            # Its request ends as client-stalled: the upstream is cancelled and
            # any engine lease released as for a client that left.
            for request in self.requests:
                if isinstance(request, ProxyRequest) and request.exchange is not None:
                    request.exchange.stalled(seconds)
            self.transport.abortConnection()
            return
        if kind != IDLE and self.timers.heard:
            what = "request headers" if kind == HEADER else "request body"
            self.transport.write(raw_error(
                408, "Request Timeout", f"{what} not received within {seconds:g}s "
                f"({FIELDS[kind]})", "request_timeout"))
        self.persistent = False
        self.loseConnection()

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted's own answer to a malformed request is a bare 400: ours is
        # the OpenAI-style JSON every other error has.
        self.transport.write(raw_error(
            400, "Bad Request", "malformed HTTP request", "bad_request"))
        self.loseConnection()

    def checkPersistence(self, request: Any, version: bytes) -> bool:
        if self.site.closing:
            # The header alone would not do: Twisted would read the next request.
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        if version == b"HTTP/1.1" and _PERSISTENCE_AS_KNOWN and \
                b"Connection" not in request.requestHeaders._rawHeaders:
            return True             # Twisted's answer, without its look for the header
        return bool(super().checkPersistence(request, version))


class ProxySite(Site):
    """The Site; our own access log replaces Twisted's."""

    requestFactory = ProxyRequest
    # Plain HTTP/1.1 channels (no TLS here, so no h2 negotiation to lose).
    protocol = ProxyChannel  # type: ignore[assignment]
    noisy = False
    displayTracebacks = False

    def __init__(self, root: Resource, max_body_bytes: int,
                 reactor: IReactorTime | None = None,
                 timeouts: ClientTimeouts | None = None) -> None:
        # Twisted's inactivity timer is off: the channels run their own (timers.py).
        # Twisted would parse a POST body into `args` by its Content-Type (the
        # email package on every request; a whole multipart body into memory):
        # the proxy never reads `args`.
        super().__init__(root, reactor=reactor, timeout=None, parsePOSTFormSubmission=False)
        self.max_body_bytes = max_body_bytes
        self.timeouts = timeouts or ClientTimeouts()
        self.channels: set[ProxyChannel] = set()
        self.closing = False
        self._changed: list[Deferred[None]] = []
        self._date: PerSecond[bytes] = PerSecond(datetimeToString)

    def log(self, request: http.Request) -> None:
        pass

    def date(self) -> bytes:
        """The Date header's value now (made once a second)."""
        return self._date(self.reactor.seconds())

    def unserved(self) -> list[ProxyChannel]:
        """Connections whose first request has not arrived yet."""
        return [c for c in self.channels if c.unserved]

    def changed(self) -> Deferred[None]:
        """Fires when a connection next hands a request over or closes."""
        d: Deferred[None] = Deferred()
        self._changed.append(d)
        return d

    def channel_changed(self) -> None:
        waiters, self._changed = self._changed, []
        for d in waiters:
            d.callback(None)

    async def drained(self, idle: Callable[[], Deferred[None]], grace: float) -> None:
        """Once no request is in flight (`idle` fires) and no connection waits for
        its first request. A connection accepted just before admission stopped
        may not have delivered its request yet: it gets `grace` seconds for it
        (the request is then served like any other), then it is closed. Every
        wait ends on an event: the last request ending, or a connection changing."""
        grace_end = self.reactor.seconds() + grace
        while True:
            await idle()
            left = grace_end - self.reactor.seconds()
            if not self.unserved() or left <= 0:
                break
            await within(self.reactor, self.changed(), left)
        for channel in self.unserved():
            channel.loseConnection()

    async def closed(self, seconds: float) -> bool:
        """Wait until every connection is gone (their last bytes flushed), at most
        `seconds`; whether they all are. For the end of a stop: a process that
        exits in the turn it closed them would never send what is buffered."""
        deadline = self.reactor.seconds() + seconds
        while self.channels:
            left = deadline - self.reactor.seconds()
            if left <= 0:
                return False
            await within(self.reactor, self.changed(), left)
        return True

    def start_closing(self) -> int:
        """From now on every response closes its connection; idle keep-alive
        connections are closed now (a connection still waiting for its first
        request is not: its request is served, with `Connection: close`).
        Returns how many were closed."""
        self.closing = True
        idle = [c for c in self.channels if c.idle]
        for channel in self.channels:
            # A connection busy with a request closes once it is answered. Not a
            # fresh one: HTTPChannel drops every byte that arrives on a
            # non-persistent connection between requests, its first request
            # included; its checkPersistence says close when that request comes.
            if channel.requests:
                channel.persistent = False
        for channel in idle:
            channel.loseConnection()
        return len(idle)


