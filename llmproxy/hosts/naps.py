"""The fleet's hosts that sleep and wake: one `SleepWake` (hosts/sleepwake.py) per
managed host with a ``wake`` or ``sleep`` block, built here with what it uses of the
fleet (the magic packet sender, the agent transport, the host's watch for its lease
and reachability), the sleep timer that looks at each one, and an operator's
``llmproxy wake HOST`` / ``llmproxy sleep HOST``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall

from llmproxy.config import Config, HostConfig
from llmproxy.core.hub import Publish
from llmproxy.core.reactors import IProcessClock
from llmproxy.hosts.agentclient import IAgentTransport
from llmproxy.hosts.magic import MagicSender
from llmproxy.hosts.queueerrors import WakeFailed
from llmproxy.hosts.sleepwake import AWAKE, Idle, SleepWake
from llmproxy.hosts.watch import HostWatch

CHECK_EVERY = 5.0   # the sleep timer's period (at most a quarter of the shortest after_seconds)


class Naps:
    """The sleep and wake of the fleet's hosts (see the module docstring)."""

    def __init__(self, config: Config, reactor: IProcessClock, transport: IAgentTransport,
                 publish: Publish, watches: Mapping[str, HostWatch],
                 sender: MagicSender | None = None) -> None:
        sender = sender or MagicSender(reactor)
        self.hosts: dict[str, SleepWake] = {
            h.name: self._one(h, reactor, transport, publish, watches.get(h.name), sender)
            for h in config.hosts if h.managed and (h.wake is not None or h.sleep is not None)}
        periods = [h.sleep.after_seconds / 4 for h in config.hosts if h.sleep is not None]
        self._clock = reactor
        self._handing_over: Callable[[], bool] = lambda: False
        self._next: IDelayedCall | None = None
        self._every = max(0.25, min([CHECK_EVERY, *periods]))

    @staticmethod
    def _one(host: HostConfig, reactor: IProcessClock, transport: IAgentTransport,
             publish: Publish, watch: HostWatch | None, sender: MagicSender) -> SleepWake:
        def call(order: dict[str, Any], timeout: float) -> Deferred[dict[str, Any]]:
            return transport.call(host, order, timeout)

        def lease_held() -> bool:
            return watch is None or watch.held is True

        def reachable() -> bool:
            return watch is None or watch.connected or watch.last_error is None

        return SleepWake(host, reactor, publish, send=sender.send, call=call,
                         lease_held=lease_held, reachable=reachable,
                         woke=watch.reopen if watch is not None else lambda: None)

    def of(self, host: str) -> SleepWake | None:
        return self.hosts.get(host)

    def attach(self, gates: Mapping[str, Idle]) -> None:
        """The hosts whose work keeps them awake."""
        for name, one in self.hosts.items():
            one.attach(gates[name])

    def hold_during(self, handing_over: Callable[[], bool]) -> None:
        """No host sleeps while `handing_over()` says an upgrade's hand-over runs (this
        process starting its successor, or draining as one's predecessor)."""
        self._handing_over = handing_over

    def start(self) -> None:
        """The sleep timer: a look at each host every period (the first after one)."""
        if any(h.host.sleep is not None for h in self.hosts.values()) and self._next is None:
            self._next = self._clock.callLater(self._every, self.check)

    def stop(self) -> None:
        """No sleep from now on (the proxy stops or hands over)."""
        if self._next is not None and self._next.active():
            self._next.cancel()
        self._next = None

    def check(self) -> None:
        self._next = self._clock.callLater(self._every, self.check)
        if self._handing_over():
            return
        for one in self.hosts.values():
            one.check()

    async def command(self, host: str, op: str) -> str | None:
        """An operator's `wake` or `sleep` of `host`: None once done, else why not."""
        one = self.hosts.get(host)
        if one is None:
            return f"host {host} has no wake or sleep block"
        if op == "sleep":
            if one.host.sleep is None:
                return f"host {host} has no sleep block"
            if self._handing_over():
                return "an upgrade's hand-over is in progress"
            return await one.sleep_now("operator")
        if one.host.wake is None:
            return f"host {host} has no wake block"
        if not one.needs_wake():
            return None if one.state == AWAKE else f"host {host} is {one.state}"
        try:
            await one.wake("an operator")
        except WakeFailed as e:
            return e.reason
        return None

    def heard(self, host: str) -> None:
        """`host`'s watch (re)opened: if it slept, it is awake again (woken by hand)."""
        one = self.hosts.get(host)
        if one is not None:
            one.heard()

    def snapshot(self, host: str, now: float) -> dict[str, Any] | None:
        one = self.hosts.get(host)
        return sleep_doc(one, now) if one is not None else None

    def state(self, host: str) -> str | None:
        one = self.hosts.get(host)
        return one.state if one is not None else None


def sleep_doc(one: SleepWake, now: float) -> dict[str, Any]:
    """For /status (a host's ``engine.sleep``): the state, the idle time, the last wake
    and the wake backoff."""
    last = one.last_wake
    doc: dict[str, Any] = {"state": one.state, "last_wake": None if last is None else {
        "seconds_ago": round(max(0.0, now - last["at"]), 1), "seconds": last["seconds"],
        "ok": last["ok"]}}
    if one.host.sleep is not None:
        doc["sleeps_after_seconds"] = one.host.sleep.after_seconds
        doc["idle_seconds"] = round(max(0.0, one.idle_for(now)), 1) \
            if one.state == AWAKE else None
    if one.no_wake_until is not None and one.no_wake_until > now:
        doc["no_wake_for_seconds"] = round(one.no_wake_until - now, 1)
    return doc
