"""The Site and its connections, on public Twisted alone (the reference path;
llmproxy/speedups/ holds the faster ones, llmproxy/speedups/site.py picks):
a request that counts what it writes into its record and refuses an oversized
body as soon as it knows (before reading it); channels the site tracks so a
stop can close the idle ones and make the busy ones close after their response,
each a ProxyChannel (channel.py: its client timers, its head limits and its
body limit, every override of Twisted's HTTPChannel listed there). HTTP/2
connections (Twisted's own, on the TLS listener by ALPN; llmproxy.compat.goaway)
are known to the site too (`multiplexed`): a stop tells each to drain, and waits
for it to close; their streams are judged from their headers (streams.py: door,
body limit, body timer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.http import datetimeToString
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request, Site

from llmproxy.core.clockwaits import PerSecond, within
from llmproxy.web.bodylimit import BodyLimitRequest
from llmproxy.web.channel import ProxyChannel
from llmproxy.web.errors import reason
from llmproxy.web.headerlimits import over_limits, refusal_body
from llmproxy.web.requeststate import WithState
from llmproxy.web.streams import Door, StreamBodyFile, StreamRequest, Streams
from llmproxy.web.timers import ClientTimeouts


class Multiplexed(Protocol):
    """An HTTP/2 connection as the site drives it at a stop."""

    finished: bool     # done with its streams after its last GOAWAY: closing

    def start_draining(self) -> None:
        """The stop begins: no new streams from now on, as the connection can say it."""

    def close_when_idle(self) -> None:
        """No request is in flight: close, if it does not close by itself."""


class ProxyRequest(StreamRequest, BodyLimitRequest, StreamBodyFile, WithState, Request):
    """A request that refuses a body over max_body_bytes as soon as it knows
    (its Content-Length, or the size line of a chunk that would cross it), says
    `Connection: close` on a response that starts while the proxy stops, and
    counts every byte it writes into its exchange. What the proxy knows of it
    is its `state` (web/requeststate.py)."""

    def process(self) -> None:
        # The whole request is in: from now on it is an exchange in flight. The
        # drain hears of it once the exchange is registered (after serve()),
        # and from the channel as it was (a finished request lets go of it).
        channel = self.channel
        self.state.dispatched = True
        super().process()
        if isinstance(channel, ProxyChannel):
            channel.dispatched += 1
            channel.site.channel_changed()

    def render(self, resrc: IResource) -> None:
        # Twisted's process() dated the response by the wall clock; the site's
        # Date is the reactor's time (made once a second).
        date = getattr(self.site, "date", None)
        if date is not None:
            self.responseHeaders.setRawHeaders(b"Date", [date()])
        super().render(resrc)

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        # Twisted's table lacks some statuses the proxy sends (424, 429, 431):
        # every status line carries its standard reason phrase, on both paths
        # (the speedups' response head writes this same code_message).
        super().setResponseCode(code, message or reason(code))

    def write(self, data: bytes) -> None:
        if not self.startedWriting:
            self.starting()
        self.counted(len(data))
        super().write(data)

    def connectionLost(self, reason: Failure) -> None:
        self.state.client_gone = True
        super().connectionLost(reason)

    def starting(self) -> None:
        """Before the response's head is written."""
        if getattr(self.channel, "closing", False):
            self.setHeader(b"connection", b"close")
            self.channel.persistent = False

    def counted(self, size: int) -> None:
        """`size` bytes of the response written (into its exchange)."""
        exchange = self.state.exchange
        if exchange is not None:
            exchange.wrote(self.code, size)


class ProxySite(Site):
    """The Site; our own access log replaces Twisted's."""

    requestFactory = ProxyRequest
    # HTTP/1.1 channels: HTTP/2 comes by ALPN on the TLS listener, which
    # builds its connections itself (lifecycle/negotiation.py).
    protocol = ProxyChannel  # type: ignore[assignment]
    noisy = False
    displayTracebacks = False

    def __init__(self, root: Resource, max_body_bytes: int,
                 reactor: IReactorTime | None = None,
                 timeouts: ClientTimeouts | None = None, door: Door | None = None) -> None:
        # Twisted's inactivity timer is off: the channels run their own (timers.py).
        # Twisted would parse a POST body into `args` by its Content-Type (the
        # email package on every request; a whole multipart body into memory):
        # the proxy never reads `args`.
        super().__init__(root, reactor=reactor, timeout=None, parsePOSTFormSubmission=False)
        self.max_body_bytes = max_body_bytes
        self.timeouts = timeouts or ClientTimeouts()
        # An HTTP/2 stream's request is judged when its headers arrive (web/streams.py).
        self.streams = Streams(door, self.reactor, self.timeouts.body)
        self.channels: set[ProxyChannel] = set()
        self.multiplexed: set[Multiplexed] = set()      # HTTP/2 connections
        self.closing = False
        self._changed: list[Deferred[None]] = []
        self._date: PerSecond[bytes] = PerSecond(datetimeToString)

    def log(self, request: http.Request) -> None:
        pass

    def stream_opened(self, request: ProxyRequest, method: bytes, uri: bytes,
                      body_follows: bool) -> None:
        """An HTTP/2 stream's headers are in (llmproxy.compat.streamhooks)."""
        self.streams.opened(request, method, uri, body_follows)

    def stream_ending(self, request: ProxyRequest) -> bool:
        """An HTTP/2 stream's client ended its side: whether its request is
        dispatched now (not when it was answered before its body ended)."""
        return self.streams.ending(request)

    def date(self) -> bytes:
        """The Date header's value now (made once a second)."""
        return self._date(self.reactor.seconds())

    def multiplexed_opened(self, connection: Multiplexed) -> None:
        """An HTTP/2 connection began (after a stop began, it drains at once)."""
        self.multiplexed.add(connection)
        if self.closing:
            connection.start_draining()

    def multiplexed_closed(self, connection: Multiplexed) -> None:
        self.multiplexed.discard(connection)
        self.channel_changed()

    def refused_head(self, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """For an HTTP/2 request: the JSON body of its 431 when its headers are
        over the limits the HTTP/1.1 channel holds a head to, else None."""
        channel = self.protocol
        why = over_limits(headers, channel.maxHeaders, channel.totalHeadersSize)
        return None if why is None else refusal_body(why)

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
        (the request is then served like any other), then it is closed. An
        HTTP/2 connection is waited for until it closes: it does once its last
        stream ends after its final GOAWAY (or, with only Twisted's GOAWAY, when
        told that no request is in flight), and `closed` waits for the close
        to reach the client. Every wait ends on an event: the last request
        ending, or a connection changing."""
        grace_end = self.reactor.seconds() + grace
        while True:
            await idle()
            for connection in list(self.multiplexed):
                connection.close_when_idle()
            left = grace_end - self.reactor.seconds()
            if self.unserved() and left > 0:
                await within(self.reactor, self.changed(), left)
            elif any(not connection.finished for connection in self.multiplexed):
                await self.changed()
            else:
                break
        for channel in self.unserved():
            channel.loseConnection()

    async def closed(self, seconds: float) -> bool:
        """Wait until every connection is gone (their last bytes flushed), at most
        `seconds`; whether they all are. For the end of a stop: a process that
        exits in the turn it closed them would never send what is buffered."""
        deadline = self.reactor.seconds() + seconds
        while self.channels or self.multiplexed:
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
        for connection in list(self.multiplexed):
            connection.start_draining()
        return len(idle)


