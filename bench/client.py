"""The load generator: HTTP/1.1 over asyncio protocols, measured where the client sits.

No HTTP library: a response is parsed by a small state machine over the bytes as they
arrive (status line and headers, then a Content-Length or chunked body), and an event
stream is split on its blank lines. Each read is stamped once (`perf_counter` for
durations, `time.time()` for the lag against the engine's send time in each event).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _UNTIL_CLOSE = range(7)

_DONE = b"data: [DONE]"
_T_FIELD = b'"t":'


@dataclass
class Exchange:
    """One request and what came back."""

    t_sent: float = 0.0
    t_first: float | None = None   # the first complete event (streams) or body byte
    t_done: float | None = None
    status: int = 0
    body_bytes: int = 0
    events: int = 0                # `data:` events before [DONE]
    done: bool = False             # `data: [DONE]` seen
    lags: list[float] | None = None     # per event: received minus its `t` (seconds)
    sent_at: list[float] | None = None  # per event: its `t`, the engine's send time
    error: str | None = None

    @property
    def complete(self) -> bool:
        return self.error is None and self.t_done is not None and self.status == 200


class EventParser:
    """Splits an event stream's body into events; counts them and reads their `t`."""

    def __init__(self, exchange: Exchange, want_lags: bool) -> None:
        self.exchange = exchange
        self.want_lags = want_lags
        self.tail = b""
        if want_lags:
            exchange.lags = [] if exchange.lags is None else exchange.lags
            exchange.sent_at = [] if exchange.sent_at is None else exchange.sent_at

    def feed(self, piece: bytes, now: float, wall: float) -> None:
        """Bytes of the body received at `now` (perf_counter) / `wall` (time.time())."""
        data = self.tail + piece if self.tail else piece
        parts = data.split(b"\n\n")
        self.tail = parts.pop()
        if not parts:
            return
        ex = self.exchange
        if ex.t_first is None:
            ex.t_first = now
        for event in parts:
            if not event.startswith(b"data:"):
                continue          # comments, stray blank lines
            if event == _DONE:
                ex.done = True
                continue
            ex.events += 1
            if self.want_lags:
                i = event.rfind(_T_FIELD)
                if i >= 0:
                    sent = float(event[i + 4:event.find(b"}", i)])
                    assert ex.lags is not None and ex.sent_at is not None
                    ex.lags.append(wall - sent)
                    ex.sent_at.append(sent)


class ResponseParser:
    """One HTTP/1.1 response, parsed from bytes fed in pieces of any size, into an Exchange:
    the status line and headers, then a Content-Length, chunked or until-close body; an
    event stream's body goes through an EventParser."""

    def __init__(self, exchange: Exchange, *, sse: bool, want_lags: bool = False) -> None:
        self.exchange = exchange
        self.events = EventParser(exchange, want_lags) if sse else None
        self.keep_alive = True
        self.finished = False
        self._state = _HEAD
        self._remaining = 0
        self._buf = b""

    def feed(self, data: bytes, now: float,  # noqa: PLR0912, PLR0915
             wall: float = 0.0) -> bytes | None:
        """Parse bytes received at `now`; once the response has ended, the bytes after it
        (usually b""), else None. One loop over the states keeps the per-chunk cost low."""
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        state = self._state
        ex, events = self.exchange, self.events
        while pos < end or state == _TRAILER:
            if state == _HEAD:
                i = buf.find(b"\r\n\r\n", pos)
                if i < 0:
                    break
                state = self._head(buf[pos:i])
                pos = i + 4
                if state == _HEAD:          # no body
                    return self._finish(buf[pos:], now)
            elif state == _CHUNK_SIZE:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                size = int(buf[pos:i].split(b";", 1)[0], 16)
                pos = i + 2
                if size == 0:
                    state = _TRAILER
                else:
                    self._remaining = size
                    state = _CHUNK_DATA
            elif state == _CHUNK_DATA:
                take = min(self._remaining, end - pos)
                self._body(ex, events, buf[pos:pos + take], now, wall)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if end - pos < 2:
                    break
                pos += 2
                state = _CHUNK_SIZE
            elif state == _TRAILER:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                if i == pos:
                    return self._finish(buf[pos + 2:], now)
                pos = i + 2     # a trailer field: ignored
            elif state == _LENGTH:
                take = min(self._remaining, end - pos)
                self._body(ex, events, buf[pos:pos + take], now, wall)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    return self._finish(buf[pos:], now)
            else:  # _UNTIL_CLOSE
                self._body(ex, events, buf[pos:], now, wall)
                pos = end
        self._state = state
        self._buf = buf[pos:] if pos < end else b""
        return None

    def eof(self, now: float, why: str = "by the server") -> None:
        """The connection closed: the end of an until-close body, else an error."""
        if self.finished:
            return
        self.finished = True
        if self._state == _UNTIL_CLOSE:
            self.exchange.t_done = now
        else:
            self.exchange.error = f"connection closed mid-response ({why})"

    @staticmethod
    def _body(ex: Exchange, events: EventParser | None, piece: bytes, now: float,
              wall: float) -> None:
        ex.body_bytes += len(piece)
        if events is not None:
            events.feed(piece, now, wall)
        elif ex.t_first is None and piece:
            ex.t_first = now

    def _head(self, head: bytes) -> int:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        self.exchange.status = int(parts[1])
        length: int | None = None
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            value = value.strip()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif name == "connection" and value.lower() == "close":
                self.keep_alive = False
        if parts[0] == "HTTP/1.0":
            self.keep_alive = False
        if chunked:
            return _CHUNK_SIZE
        if length is not None:
            if length == 0:
                return _HEAD
            self._remaining = length
            return _LENGTH
        self.keep_alive = False
        return _UNTIL_CLOSE

    def _finish(self, rest: bytes, now: float) -> bytes:
        self.finished = True
        self.exchange.t_done = now
        self._buf = b""
        return rest


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._parser: ResponseParser | None = None
        self._future: asyncio.Future[Exchange] | None = None
        self._want_wall = False

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(cls, host, port)
        return protocol

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.closed.done()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.closed.done():
            self.closed.set_result(None)
        if self._parser is not None:
            self._parser.eof(time.perf_counter(), str(exc) if exc else "by the server")
            self._done()

    def request(self, raw: bytes, *, sse: bool,
                want_lags: bool = False) -> asyncio.Future[Exchange]:
        """Send one whole request (bytes); the future fires with its Exchange."""
        loop = asyncio.get_running_loop()
        ex = Exchange()
        future: asyncio.Future[Exchange] = loop.create_future()
        if not self.usable:
            ex.error = "connection closed"
            future.set_result(ex)
            return future
        assert self._parser is None, "one request at a time"
        self._parser = ResponseParser(ex, sse=sse, want_lags=want_lags)
        self._future = future
        self._want_wall = want_lags
        ex.t_sent = time.perf_counter()
        assert self.transport is not None
        self.transport.write(raw)
        return future

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        parser = self._parser
        if parser is None:
            return              # nothing asked: a server's stray bytes
        if parser.feed(data, now, time.time() if self._want_wall else 0.0) is not None:
            if not parser.keep_alive:
                self.close()
            self._done()

    def _done(self) -> None:
        parser, future = self._parser, self._future
        self._parser = self._future = None
        if parser is not None and future is not None and not future.done():
            future.set_result(parser.exchange)


def chat_request(host: str, port: int, *, stream: bool, events: int = 16,
                 rate: float = 0.0, batch: bool = False,
                 path: str = "/v1/chat/completions") -> bytes:
    """The bytes of one `POST` chat completion; X-Bench-* headers shape the engine's stream
    (`batch`: one sequence of the engine's batch of that rate, bench/engine.py)."""
    body = (b'{"model":"bench","stream":%s,"messages":[{"role":"user","content":"hi"}]}'
            % (b"true" if stream else b"false"))
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nAccept: */*\r\n"
            f"Content-Length: {len(body)}\r\n")
    if stream:
        head += f"X-Bench-Events: {events}\r\nX-Bench-Rate: {rate:g}\r\n"
        if batch:
            head += "X-Bench-Batch: 1\r\n"
    return head.encode() + b"\r\n" + body
