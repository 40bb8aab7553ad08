"""How long the proxy waits for a client: one connection's timers.

    connect --header--> end of headers --body (between reads)--> body in
       ^                                                            |  answering:
       +---- first byte <--idle-- response done (keep-alive) <------+  no read timer

and, whatever the phase, the write stall: the client's transport paused the
response (its buffer is full) and did not resume it for that long. Twisted's
transport resumes once its buffer has drained; the channel may also say how
much the transport still holds (`unsent`, when it can tell: see
llmproxy/speedups/responsewrites.py), and a buffer that shrank since the pause
counts as a reader, measured again from there.

Twisted's own timer (`HTTPChannel.timeOut`) is off: it restarts on every byte,
so a client sending one header byte every few seconds would hold its
connection forever. These run on the injected reactor (task.Clock in tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from twisted.internet.interfaces import IDelayedCall

from llmproxy.config import Config

HEADER, BODY, IDLE, ANSWERING, STALL = "header", "body", "idle", "answering", "write stall"
FIELDS = {
    HEADER: "client_header_timeout_seconds", BODY: "client_body_timeout_seconds",
    IDLE: "client_idle_timeout_seconds", STALL: "client_write_stall_seconds",
}  # fmt: skip


_ATTRIBUTE = {HEADER: "header", BODY: "body", IDLE: "idle", STALL: "write_stall"}


@dataclass(frozen=True)
class ClientTimeouts:
    """The four client timeouts of the config, in seconds."""

    header: float = 10.0
    idle: float = 120.0
    body: float = 30.0
    write_stall: float = 60.0

    @classmethod
    def of(cls, config: Config) -> ClientTimeouts:
        return cls(config.client_header_timeout_seconds, config.client_idle_timeout_seconds,
                   config.client_body_timeout_seconds, config.client_write_stall_seconds)

    def seconds(self, kind: str) -> float:
        return float(getattr(self, _ATTRIBUTE[kind]))


def _expired_after_stop(kind: str) -> None:
    """A timer that runs out after its connection is gone: nothing to do."""


def _unknown() -> None:
    return None


class ChannelTimers:
    """The timers of one connection. The channel reports what happens (data,
    the end of the headers, the body, a response done, its transport pausing
    and resuming it); `expired(kind)` is called when one runs out."""

    def __init__(self, call_later: Callable[..., IDelayedCall], timeouts: ClientTimeouts,
                 expired: Callable[[str], None], unsent: Callable[[], int | None],
                 now: Callable[[], float]) -> None:
        self._call_later = call_later
        self._timeouts = timeouts
        self._expired = expired
        self._unsent = unsent
        self._now = now
        self.phase = HEADER
        self.heard = False            # a byte of the current request has arrived
        # The read timer is lazy: a phase sets its deadline, and the one delayed
        # call moves only when a deadline comes sooner than it. Arriving at a later
        # deadline, it waits on for the rest (every request moves through four
        # phases; a cancel and a new call each time cost more than the request's
        # own work on the reactor).
        self._deadline: float | None = None
        self._read: IDelayedCall | None = None
        self._stall: IDelayedCall | None = None
        self._stall_mark: int | None = None

    def _arm(self, phase: str) -> None:
        self.phase = phase
        if phase == ANSWERING:
            self._deadline = None
            return
        seconds = self._timeouts.seconds(phase)
        self._deadline = self._now() + seconds
        if self._read is None:
            self._read = self._call_later(seconds, self._fire)
        elif self._read.getTime() > self._deadline:
            self._read.reset(seconds)

    def _cancel_read(self) -> None:
        self._deadline = None
        if self._read is not None and self._read.active():
            self._read.cancel()
        self._read = None

    def _fire(self) -> None:
        self._read = None
        if self._deadline is None:
            return
        left = self._deadline - self._now()
        if left > 0:
            self._read = self._call_later(left, self._fire)
            return
        self._deadline = None
        self._expired(self.phase)

    def awaiting_headers(self) -> None:
        """A connection opened, or the first bytes of its next request arrived."""
        self._arm(HEADER)

    def data(self) -> None:
        """Bytes arrived: an idle connection starts its next request."""
        self.heard = True
        if self.phase == IDLE:
            self._arm(HEADER)

    def headers_done(self, body_follows: bool) -> None:
        """The headers are in; a body follows, or the request is answered now."""
        self._arm(BODY if body_follows else ANSWERING)

    def body_read(self) -> None:
        """More of the body arrived: the body timer starts again."""
        if self.phase == BODY and self._deadline is not None:
            self._deadline = self._now() + self._timeouts.body

    def answering(self) -> None:
        """The whole request is in: no read timer while it is answered."""
        self._arm(ANSWERING)

    def between_requests(self, next_started: bool) -> None:
        """A response is done on a keep-alive connection; `next_started`: bytes
        of the next request are already there."""
        self.heard = next_started
        self._arm(HEADER if next_started else IDLE)

    def paused(self) -> None:
        """The transport's buffer is full: the client reads too slowly, or not at all."""
        if self._stall is None:
            self._stall_mark = self._unsent()
            self._stall = self._call_later(self._timeouts.write_stall, self._stall_check)

    def resumed(self) -> None:
        """The transport drained its buffer: the client reads."""
        if self._stall is not None and self._stall.active():
            self._stall.cancel()
        self._stall = None

    def _stall_check(self) -> None:
        now, before = self._unsent(), self._stall_mark
        if now is not None and before is not None and now < before:
            # Slow, but it read something: measured again from here.
            self._stall_mark = now
            self._stall = self._call_later(self._timeouts.write_stall, self._stall_check)
            return
        self._stall = None
        self._expired(STALL)

    def stop(self) -> None:
        """The connection is gone: no timer runs for it, and its callbacks (its
        channel's methods) are let go, so the channel is freed by its reference
        count, not left as a cycle for the garbage collector."""
        self._cancel_read()
        self.resumed()
        self._expired, self._unsent = _expired_after_stop, _unknown
