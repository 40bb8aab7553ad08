"""Requests in flight, and the one access log line each of them ends with."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

# How a request ended.
COMPLETED = "completed"          # the whole response was sent (errors included)
CLIENT_GONE = "client-gone"      # the client disconnected first; the upstream was cancelled
UPSTREAM_FAILED = "upstream-failed"  # the upstream failed before or during the response
CUT = "cut"                      # a drain deadline cut it

# A module-level Logger keeps its namespace (as a class attribute it would be
# renamed after the class), so access lines can be filtered as llmproxy.access.
access_log = Logger(namespace="llmproxy.access")


@dataclass
class Exchange:
    """One request, from arrival to its access log line."""

    id: str
    method: str
    path: str
    started: float
    client: str
    model: str | None = None
    host: str | None = None
    engine: str | None = None          # on a managed host: the engine it holds a lease on
    status: int | None = None
    bytes_sent: int = 0
    outcome: str | None = None
    detail: str | None = None
    streaming: bool = False
    ended: Deferred[None] = field(default_factory=Deferred)
    cut: bool = False                    # a drain deadline aborted it
    abort: Callable[[], None] = lambda: None   # drops the client connection at once

    def snapshot(self, now: float) -> dict[str, Any]:
        """What /status shows of it."""
        return {
            "id": self.id, "method": self.method, "path": self.path, "model": self.model,
            "host": self.host, "status": self.status, "bytes": self.bytes_sent,
            "age_seconds": round(now - self.started, 3), "streaming": self.streaming,
        }


class InFlight:
    """The registry of running requests; writes the access log."""

    def __init__(self, clock: IReactorTime, id_prefix: str | None = None) -> None:
        self._clock = clock
        self._prefix = id_prefix if id_prefix is not None else os.urandom(3).hex()
        self._seq = 0
        self.active: dict[str, Exchange] = {}
        self._idle_waiters: list[Deferred[None]] = []

    def begin(self, method: str, path: str, client: str) -> Exchange:
        """Register a request that has just arrived."""
        self._seq += 1
        exchange = Exchange(id=f"{self._prefix}-{self._seq}", method=method, path=path,
                            started=self._clock.seconds(), client=client)
        self.active[exchange.id] = exchange
        return exchange

    def end(self, exchange: Exchange, outcome: str, detail: str | None = None) -> None:
        """Unregister a request and log its access line; later calls are ignored."""
        if exchange.outcome is not None:
            return
        if exchange.cut:
            outcome = CUT
        exchange.outcome = outcome
        exchange.detail = detail
        self.active.pop(exchange.id, None)
        duration = self._clock.seconds() - exchange.started
        fmt = ("{id} {method} {path} model={model} host={host} status={status} "
               "bytes={bytes} duration={duration:.3f}s outcome={outcome}")
        if exchange.cut:
            fmt += " age={duration:.1f}s: cut at the drain deadline"
        elif detail:
            fmt += " ({detail})"
        emit = access_log.info if outcome == COMPLETED else access_log.warn
        emit(fmt, id=exchange.id, method=exchange.method, path=exchange.path,
             model=exchange.model or "-", host=exchange.host or "-",
             status=exchange.status if exchange.status is not None else "-",
             bytes=exchange.bytes_sent, duration=duration, outcome=outcome, detail=detail,
             client=exchange.client)
        exchange.ended.callback(None)
        if not self.active:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    def idle(self) -> Deferred[None]:
        """Fires once no request is in flight (at once if none is)."""
        d: Deferred[None] = Deferred()
        if self.active:
            self._idle_waiters.append(d)
        else:
            d.callback(None)
        return d

    def snapshot(self) -> list[dict[str, Any]]:
        """Every running request, oldest first, for /status."""
        now = self._clock.seconds()
        return [e.snapshot(now) for e in self.active.values()]
