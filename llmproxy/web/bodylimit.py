"""A request body over `max_body_bytes`, refused as soon as the proxy knows (its
Content-Length, or the size line of the chunk that would cross the limit):
answered at once (413, see routes), the connection read no further, half-closed
after the answer (over TLS: the TLS close after it) and aborted LINGER_SECONDS
later (a close with unread data would reset it, and a reset can destroy the
answer before the client reads it). The request's part is a mixin
(`BodyLimitRequest`, before Twisted's class in the bases); the connection's is
web/channel.py's ProxyChannel, which provides `IBodyRefusal`.

Twisted's chunked decoder is private, so the channel watches a chunked body's
raw bytes itself, before the decoder reads them (`ChunkSizes`, in the public
`rawDataReceived`): a chunk that declares a size past the limit is refused when
its size line arrives, not after its data (or the body timeout)."""

from __future__ import annotations

from typing import Any

from zope.interface import Interface

from llmproxy.web.requeststate import RequestState

# How long a connection whose body was refused stays half-open for the client
# to read its answer, before it is aborted.
LINGER_SECONDS = 2.0
# Twisted's maxChunkSizeLineLength: a longer size line is its decoder's 400.
MAX_SIZE_LINE = 1024
_HEX = b"0123456789abcdefABCDEF"


def chunk_size(line: bytes) -> int | None:
    """The size a chunk's size line (with its CRLF) declares, its extensions
    ignored; None for a line Twisted's decoder refuses as it reads the size."""
    if not line.endswith(b"\r\n"):
        return None
    digits = line[:-2].partition(b";")[0]
    if not digits or digits.translate(None, _HEX):
        return None
    return int(digits, 16)


class ChunkSizes:
    """The chunk boundaries of a chunked body fed as raw bytes, and what its
    chunks declare in all (`declared`). It only tracks boundaries: a size line,
    then the chunk's data and its CRLF skipped unread, until the last (empty)
    chunk, whose trailers it leaves alone (`done`). A line it cannot read is
    the decoder's to refuse (400): it stops counting (`done`) and never refuses
    for it. It holds one size line at most (MAX_SIZE_LINE + 1 bytes)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.declared = 0
        self.done = False
        self._line = b""        # the size line so far
        self._skip = 0          # data and CRLF left of the current chunk

    def fits(self, data: bytes) -> bool:
        """Whether the body is within the limit once `data`, its next raw bytes,
        is in: False as soon as a whole size line declares a chunk that takes
        `declared` past `limit` (a body of exactly `limit` bytes fits)."""
        at, end = 0, len(data)
        while at < end and not self.done:
            if self._skip:
                step = min(self._skip, end - at)
                self._skip -= step
                at += step
                continue
            # A line longer than Twisted's bound is its decoder's 400: never held.
            room = MAX_SIZE_LINE + 1 - len(self._line)
            eol = data.find(b"\n", at, at + room)
            if eol < 0:
                self._line += data[at:at + room]
                self.done = len(self._line) > MAX_SIZE_LINE
                return True
            line, self._line, at = self._line + data[at:eol + 1], b"", eol + 1
            size = chunk_size(line)
            if size is None or size == 0:
                self.done = True            # the last chunk, or the decoder's 400
            elif self.declared + size > self.limit:
                return False
            else:
                self.declared += size
                self._skip = size + 2
        return True


class IBodyRefusal(Interface):
    """A connection that stops reading a request whose body was refused (an
    HTTP/2 stream's request is refused by web/streams.py instead)."""

    def body_refused(request: BodyLimitRequest) -> None:
        """`request`'s body is over the limit: read no more of it; answer now."""


class BodyLimitRequest:
    """Mixed into the request: refuses a body over its site's max_body_bytes
    (its `state.body_too_large` then says so)."""

    _received = 0
    state: RequestState
    channel: Any
    content: Any
    requestHeaders: Any

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self.body_limit():
            self.refuse_body()
            length = 0
        super().gotLength(length)  # type: ignore[misc]

    def handleContentChunk(self, data: bytes) -> None:
        if self.state.body_too_large:
            return
        self._received += len(data)
        if self._received > self.body_limit():
            self.refuse_body()
            return
        super().handleContentChunk(data)  # type: ignore[misc]

    def refuse_body(self) -> None:
        """The body is over the limit: answered at once, the rest never read."""
        self.state.body_too_large = True
        # Before the channel reads it: no "100 Continue" for a body we refuse.
        self.requestHeaders.removeHeader(b"expect")
        if IBodyRefusal.providedBy(self.channel):
            self.channel.body_refused(self)

    def body_limit(self) -> int:
        """The site's max_body_bytes."""
        site = getattr(self.channel, "site", None)
        return int(getattr(site, "max_body_bytes", 1 << 62))
