"""The response_writes speedup: responses sent in the turn they are written
(see socketwrites.py): a request's head, each chunk's frame and its data, and the
last chunk each go out as one send; the next piece of a relayed stream skips
Twisted's generic write path. And the write stall sees a slow reader's
progress: how much the transport still holds (`unsent_bytes`), which Twisted
does not say publicly.

The first write's head is made as Twisted 26.10's Request.write (server's, then
http's) and HTTPChannel.writeHeaders make it; the guard compares the source of
each (SOURCES) and of the TCP transport send_now rests on (socketwrites.guard), and
tests/test_writes.py puts both ways' bytes side by side.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from twisted.web.http import NO_BODY_CODES

from llmproxy.speedups import Speedup, socketwrites
from llmproxy.speedups.guards import changed_sources
from llmproxy.speedups.socketwrites import send_now
from llmproxy.web.channel import ProxyChannel
from llmproxy.web.site import ProxyRequest

# What this copies, or does in place of, as Twisted 26.10 has it.
SOURCES = {
    "twisted.web.http.HTTPChannel.writeHeaders": "3521e56c0fe24bc2",
    "twisted.web.http.HTTPChannel.write": "054334c7d19259b3",
    "twisted.web.http.HTTPChannel.writeSequence": "06492eb61e8f8b80",
    "twisted.web.http.Request.write": "0e547d4f76bd1472",
    "twisted.web.http.Request.finish": "4590c5f7e2207ef0",
    "twisted.web.http.Request.connectionLost": "e874acaf9f19205d",
    "twisted.web.server.Request.write": "e0629de84fb9e31d",
    "twisted.web.server.Request.finish": "2d92e6905246806d",
    "twisted.web.server.Request.render": "b09da284935ed06f",
}


def guard() -> str | None:
    """None when the installed Twisted writes a response, and its TCP transport
    buffers, as this follows (Twisted 26.10)."""
    return changed_sources(SOURCES) or socketwrites.guard()


SPEEDUP = Speedup(
    "response_writes", "a response's head, each chunk and its end go out in one send "
    "each, in the turn they are written; the write stall sees a slow reader's progress",
    guard)


def unsent_bytes(transport: Any) -> int | None:
    """What a Twisted socket transport still holds for its peer; None when the
    transport does not say (these are `abstract.FileDescriptor`'s buffers)."""
    try:
        return int(len(transport.dataBuffer) - transport.offset + transport._tempDataLen)
    except (AttributeError, TypeError):
        return None


_VERSIONS = (b"HTTP/1.1", b"HTTP/1.0")


def _head(version: bytes, code: bytes, reason: bytes,
          headers: Iterable[tuple[bytes, Sequence[bytes]]]) -> list[bytes]:
    """A response head's pieces: the status line, a line per header value, the
    blank line."""
    out = [version, b" ", code, b" ", reason, b"\r\n"]
    for name, values in headers:
        for value in values:
            out += (name, b": ", value, b"\r\n")
    out.append(b"\r\n")
    return out


class GatheringChannel(ProxyChannel):
    """An HTTP connection whose writes are sent now; between `gather` and the
    matching `flush` they are held, to go out as one."""

    _gathered: list[bytes] | None = None
    _gathering = 0

    def gather(self) -> None:
        """Hold the writes until the matching `flush`, to send them as one."""
        if not self._gathering:
            self._gathered = []
        self._gathering += 1

    def flush(self) -> None:
        self._gathering -= 1
        if self._gathering:
            return
        gathered, self._gathered = self._gathered, None
        if gathered:
            send_now(self.transport, gathered[0] if len(gathered) == 1 else b"".join(gathered))

    def writeHeaders(self, version: bytes, code: bytes, reason: bytes, headers: Any) -> None:
        self.write(b"".join(_head(version, code, reason, headers.getAllRawHeaders())))

    def write(self, data: bytes) -> None:
        if self._gathered is not None:
            self._gathered.append(data)
        else:
            send_now(self.transport, data)

    def writeSequence(self, iovec: Sequence[bytes]) -> None:
        self.write(b"".join(iovec))

    def unsent(self) -> int | None:
        return unsent_bytes(self.transport)


class SendingRequest(ProxyRequest):
    """A request whose writes go out through a GatheringChannel in one send
    each; `starting()` is called before the head goes out, `counted(size)` for
    every write, as ProxyRequest calls them."""

    def send_piece(self, data: bytes) -> bool:
        """The next piece of a chunked response already under way (a relayed
        stream's next event), framed as a chunk and sent now; False when `data`
        is not such a piece (nothing written: `write` it). What it sends is
        not `counted`: the caller counts it."""
        if not (self.chunked and self.startedWriting):
            return False      # not framed for nothing: the head, or a body by its length
        return self.send_chunk(b"%x\r\n%b\r\n" % (len(data), data) if data else b"", len(data))

    def stream_transport(self) -> Any:
        """Where this response's next chunks may go as they are framed (sent
        with `send_now`, their data counted in `sentLength`): the channel's
        transport while the response is chunked, under way and not held (see
        GatheringChannel); None otherwise. It stays so until the response
        finishes or its connection is lost, but for the moments the channel
        holds its writes (`channel._gathering`, within a write or a finish)."""
        channel = self.channel
        if self.chunked and self.startedWriting and not self._disconnected and \
                not self.finished and isinstance(channel, GatheringChannel) and \
                not channel._gathering:
            return channel.transport
        return None

    def send_chunk(self, framed: bytes, size: int) -> bool:
        """`send_piece` for a piece already framed as a chunk (a size line, `size`
        bytes of data, CRLF; nothing when `size` is 0), sent as it is (see
        `stream_transport`)."""
        transport = self.stream_transport()
        if transport is None:
            return False
        if size:
            self.sentLength += size
            send_now(transport, framed)
        return True

    def write(self, data: bytes) -> None:
        if self.send_piece(data):
            self.counted(len(data))
            return
        channel = self.channel
        if not isinstance(channel, GatheringChannel):
            super().write(data)     # ProxyRequest's: starting, counted, Twisted's write
            return
        if not self.startedWriting and self._plain_head():
            self.starting()
            self.counted(len(data))
            channel.write(self._head_and(data))
            return
        channel.gather()
        try:
            super().write(data)
        finally:
            channel.flush()

    def _plain_head(self) -> bool:
        """Whether the head is one `_head_and` writes as Twisted would: a GET or
        POST answer with a body, over HTTP/1.x, with none of the extras
        Twisted's first write handles (Last-Modified, ETag, cookies, an encoder,
        a HEAD request answered as a GET)."""
        return not self.finished and not self._disconnected and \
            self.code not in NO_BODY_CODES and self.method != b"HEAD" and \
            self.clientproto in _VERSIONS and self._encoder is None and \
            not self._inFakeHead and self.lastModified is None and \
            self.etag is None and not self.cookies

    def _head_and(self, data: bytes) -> bytes:
        """The first write, as Twisted's Request.write (server's, then http's)
        makes it, in one pass: the default Content-Type, chunked framing when
        an HTTP/1.1 response has no Content-Length, the status line, the
        headers in their order, and `data`."""
        raw = self.responseHeaders._rawHeaders
        length = raw.get(b"Content-Length")
        if b"Content-Type" not in raw and self.defaultContentType is not None and \
                not (length and length[0] == b"0"):
            raw[b"Content-Type"] = [self.defaultContentType]
        self.startedWriting = 1
        if self.clientproto == b"HTTP/1.1" and length is None:
            raw[b"Transfer-Encoding"] = [b"chunked"]
            self.chunked = 1
        out = _head(self.clientproto, b"%d" % self.code, self.code_message, raw.items())
        if data:
            self.sentLength += len(data)
            if self.chunked:
                out += (b"%x\r\n" % len(data), data, b"\r\n")
            else:
                out.append(data)
        return b"".join(out)

    def finish(self) -> None:
        channel = self.channel
        if isinstance(channel, GatheringChannel) and not self._disconnected and \
                not self.finished:
            # The head (if nothing was written) and the last chunk in one send,
            # before Twisted lets go of the connection (a TLS transport drops
            # what is written after its close).
            channel.gather()
            try:
                if not self.startedWriting:
                    self.write(b"")
                if self.chunked:
                    channel.write(b"0\r\n\r\n")
                    self.chunked = 0
            finally:
                channel.flush()
        super().finish()
