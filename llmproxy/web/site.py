"""The Site and its connections: a request that counts what it writes into its
record and stops keeping an oversized body; channels the site tracks so a stop
can close the idle ones and make the busy ones close after their response."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from llmproxy.core.timing import within
from llmproxy.web.headerlimits import HeaderLimits

if TYPE_CHECKING:
    from llmproxy.observe.requests import Exchange


class ProxyRequest(Request):
    """A request that stops keeping its body once it passes max_body_bytes, says
    `Connection: close` on a response that starts while the proxy stops, and
    counts every byte it writes into its record (`exchange`)."""

    body_too_large = False
    exchange: Exchange | None = None
    _received = 0
    _content_type: Sequence[bytes] | None = None

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        # Twisted parses a POST body into `args` by its Content-Type (through the
        # email package, on every request; a whole multipart body into memory).
        # The proxy never reads `args`: the header is held back while Twisted
        # looks, and put back before the request is processed.
        if command == b"POST":
            self._content_type = self.requestHeaders.getRawHeaders(b"content-type")
            if self._content_type is not None:
                self.requestHeaders.removeHeader(b"content-type")
        super().requestReceived(command, path, version)

    def process(self) -> None:
        # The whole request is in: from now on it is an exchange in flight. The
        # drain hears of it once the exchange is registered (after process()),
        # and from the channel as it was (a finished request lets go of it).
        if self._content_type is not None:
            self.requestHeaders.setRawHeaders(b"content-type", list(self._content_type))
            self._content_type = None
        channel = self.channel
        super().process()
        if isinstance(channel, ProxyChannel):
            channel.dispatched += 1
            channel.site.channel_changed()

    def write(self, data: bytes) -> None:
        if not self.startedWriting and getattr(self.channel, "closing", False):
            self.setHeader(b"connection", b"close")
            self.channel.persistent = False
        if self.exchange is not None:
            self.exchange.wrote(self.code, len(data))
        super().write(data)

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self._limit():
            self.body_too_large = True
            length = 0
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        self._received += len(data)
        if self._received > self._limit():
            self.body_too_large = True
        if not self.body_too_large:
            super().handleContentChunk(data)

    def _limit(self) -> int:
        site = getattr(self.channel, "site", None)
        return int(getattr(site, "max_body_bytes", 1 << 62))


class ProxyChannel(HeaderLimits, http.HTTPChannel):
    """An HTTP/1.1 connection the site keeps track of, so a stop can close the
    idle ones and make the busy ones close after their current response."""

    site: ProxySite
    dispatched = 0      # requests on this connection handed to the resource so far

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

    def connectionMade(self) -> None:
        super().connectionMade()
        self.site.channels.add(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.site.channels.discard(self)
        super().connectionLost(reason)
        self.site.channel_changed()

    def checkPersistence(self, request: Any, version: bytes) -> bool:
        if self.site.closing:
            # The header alone would not do: Twisted would read the next request.
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        return bool(super().checkPersistence(request, version))


class ProxySite(Site):
    """The Site; our own access log replaces Twisted's."""

    requestFactory = ProxyRequest
    # Plain HTTP/1.1 channels (no TLS here, so no h2 negotiation to lose).
    protocol = ProxyChannel  # type: ignore[assignment]
    noisy = False
    displayTracebacks = False

    def __init__(self, root: Resource, max_body_bytes: int,
                 reactor: IReactorTime | None = None) -> None:
        super().__init__(root, reactor=reactor)
        self.max_body_bytes = max_body_bytes
        self.channels: set[ProxyChannel] = set()
        self.closing = False
        self._changed: list[Deferred[None]] = []

    def log(self, request: http.Request) -> None:
        pass

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


