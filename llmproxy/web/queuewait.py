"""A request waiting in its host's queue (for a slot, or for its engine): the
wait, cancelled if the client leaves, SSE comment pings for a streaming
client (`: queued 3rd for gpu1, about 12 s`, from observe/queueview.py, or
`: waiting for host gpu1 to wake`), the
measured wait in `X-LLMProxy-Queue-Wait` on an answer whose head is not sent
yet, and the answers of a wait that ends in refusal."""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.web.server import Request

from llmproxy.hosts.host import Host
from llmproxy.hosts.waiter import Lease
from llmproxy.observe.inflight import COMPLETED, Exchange
from llmproxy.observe.queueview import QueueView, comment
from llmproxy.web.errors import write_error
from llmproxy.web.relay import sse_error
from llmproxy.web.site import ProxyRequest

PING_FIRST = 1.0    # a streaming client that waits hears from us after this,
PING_EVERY = 5.0    # then this often, so idle timeouts in front of the proxy do not fire

# Seconds a refused client is told to wait before it retries.
RETRY_QUEUE_FULL = 5
RETRY_QUEUE_TIMEOUT = 5
RETRY_CORDONED = 30

QUEUE_WAIT_HEADER = b"x-llmproxy-queue-wait"


class QueueWait:
    """A request waiting for its lease on a host: cancelled if the client leaves,
    with SSE comment pings for a streaming client. `committed`: the pings started
    a 200 event stream, so what follows must be sent as events."""

    def __init__(self, clock: IReactorTime, request: ProxyRequest, exchange: Exchange,
                 gate: Host, engine: str | None, committed: bool = False,
                 queues: QueueView | None = None) -> None:
        self._clock = clock
        self._request = request
        self._exchange = exchange
        self._gate = gate
        self._engine = engine if gate.host.managed else None
        self.committed = committed
        self._queues = queues

    def acquire(self) -> Deferred[Lease]:
        """The lease: an already fired Deferred when the host grants it now
        (the usual), else one that fires after the wait (or fails: the queue
        full, timed out, the switch failed, the client gone)."""
        pending = self._gate.acquire(self._engine, self._exchange.id,
                                     priority=self._exchange.priority)
        if pending.called:
            self._waited(0.0)
            return pending
        return Deferred.fromCoroutine(self._wait(pending))

    def _waited(self, seconds: float) -> None:
        """The wait is over: its seconds (summed over the hosts a request tried)
        go in the answer's head, unless the head is sent (a streaming wait's pings)."""
        state = self._request.state
        state.queue_wait += seconds
        if not self.committed:
            self._request.setHeader(QUEUE_WAIT_HEADER, f"{state.queue_wait:.3f}".encode())

    async def _wait(self, pending: Deferred[Lease]) -> Lease:
        self._request.notifyFinish().addErrback(lambda _: pending.cancel())
        ping: LoopingCall | None = None
        if self._exchange.streaming:
            ping = LoopingCall(self._ping)
            ping.clock = self._clock
            first = self._clock.callLater(PING_FIRST, ping.start, PING_EVERY)
        began = self._clock.seconds()
        try:
            return await pending
        finally:
            self._waited(max(0.0, self._clock.seconds() - began))
            if ping is not None:
                if first.active():
                    first.cancel()
                if ping.running:
                    ping.stop()

    def _ping(self) -> None:
        request = self._request
        if request.state.client_gone:
            return
        if not self.committed:
            self.committed = True
            request.setResponseCode(200)
            request.setHeader(b"content-type", b"text/event-stream")
            request.setHeader(b"cache-control", b"no-cache")
            request.setHeader(b"x-accel-buffering", b"no")
        place = self._queues.place(self._gate, self._exchange.id) \
            if self._queues is not None else None
        if place is not None:
            request.write(f"{comment(self._gate.host.name, *place)}\n\n".encode())
            return
        what = f"engine {self._engine} on {self._gate.host.name}" if self._engine \
            else self._gate.host.name
        waking = self._gate.sleepwake is not None and self._gate.sleepwake.state != "awake"
        if waking:     # a sleeping host is woken first (hosts/sleepwake.py)
            what = f"host {self._gate.host.name} to wake"
        request.write(f": waiting for {what}\n\n".encode())


def refuse(request: Request, exchange: Exchange, committed: bool, status: int, message: str,
           code: str, retry_after: int, type_: str | None = None) -> str:
    """Answer a request nothing of which reached an engine with a status and a
    Retry-After (or, once committed, an error event); returns the outcome."""
    if committed:
        return sse_error(request, exchange, message, status)
    exchange.note(message)
    request.setHeader(b"retry-after", str(retry_after).encode())
    write_error(request, status, message, code, type_)
    return COMPLETED
