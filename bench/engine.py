"""A fast OpenAI-shaped engine for the benchmark: plain asyncio, HTTP/1.1 keep-alive.

It must never be what limits a figure (direct, it serves well over 80,000 events/s on
2 cores), so it parses only what it needs and builds its answers from byte templates.

- `GET /v1/models` lists the one model `bench` (llmproxy reads it as the host's roster).
- `POST /v1/chat/completions` (any `POST /v1/*`) with a JSON body: when the body says
  `"stream": true`, a `text/event-stream` in chunked transfer encoding, one chunk per
  event `data: {...}\\n\\n`, ending with `data: [DONE]`; otherwise a small
  `chat.completion` JSON with a Content-Length.
- Per request headers choose the stream: `X-Bench-Events: n` content events (default 16),
  `X-Bench-Rate: r` events per second per stream (default 0: as fast as the connection
  takes them, in batches). A paced stream writes each event on its own, on a fixed
  schedule from the request's arrival (no drift), and each event carries the engine's
  send time as its last field, `"t":<time.time()>`, for the client to compute the lag.
  With `X-Bench-Batch: 1` as well, the stream is one sequence of a batch, as a batched
  engine (llama-server `-np N`, vLLM) runs them: one decode step per interval for every
  batched stream of that rate, writing one event to each in the same step (`_Batch`); a
  stream joins at the next step, whose first event carries the response head.

Run it as `python -m bench.engine --port 0`; it prints `bench engine listening on
127.0.0.1:PORT` once it accepts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from typing import ClassVar

MODEL = "bench"
BATCH = 32  # unpaced streams: events per write

_MODELS_BODY = json.dumps({
    "object": "list",
    "data": [{"id": MODEL, "object": "model", "owned_by": "bench", "context_length": 4096}],
}).encode()

_COMPLETION_BODY = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello from bench."},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12},
}).encode()

_EVENT_PREFIX = (b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk",'
                 b'"created":1700000000,"model":"bench","choices":[{"index":0,'
                 b'"delta":{"content":"tok "},"finish_reason":null}],"t":')
_DONE_CHUNK = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"

_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")


def event_chunk(t: float) -> bytes:
    """One SSE event as one HTTP chunk; `t` (seconds, 6 decimals) is its last JSON field."""
    payload = _EVENT_PREFIX + (b"%.6f}\n\n" % t)
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _plain(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (status.encode(), ctype, len(body), body))


_MODELS_RESPONSE = _plain("200 OK", _MODELS_BODY)
_COMPLETION_RESPONSE = _plain("200 OK", _COMPLETION_BODY)
_NOT_FOUND = _plain("404 Not Found", b'{"error": {"message": "not found", "code": 404}}')
_BAD_REQUEST = _plain("400 Bad Request", b'{"error": {"message": "bad request", "code": 400}}')


class EngineProtocol(asyncio.Protocol):
    """One client connection: requests answered one at a time, kept alive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False        # a stream is being written
        self.closing = False
        self._writable: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.transport = None
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._serve()

    def _serve(self) -> None:
        """Answer every complete request in the buffer (a stream stops the loop)."""
        while not self.busy and self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            try:
                method, path, _ = head[0].split(" ", 2)
            except ValueError:
                self._close_with(_BAD_REQUEST)
                return
            headers: dict[str, str] = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or "0")
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            if headers.get("connection", "").lower() == "close":
                self.closing = True
            self._answer(method, path.split("?", 1)[0], headers, body)
            if self.closing and not self.busy and self.transport is not None:
                self.transport.close()

    def _close_with(self, response: bytes) -> None:
        assert self.transport is not None
        self.transport.write(response)
        self.transport.close()

    def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        assert self.transport is not None
        if method == "GET" and path in ("/v1/models", "/models"):
            self.transport.write(_MODELS_RESPONSE)
            return
        if method == "GET" and path == "/health":
            self.transport.write(_plain("200 OK", b'{"status": "ok"}'))
            return
        if method != "POST" or not path.startswith("/v1/"):
            self.transport.write(_NOT_FOUND)
            return
        try:
            doc = json.loads(body)
        except ValueError:
            self.transport.write(_BAD_REQUEST)
            return
        if not (isinstance(doc, dict) and doc.get("stream") is True):
            self.transport.write(_COMPLETION_RESPONSE)
            return
        events = int(headers.get("x-bench-events", "16"))
        rate = float(headers.get("x-bench-rate", "0"))
        self.busy = True
        if rate > 0 and headers.get("x-bench-batch") == "1":
            _Batch.of(rate).join(self, events)
        elif rate > 0:
            _PacedStream(self, events, rate).start()
        else:
            asyncio.get_running_loop().create_task(self._unpaced(events))

    async def _unpaced(self, events: int) -> None:
        """Events as fast as the connection takes them, BATCH per write."""
        sent = 0
        first = True
        while sent < events and self.transport is not None:
            if self._paused:
                self._writable = asyncio.get_running_loop().create_future()
                await self._writable
                continue
            n = min(BATCH, events - sent)
            now = time.time()
            data = b"".join([event_chunk(now)] * n)
            self.transport.write(_STREAM_HEAD + data if first else data)
            first = False
            sent += n
            await asyncio.sleep(0)  # let the other streams have their turn
        self.stream_done(head_sent=not first)

    def stream_done(self, head_sent: bool = True) -> None:
        """The last event was written: end the stream, go on with the next request."""
        if self.transport is not None:
            self.transport.write(_DONE_CHUNK if head_sent else _STREAM_HEAD + _DONE_CHUNK)
        self.busy = False
        if self.closing:
            if self.transport is not None:
                self.transport.close()
            return
        if self.buf:
            self._serve()


class _PacedStream:
    """Writes one event at each tick of a fixed schedule, on loop timers (no task)."""

    def __init__(self, conn: EngineProtocol, events: int, rate: float) -> None:
        self.conn = conn
        self.events = events
        self.interval = 1.0 / rate
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.sent = 0

    def start(self) -> None:
        transport = self.conn.transport
        assert transport is not None
        if self.events <= 0:
            self.conn.stream_done(head_sent=False)
            return
        transport.write(_STREAM_HEAD + event_chunk(time.time()))
        self.sent = 1
        self._next()

    def _next(self) -> None:
        if self.sent >= self.events:
            self.conn.stream_done()
        else:
            self.loop.call_at(self.t0 + self.sent * self.interval, self._tick)

    def _tick(self) -> None:
        transport = self.conn.transport
        if transport is None:   # the client went away
            self.conn.busy = False
            return
        transport.write(event_chunk(time.time()))
        self.sent += 1
        self._next()


class _Batch:
    """The batched streams of one rate: a step every `1/rate` seconds on a fixed grid
    (no drift) writes the next event of every member, in one callback, all stamped with
    the step's time; it stops when no stream is left. One per rate (`of`)."""

    _running: ClassVar[dict[float, _Batch]] = {}

    @classmethod
    def of(cls, rate: float) -> _Batch:
        batch = cls._running.get(rate)
        if batch is None:
            batch = cls._running[rate] = cls(rate)
        return batch

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.interval = 1.0 / rate
        self.loop = asyncio.get_running_loop()
        self.members: dict[EngineProtocol, int] = {}   # events left to send
        self.joining: dict[EngineProtocol, int] = {}   # head not sent yet
        self.t0 = self.loop.time()
        self.steps = 0
        self._scheduled = False

    def join(self, conn: EngineProtocol, events: int) -> None:
        if events <= 0:
            conn.stream_done(head_sent=False)
            return
        self.joining[conn] = events
        if not self._scheduled:
            # The first step of an idle batch is now: a new sequence starts decoding.
            self.t0, self.steps = self.loop.time(), 0
            self._scheduled = True
            self.loop.call_soon(self._step)

    def _step(self) -> None:
        chunk = event_chunk(time.time())
        done = []
        for conn, left in self.members.items():
            transport = conn.transport
            if transport is None:       # the client went away
                conn.busy = False
                done.append(conn)
                continue
            transport.write(chunk)
            if left == 1:
                done.append(conn)
            else:
                self.members[conn] = left - 1
        joining, self.joining = self.joining, {}
        for conn, left in joining.items():
            if conn.transport is None:
                conn.busy = False
                continue
            conn.transport.write(_STREAM_HEAD + chunk)
            if left == 1:
                conn.stream_done()
            else:
                self.members[conn] = left - 1
        for conn in done:
            del self.members[conn]
            if conn.transport is not None:
                conn.stream_done()
        if not self.members and not self.joining:
            self._scheduled = False
            del _Batch._running[self.rate]
            return
        self.steps += 1
        self.loop.call_at(self.t0 + self.steps * self.interval, self._step)


async def serve(host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(EngineProtocol, host, port, backlog=4096)
    bound = server.sockets[0].getsockname()
    print(f"bench engine listening on {bound[0]}:{bound[1]}", flush=True)
    stop: asyncio.Future[None] = loop.create_future()

    def on_signal() -> None:
        if not stop.done():
            stop.set_result(None)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop
    server.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.engine [--host H] [--port P]`."""
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split(
        "\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
