"""Responses sent in the turn they are written (see sendnow.py): a request's
head, each chunk's frame and its data, and the last chunk each go out as one
send; the next piece of a relayed stream skips Twisted's generic write path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.web import http
from twisted.web.server import Request

from llmproxy.web.sendnow import send_now


class GatheringChannel(http.HTTPChannel):
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
        out = [version, b" ", code, b" ", reason, b"\r\n"]
        for name, values in headers.getAllRawHeaders():
            for value in values:
                out += (name, b": ", value, b"\r\n")
        out.append(b"\r\n")
        self.write(b"".join(out))

    def write(self, data: bytes) -> None:
        if self._gathered is not None:
            self._gathered.append(data)
        else:
            send_now(self.transport, data)

    def writeSequence(self, iovec: Sequence[bytes]) -> None:
        self.write(b"".join(iovec))


class SendingRequest(Request):
    """A request whose writes go out through a GatheringChannel in one send
    each. `starting()` is called before the head goes out, `counted(size)` for
    every write (what a subclass records)."""

    def starting(self) -> None:
        pass

    def counted(self, size: int) -> None:
        pass

    def write(self, data: bytes) -> None:
        channel = self.channel
        if self.chunked and self.startedWriting and not self._disconnected and \
                not self.finished and isinstance(channel, GatheringChannel) and \
                not channel._gathering:
            # A relayed stream's next piece: framed as a chunk, sent now.
            self.counted(len(data))
            if data:
                self.sentLength += len(data)
                send_now(channel.transport, b"%x\r\n%b\r\n" % (len(data), data))
            return
        if not self.startedWriting:
            self.starting()
        self.counted(len(data))
        if not isinstance(channel, GatheringChannel):
            super().write(data)
            return
        channel.gather()
        try:
            super().write(data)
        finally:
            channel.flush()

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
