"""Which HTTP a TLS connection speaks, as ALPN chose it: once the handshake is
done, `h2` gets an HTTP/2 connection (Twisted's, llmproxy.compat.goaway),
anything else the site's HTTP/1.1 channel. The handshake itself is bounded by
the client header timeout (no channel, with its timers, exists before it).
Once the protocol asked for the close (`loseConnection`), what the client
still sends is dropped: over TLS the close waits for the client's
close_notify, and a client may go on sending meanwhile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IAddress, IDelayedCall, IHandshakeListener, IReactorTime
from twisted.internet.protocol import Protocol, ServerFactory, connectionDone
from twisted.python.failure import Failure
from twisted.web.server import Site
from zope.interface import implementer

H2 = b"h2"


@implementer(IHandshakeListener)
class NegotiatedConnection(Protocol):
    """One TLS connection: the protocol ALPN chose, made once the handshake is
    done; every byte after it goes there."""

    def __init__(self, factory: NegotiatingFactory, addr: IAddress | None) -> None:
        self._factory = factory
        self._addr = addr
        self.inner: Any = None
        self._handshake: IDelayedCall | None = None

    def connectionMade(self) -> None:
        seconds = self._factory.handshake_seconds
        self._handshake = self._factory.clock.callLater(seconds, self._too_slow)

    def _too_slow(self) -> None:
        self._handshake = None
        transport: Any = self.transport
        if transport is not None:
            transport.abortConnection()

    def handshakeCompleted(self) -> None:
        if self._handshake is not None and self._handshake.active():
            self._handshake.cancel()
        self._handshake = None
        chosen = getattr(self.transport, "negotiatedProtocol", None)
        self.inner = self._factory.protocol_for(chosen, self._addr)
        self.inner.makeConnection(self.transport)

    def dataReceived(self, data: bytes) -> None:
        if self.inner is not None and not getattr(self.transport, "disconnecting", False):
            self.inner.dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._handshake is not None and self._handshake.active():
            self._handshake.cancel()
        if self.inner is not None:
            self.inner.connectionLost(reason)


class NegotiatingFactory(ServerFactory):
    """What the TLS listener wraps: `site` for HTTP/1.1; `http2()`, a new
    HTTP/2 connection, for a client that chose h2 (None: h2 is not offered)."""

    noisy = False

    def __init__(self, site: Site, http2: Callable[[], Protocol] | None,
                 clock: IReactorTime, handshake_seconds: float) -> None:
        self.site = site
        self.http2 = http2
        self.clock = clock
        self.handshake_seconds = handshake_seconds

    def buildProtocol(self, addr: IAddress | None) -> NegotiatedConnection:
        return NegotiatedConnection(self, addr)

    def protocol_for(self, chosen: bytes | None, addr: IAddress | None) -> Any:
        if chosen == H2 and self.http2 is not None:
            return self.http2()
        return self.site.buildProtocol(addr)

    def logPrefix(self) -> str:
        return str(self.site.logPrefix())

    def startFactory(self) -> None:
        self.site.doStart()

    def stopFactory(self) -> None:
        self.site.doStop()
