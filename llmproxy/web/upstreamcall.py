"""One upstream request and the two ways it ends early: the header timeout and
the client leaving. What `forward` sends to an engine goes through one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.web.client import RequestNotSent  # type: ignore[attr-defined]  # not in its __all__
from twisted.web.server import Request

from llmproxy.core.deadlines import Deadlines
from llmproxy.core.failures import describe
from llmproxy.observe.inflight import CLIENT_GONE, UPSTREAM_FAILED, Exchange
from llmproxy.web.engineclient import CrossedClose
from llmproxy.web.errors import write_error
from llmproxy.web.relay import Relay, sse_error


class UpstreamCall:
    """One upstream request and the two ways it ends early: the header timeout,
    and the client leaving (cancel before the headers, close the body after). A
    request that was never sent (Twisted's RequestNotSent: its pooled connection
    was gone before a byte was written), or an idempotent one whose streamed
    body crossed the engine's close of a reused connection (CrossedClose: the
    client sends a bytes body once more itself), is sent once more, with a
    fresh body."""

    def __init__(self, deadlines: Deadlines, timeout: float,
                 send: Callable[[], Deferred[Any]]) -> None:
        self._send = send
        self.pending = send()
        self.timeout = timeout
        self.gone = False
        self.timed_out = False
        self.relay: Relay | None = None
        self._deadlines = deadlines
        deadlines.add(self, timeout, self._time_out)

    def _time_out(self) -> None:
        self.timed_out = True
        self.pending.cancel()

    def client_gone(self) -> None:
        self.gone = True
        if self.relay is not None:
            self.relay.stop()
        else:
            # Even when `pending` has fired into another Deferred (the
            # connection was made, the request is out: `called` is true while it
            # waits on the response's), cancel reaches the one still waiting.
            self.pending.cancel()

    async def headers(self) -> Any:
        try:
            try:
                return await self.pending
            except (RequestNotSent, CrossedClose):
                if self.gone or self.timed_out:
                    raise
                self.pending = self._send()     # the engine started nothing: safe to send
                return await self.pending
        finally:
            self._deadlines.remove(self)

    def failed(self, request: Request, exchange: Exchange, host: str, error: Exception,
               committed: bool) -> str:
        """Answer a failure before the headers; returns the outcome."""
        if self.gone:
            return CLIENT_GONE
        if committed:
            why = ("sent no response headers in time" if self.timed_out
                   else f"failed: {describe(error)}")
            return sse_error(request, exchange, f"upstream {host} {why}", 502)
        if self.timed_out:
            write_error(request, 504, f"upstream {host} sent no response headers within "
                        f"{self.timeout:g}s (header_timeout_seconds)", "upstream_timeout")
        else:
            write_error(request, 502, f"upstream {host} failed: {describe(error)}",
                        "upstream_failed")
        return UPSTREAM_FAILED
