"""The rules of engine supervision, as pure functions of what happened and when:
when a crashed engine is started again, when a crash loop ends in `failed`,
and when an engine that does not answer its health check counts as hung.

- A crash is an exit the proxy did not ask for (an engine it stopped, for an
  idle stop, an eviction, an operator or a switch, is never restarted).
- With `restart: on-failure` (the default) the n-th crash within the window is
  followed by a start after BACKOFF[n-1] seconds (1, 2, 4, ... up to 60).
- CRASH_LIMIT crashes within CRASH_WINDOW seconds make the engine `failed`: no
  more restarts until an operator starts it (`llmproxy engine HOST start E`).
- An engine is hung when its health check has failed for `unhealthy_seconds`
  and none of its responses in flight has sent a byte for that long (as seen in
  samples of the bytes each has sent: no clock call per chunk). It is then
  stopped, which counts as a crash: a hang loop also ends `failed`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)
CRASH_WINDOW = 600.0
CRASH_LIMIT = 5


def backoff(crashes: int) -> float:
    """The wait before the start that follows the `crashes`-th crash in a row."""
    return BACKOFF[min(max(crashes, 1), len(BACKOFF)) - 1]


@dataclass(frozen=True)
class Verdict:
    """What to do after an exit: start again in `restart_in` seconds (None: do
    not), and whether the engine is now `failed`."""

    restart_in: float | None
    failed: bool = False
    crashes: int = 0


@dataclass
class EngineRecord:
    """One engine's crash history (clock times) and whether it has failed."""

    crashes: list[float] = field(default_factory=list)
    failed: bool = False
    last_exit: str | None = None      # "exit status 3" / "signal 9" / "exit status unknown"
    last_line: str | None = None      # the last line of its log when it died


AGENT_MARK = "--- llmproxy-agent "   # the agent's own lines in an engine's log (start, exit)


def engine_lines(log_tail: Iterable[object]) -> list[str]:
    """The lines of a log's tail that the engine wrote: the agent marks each start
    and exit in the log itself (`--- llmproxy-agent DATE: the engine (pid N) exited
    with status 3`), which says only what the exit event says already."""
    return [line for line in map(str, log_tail) if not line.startswith(AGENT_MARK)]


def after_exit(record: EngineRecord, now: float, *, stopped_by_proxy: bool,
               restart: str = "on-failure") -> Verdict:
    """Record an exit at `now` and say what follows it."""
    if stopped_by_proxy:
        return Verdict(None)
    record.crashes = [t for t in record.crashes if now - t < CRASH_WINDOW] + [now]
    crashes = len(record.crashes)
    if crashes >= CRASH_LIMIT:
        record.failed = True
        return Verdict(None, failed=True, crashes=crashes)
    if restart == "never":
        return Verdict(None, crashes=crashes)
    return Verdict(backoff(crashes), crashes=crashes)


def cleared(record: EngineRecord) -> None:
    """An operator's start: the crash history and the failed state are forgotten."""
    record.crashes.clear()
    record.failed = False


def progressed(before: Mapping[str, int], after: Mapping[str, int]) -> bool:
    """Whether an engine's responses in flight sent a byte between two samples of
    the bytes each has sent (by request id): one sent more, or a new one sent any."""
    return any(sent > before.get(request, 0) for request, sent in after.items())


def hung(unhealthy_since: float | None, quiet_since: float, now: float,
         unhealthy_seconds: float) -> bool:
    """Whether an engine is hung: its health check has failed since
    `unhealthy_since` (None: it passes) for `unhealthy_seconds`, and its
    responses in flight were last seen sending at `quiet_since` (when it turned
    unhealthy, if none has sent since) at least that long ago."""
    if unhealthy_since is None:
        return False
    return min(now - unhealthy_since, now - quiet_since) >= unhealthy_seconds


@dataclass
class Silence:
    """An engine whose health check fails: since when, when its responses in
    flight were last seen sending (`progressed` between two samples), and the
    last sample (bytes sent, by request id)."""

    since: float
    quiet_since: float
    sent: dict[str, int] = field(default_factory=dict)

    def sample(self, now: float, sent: Mapping[str, int]) -> None:
        """A new sample at `now`: bytes sent since the last one restart the quiet time."""
        if progressed(self.sent, sent):
            self.quiet_since = now
        self.sent = dict(sent)

    def hung(self, now: float, unhealthy_seconds: float) -> bool:
        return hung(self.since, self.quiet_since, now, unhealthy_seconds)
