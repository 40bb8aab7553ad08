"""A request body over `max_body_bytes`, refused as soon as the proxy knows (its
Content-Length, or the chunk that crosses the limit): answered at once (413, see
routes), the connection read no further, half-closed after the answer and
aborted LINGER_SECONDS later (a close with unread data would reset it, and a
reset can destroy the answer before the client reads it). Two mixins: one for
the request, one for its channel, each before Twisted's class in the bases."""

from __future__ import annotations

from typing import Any

from twisted.internet.interfaces import IDelayedCall

# How long a connection whose body was refused stays half-open for the client
# to read its answer, before it is aborted.
LINGER_SECONDS = 2.0


class BodyLimitRequest:
    """Mixed into the request: refuses a body over its site's max_body_bytes."""

    body_too_large = False
    _received = 0
    channel: Any
    content: Any
    requestHeaders: Any

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self.body_limit():
            self._refuse_body()
            length = 0
        super().gotLength(length)  # type: ignore[misc]

    def handleContentChunk(self, data: bytes) -> None:
        if self.body_too_large:
            return
        self._received += len(data)
        if self._received > self.body_limit():
            self._refuse_body()
            return
        super().handleContentChunk(data)  # type: ignore[misc]

    def _refuse_body(self) -> None:
        self.body_too_large = True
        # Before the channel reads it: no "100 Continue" for a body we refuse.
        self.requestHeaders.removeHeader(b"expect")
        if isinstance(self.channel, BodyLimitChannel):
            self.channel.body_refused(self)

    def body_limit(self) -> int:
        """The site's max_body_bytes."""
        site = getattr(self.channel, "site", None)
        return int(getattr(site, "max_body_bytes", 1 << 62))


class BodyLimitChannel:
    """Mixed into the HTTP channel: reads no more of a connection whose
    request's body was refused, and lingers half-closed after the answer."""

    _refusing: BodyLimitRequest | None = None   # its body is over the limit: answered, then closed
    _linger: IDelayedCall | None = None
    transport: Any
    persistent: int
    length: int | None
    requests: list[Any]
    callLater: Any

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
        if not getattr(request, "dispatched", False) and self.requests and \
                self.requests[-1] is request:
            self.allContentReceived()  # type: ignore[attr-defined]

    def loseConnection(self) -> None:
        if self._refusing is None:
            return super().loseConnection()  # type: ignore[misc, no-any-return]
        if self._linger is not None:
            return None
        # The client may still be sending the body we refused: a close with
        # unread data resets the connection, and a reset can destroy the 413
        # before the client reads it. Half-close after the answer instead, read
        # nothing more, and abort after LINGER_SECONDS.
        transport: Any = self.transport
        transport.unregisterProducer()
        transport.pauseProducing()
        transport.loseWriteConnection()
        self._linger = self.callLater(LINGER_SECONDS, transport.abortConnection)
        return None

    def stop_lingering(self) -> None:
        """The connection is gone: no abort is left pending for it."""
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
