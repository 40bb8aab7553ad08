"""One host that sleeps and wakes (`SleepWake`): its state (``awake``, ``sleeping``: its
sleep order is out, ``asleep``: its agent ran the sleep command or a wake failed,
``waking``: magic packets sent, its agent not answering yet), its wake and its sleep.

Wake (`wake`): a request for an engine of a host with a ``wake`` block, while the host
`needs_wake` (asleep, or its watch lost it: not within REWATCH seconds of a wake, while
the watch reconnects), waits for the one wake in progress: the magic packet is sent
(hosts/magic.py), again every RESEND seconds, and the agent's ``status`` is asked every
PROBE_EVERY seconds until it answers; done, the host is awake. A wake that does not see
the host answer within ``timeout_seconds`` fails every waiter (`WakeFailed`, a
SwitchFailed: a 424 naming the host and the timeout), and no wake starts again for
BACKOFF seconds (a request meanwhile fails at once the same way). A wake asked while
the sleep order is out waits for its outcome, and within SETTLE seconds of the order
for the rest of them, so a host still going to sleep is not taken for awake.

Sleep (`check`, on a timer; `sleep_now`, by hand): a host with a ``sleep`` block sleeps
when nothing keeps it awake (`keeps_awake`): its lease held by this proxy, no engine
running, nothing in flight or queued, no agent call in progress (an operator's command
included: it goes through the queue and the agent), the proxy not stopping or handing
over, and (on the timer) no request for its models within ``after_seconds``, counted
from its last use or its last wake, whichever is later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IReactorTime

from llmproxy.agent.protocol import OP_FIELD, SLEEP, SLEEP_DELAY, STATUS
from llmproxy.config import HostConfig
from llmproxy.core.clockwaits import sleep as clock_sleep
from llmproxy.core.hub import Publish
from llmproxy.core.sleepwake import HostSlept, HostWoke
from llmproxy.hosts.queueerrors import WakeFailed

AWAKE, SLEEPING, ASLEEP, WAKING = "awake", "sleeping", "asleep", "waking"
PROBE_EVERY = 2.0          # seconds between status probes while waking
RESEND = 10.0              # seconds between magic packets while waking
BACKOFF = 300.0            # no wake for this long after one timed out
SETTLE = SLEEP_DELAY + 2.0  # a host told to sleep may answer this long still
SLEEP_TIMEOUT = 30.0       # the sleep order's own timeout
REWATCH = 30.0             # after a wake, its watch has this long to reconnect

Call = Callable[[dict[str, Any], float], "Deferred[dict[str, Any]]"]


class Idle(Protocol):
    """What the sleep rule reads of its host (hosts/host.py's Host)."""

    @property
    def closing(self) -> bool: ...

    @property
    def busy(self) -> bool: ...

    @property
    def last_used(self) -> float: ...

    def running_engines(self) -> tuple[str, ...]: ...

    def in_flight(self, engine: str | None = None) -> int: ...

    def queued(self) -> int: ...


class SleepWake:
    """A host's sleep and wake (see the module docstring). `send(wake)` sends the
    magic packet; `call(order, timeout)` is an agent order to the host; `lease_held()`
    says whether this proxy holds the host's lease; `reachable()` whether its watch
    has it; `woke()` is told once it answers again."""

    def __init__(self, host: HostConfig, clock: IReactorTime, publish: Publish, *,
                 send: Callable[[Any], str | None], call: Call,
                 lease_held: Callable[[], bool] = lambda: True,
                 reachable: Callable[[], bool] = lambda: True,
                 woke: Callable[[], object] = lambda: None,
                 backoff: float = BACKOFF) -> None:
        self.host = host
        self.state = AWAKE
        self._clock, self._publish = clock, publish
        self._send, self._call = send, call
        self._lease_held, self._reachable, self._woke = lease_held, reachable, woke
        self._backoff = backoff
        self._gate: Idle | None = None
        self._waiters: list[Deferred[None]] = []
        self._order_waiters: list[Deferred[None]] = []   # a wake waiting for a sleep order
        self._send_error: str | None = None
        self.awake_since = clock.seconds()
        self.slept_at: float | None = None
        self.woke_at: float | None = None       # its last wake's end (its watch reconnects)
        self.no_wake_until: float | None = None
        self.last_wake: dict[str, Any] | None = None

    def attach(self, gate: Idle) -> None:
        """The host whose work keeps it awake."""
        self._gate = gate

    # -- wake ---------------------------------------------------------------------------
    def needs_wake(self) -> bool:
        """Whether a request for this host must wake it first."""
        if self.host.wake is None:
            return False
        if self.state != AWAKE:
            return True
        rewatching = self.woke_at is not None and \
            self._clock.seconds() - self.woke_at < REWATCH
        return not rewatching and not self._reachable()

    def wake(self, why: str = "a request", engine: str = "") -> Deferred[None]:
        """Fires once the host answers; WakeFailed if it does not in time. Cancelling
        it withdraws this waiter only."""
        if not self.needs_wake():
            return succeed(None)
        assert self.host.wake is not None
        now = self._clock.seconds()
        if self.no_wake_until is not None and now < self.no_wake_until:
            return Deferred.fromCoroutine(self._refused(engine, now))
        d: Deferred[None] = Deferred(self._withdraw)
        self._waiters.append(d)
        if self.state != WAKING:
            Deferred.fromCoroutine(self._wake(why)).addErrback(self._broken)
        return d

    async def _refused(self, engine: str, now: float) -> None:
        assert self.host.wake is not None and self.no_wake_until is not None
        raise WakeFailed(self.host.name, engine, self._timeout_text() +
                         f"; no new wake for {self.no_wake_until - now:.0f}s")

    def _timeout_text(self) -> str:
        assert self.host.wake is not None
        return (f"host {self.host.name} did not wake within "
                f"{self.host.wake.timeout_seconds:g}s (wake.timeout_seconds)")

    def _withdraw(self, d: Deferred[None]) -> None:
        if d in self._waiters:
            self._waiters.remove(d)

    def _broken(self, failure: Any) -> None:
        """A wake that failed in an unforeseen way: its waiters fail too, never hang."""
        self.state = ASLEEP if self.state == WAKING else self.state
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.errback(WakeFailed(self.host.name, "", f"waking host {self.host.name} failed: "
                                                     f"{failure.getErrorMessage()}"))

    async def _wake(self, why: str) -> None:
        wake = self.host.wake
        assert wake is not None
        ordered, self.state = self.state == SLEEPING, WAKING
        if ordered:                            # its sleep order is out: its outcome first
            d: Deferred[None] = Deferred()
            self._order_waiters.append(d)
            await d
        if self.slept_at is not None:          # a host still going to sleep answers
            left = self.slept_at + SETTLE - self._clock.seconds()
            if left > 0:
                await clock_sleep(self._clock, left)
        began = self._clock.seconds()
        deadline = began + wake.timeout_seconds
        self._publish(HostWoke(began, self.host.name, "begun", why, wake.mac))
        sent = None
        while True:
            now = self._clock.seconds()
            if now >= deadline:
                return self._failed(began, why)
            if sent is None or now - sent >= RESEND:
                self._send_error = self._send(wake)
                sent = now
            if await self._answers(min(max(PROBE_EVERY * 2, 5.0), deadline - now)):
                return self._awake(began, why)
            left = deadline - self._clock.seconds()
            if left > 0:
                await clock_sleep(self._clock, min(PROBE_EVERY, left))

    async def _answers(self, timeout: float) -> bool:
        try:
            answer = await self._call({OP_FIELD: STATUS}, timeout)
        except CancelledError:
            raise
        except Exception:   # unreachable, refused, timed out: not up yet
            return False
        return bool(answer.get("ok"))

    def _awake(self, began: float, why: str) -> None:
        now = self._clock.seconds()
        self.state, self.awake_since, self.slept_at, self.woke_at = AWAKE, now, None, now
        self.no_wake_until = None
        self.last_wake = {"at": now, "seconds": round(now - began, 1), "ok": True}
        self._publish(HostWoke(now, self.host.name, "done", why, elapsed=now - began))
        self._woke()
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.callback(None)

    def _failed(self, began: float, why: str) -> None:
        now = self._clock.seconds()
        self.state = ASLEEP
        self.no_wake_until = now + self._backoff
        self.last_wake = {"at": now, "seconds": round(now - began, 1), "ok": False}
        reason = self._timeout_text()
        if self._send_error is not None:
            reason += f"; {self._send_error}"
        self._publish(HostWoke(now, self.host.name, "failed", why, elapsed=now - began,
                               reason=reason, backoff=self._backoff))
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.errback(WakeFailed(self.host.name, "", reason))

    def heard(self) -> None:
        """Its agent spoke (a watch opened) more than SETTLE after its sleep: awake."""
        now = self._clock.seconds()
        if self.state == ASLEEP and (self.slept_at is None or now - self.slept_at > SETTLE):
            self.state, self.awake_since, self.slept_at, self.no_wake_until = \
                AWAKE, now, None, None

    # -- sleep --------------------------------------------------------------------------
    def idle_for(self, now: float) -> float:
        """Seconds since the host was last used or woken, whichever is later."""
        used = self._gate.last_used if self._gate is not None else 0.0
        return now - max(used, self.awake_since)

    def keeps_awake(self, now: float, idle: bool = True) -> str | None:
        """Why the host may not sleep now (None: it may); with `idle`, its idle
        period counts too."""
        gate = self._gate
        if self.host.sleep is None:
            return "it has no sleep block"
        if self.state != AWAKE:
            return f"it is {self.state}"
        if gate is None:
            return "it is not attached"
        if gate.closing:
            return "the proxy is stopping or handing over"
        if not self._lease_held():
            return "this proxy does not hold its lease"
        running = gate.running_engines()
        if running:
            return f"engines run: {', '.join(running)}"
        if gate.in_flight() or gate.queued():
            return f"{gate.in_flight()} in flight, {gate.queued()} queued"
        if gate.busy:
            return "an agent call is in progress"
        if idle and self.idle_for(now) < self.host.sleep.after_seconds:
            return (f"used {self.idle_for(now):.0f}s ago (sleeps after "
                    f"{self.host.sleep.after_seconds:g}s)")
        return None

    def check(self) -> None:
        """The sleep timer's look at the host: sleep it if it has idled long enough."""
        if self.keeps_awake(self._clock.seconds()) is None:
            Deferred.fromCoroutine(self.sleep_now("idle"))

    async def sleep_now(self, why: str = "operator") -> str | None:
        """Tell the host's agent to sleep unless something keeps it awake (an operator's
        sleep skips the idle period); None once told, else why not."""
        now = self._clock.seconds()
        refusal = self.keeps_awake(now, idle=why == "idle")
        if refusal is not None:
            return refusal
        assert self.host.sleep is not None
        idle = self.idle_for(now)
        self.state = SLEEPING
        try:
            refusal = await self._order_sleep(self.host.sleep.command)
        finally:
            waiters, self._order_waiters = self._order_waiters, []
        done = self._clock.seconds()
        if refusal is None:
            self.slept_at = done
            if self.state == SLEEPING:
                self.state = ASLEEP
        else:          # it stays awake; the idle count starts again (no retry at once)
            self.awake_since = done
            if self.state == SLEEPING:
                self.state = AWAKE
        self._publish(HostSlept(done, self.host.name, why, idle, refusal))
        for d in waiters:
            d.callback(None)
        return refusal

    async def _order_sleep(self, command: tuple[str, ...]) -> str | None:
        """The agent's sleep order: None once it runs the command, else why not."""
        try:
            answer = await self._call({OP_FIELD: SLEEP, "command": list(command)},
                                      SLEEP_TIMEOUT)
        except Exception as e:  # the agent could not be told: it stays awake
            return f"the agent could not be told: {e}"
        if not answer.get("ok"):
            return str(answer.get("error") or "the agent refused")
        return None
