"""`GET /api/events`: every hub event as a Server-Sent Event, live, with replay.

The event log numbers each event (`id:`, increasing across upgrades and
restarts: a process's ids start at a million per second of its start time, so
a later process's ids are above every id of an earlier one) and keeps the last
1,000 for clients that reconnect with `Last-Event-ID`; an id it no longer has
(or one from another process) gets a `reset` event: re-read `/status`.

A stream is not a request in flight: it never holds a drain open. When the
stop begins, each stream gets that `stop` event and is then ended. A client
that does not read is paused by its transport; what is sent meanwhile queues
here, and past 1 MiB the client is dropped, so a stalled reader costs bounded
memory and never slows whoever published. How many streams run at once is
`streams`: the dispatch refuses one more past `max_event_subscribers`.

A stream whose client may not read engine logs (see `web.access.sees_logs`)
gets every event as `core.redact.redact_doc` makes it: no log lines, no client
addresses; each event is framed once for each kind of stream that listens.
"""

from __future__ import annotations

import json
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.web.server import Request

from llmproxy.core.events import Event, RequestEnded, StopStage
from llmproxy.core.pausedsend import PausedSend
from llmproxy.core.redact import redact_doc

RING_SIZE = 1000
MAX_QUEUED = 1 << 20
# The kernel's own send buffer for a stream's socket. Left to itself, Linux grows
# it up to tcp_wmem's maximum (4 MiB here) for a reader that stops reading, so
# the reader would hold that much before anything queued here: fixed, a stalled
# reader is found (and dropped) after about twice this plus MAX_QUEUED.
KERNEL_SEND_BUFFER = 128 * 1024
KEEPALIVE_SECONDS = 15.0
KEEPALIVE = b": keepalive\n\n"
IDS_PER_SECOND = 1_000_000
EPOCH = 1_700_000_000     # ids stay below 2**53, exact as JavaScript numbers


def frame(event_id: int, kind: str, doc: dict[str, Any]) -> bytes:
    """One SSE message."""
    data = json.dumps(doc, separators=(",", ":"))
    return f"id: {event_id}\nevent: {kind}\ndata: {data}\n\n".encode()


def event_frame(event_id: int, event: Event, sees_logs: bool) -> bytes:
    """`event` as one SSE message, redacted for a client that may not read logs."""
    doc = event.fields()
    return frame(event_id, event.type, doc if sees_logs else redact_doc(doc))


class EventLog:
    """A hub subscriber: numbers events, keeps the last RING_SIZE, feeds the streams."""

    def __init__(self, clock: IReactorTime, started: float | None = None,
                 size: int = RING_SIZE) -> None:
        self._clock = clock
        start = clock.seconds() if started is None else started
        self._base = max(0, int(start) - EPOCH) * IDS_PER_SECOND
        self.last_id = self._base
        self._ring: deque[tuple[int, Event]] = deque(maxlen=size)
        self._streams: set[EventStream] = set()
        self._keepalive = LoopingCall(self._ping)
        self._keepalive.clock = clock
        self.closed = False

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestEnded) and event.model is None \
                and event.method in ("GET", "HEAD"):
            return      # a read (status, health, metrics, the page): not news
        self.last_id += 1
        self._ring.append((self.last_id, event))
        framed: dict[bool, bytes] = {}  # serialised only when someone listens (or replays)
        for stream in list(self._streams):
            data = framed.get(stream.sees_logs)
            if data is None:
                data = framed[stream.sees_logs] = event_frame(self.last_id, event,
                                                              stream.sees_logs)
            stream.send(data)
        if isinstance(event, StopStage) and event.stage == "begun":
            self.close()

    @property
    def streams(self) -> int:
        return len(self._streams)

    def replay(self, last_id: int, sees_logs: bool = True) -> list[bytes] | None:
        """What a client that saw `last_id` missed (redacted unless `sees_logs`);
        None if the log cannot say."""
        if last_id == self.last_id:
            return []
        oldest = self._ring[0][0] if self._ring else self.last_id + 1
        if last_id > self.last_id or last_id < oldest - 1:
            return None
        return [event_frame(event_id, event, sees_logs)
                for event_id, event in self._ring if event_id > last_id]

    def attach(self, request: Request, drop: Callable[[], None], sees_logs: bool) -> None:
        """Serve `request` as an event stream from now on; `drop()` cuts its client
        off (one that does not read); `sees_logs`: its client may read engine log
        text and client addresses."""
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        stream = EventStream(request, self, drop, sees_logs)
        self._streams.add(stream)
        header = request.getHeader(b"last-event-id")
        missed: list[bytes] | None = []
        if header is not None:
            try:
                missed = self.replay(int(header.strip()), sees_logs)
            except ValueError:
                missed = None
        if missed is None:
            missed = [frame(self.last_id, "reset", {
                "type": "reset", "time": self._clock.seconds(),
                "reason": "events since that id are gone: re-read /status"})]
        request.write(b"retry: 1000\n\n" + b"".join(missed))
        if not self._keepalive.running:
            self._keepalive.start(KEEPALIVE_SECONDS, now=False)

    def detach(self, stream: EventStream) -> None:
        self._streams.discard(stream)
        if not self._streams and self._keepalive.running:
            self._keepalive.stop()

    def _ping(self) -> None:
        for stream in list(self._streams):
            stream.send(KEEPALIVE)

    def close(self) -> None:
        """End every stream (the proxy stops): clients see a clean end."""
        self.closed = True
        for stream in list(self._streams):
            stream.end()


def _limit_send_buffer(transport: Any) -> None:
    try:
        sock = transport.getHandle()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, KERNEL_SEND_BUFFER)
    except (AttributeError, OSError):
        pass      # not a socket (TLS keeps its own, a test double has none)


class EventStream:
    """One client's stream: writes while its transport takes them, queues while
    it is paused, drops the client past MAX_QUEUED (core/pausedsend.py)."""

    def __init__(self, request: Request, log: EventLog, drop: Callable[[], None],
                 sees_logs: bool = False) -> None:
        self.request = request
        self.sees_logs = sees_logs
        self._log = log
        self._cut_off = drop
        self.disconnected = False      # the client went away (notifyFinish's errback)
        self.sender = PausedSend(request.write, MAX_QUEUED, self._drop, self._gone)
        _limit_send_buffer(request.channel.transport)
        request.registerProducer(self.sender, True)
        request.notifyFinish().addErrback(self._lost).addBoth(lambda _: self._gone())

    @property
    def dropped(self) -> bool:
        """Whether it was dropped for not reading."""
        return self.sender.overflowed

    def send(self, data: bytes) -> None:
        self.sender.send(data)

    def _drop(self) -> None:
        self._log.detach(self)
        self._cut_off()

    def end(self) -> None:
        """Send what is queued, then end the stream cleanly."""
        self._log.detach(self)
        if not self.disconnected and not self.request.finished:
            self.sender.flush()
            self.request.unregisterProducer()
            self.request.finish()

    def _lost(self, reason: object) -> None:
        self.disconnected = True

    def _gone(self) -> None:
        self._log.detach(self)
