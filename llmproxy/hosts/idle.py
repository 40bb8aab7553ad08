"""Idle stop: a host's engine is stopped after its `idle_stop_seconds` (the
engine's own, else the top-level one) without a request on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmproxy.hosts.host import Host


class IdleStopper:
    """Every `check_every` seconds, stops the engine of each host idle for its
    time: the engine's own `idle_stop_seconds`, else `idle_seconds`.

    Set `closing` when the proxy stops: from then on no stop is started, and the flag is
    checked again before each host, so a shutdown arriving mid-check stops the loop there.
    Stops in progress are tracked so the graceful stop can wait for them (operations()).
    """

    log = Logger()

    def __init__(self, managers: Sequence[Host], clock: IReactorTime,
                 idle_seconds: float, check_every: float = 5.0) -> None:
        self.managers = list(managers)
        self.idle_seconds = idle_seconds
        self.check_every = check_every
        self.closing = False
        self._clock = clock
        self._loop: LoopingCall | None = None
        self._stops: dict[int, Deferred[bool]] = {}  # id(manager) -> its stop in progress
        self._observers: dict[int, list[Deferred[None]]] = {}

    def start(self) -> None:
        """Check every `check_every` seconds on the clock (the first check after one period)."""
        if self._loop is None or not self._loop.running:
            self._loop = LoopingCall(self.check)
            self._loop.clock = self._clock
            self._loop.start(self.check_every, now=False).addErrback(
                lambda f: self.log.failure("idle check loop ended", f))

    def close(self) -> None:
        """The proxy stops: no idle stop starts from now on (see `closing`)."""
        self.closing = True

    def stop(self) -> None:
        """No more checks (stops in progress go on; see operations())."""
        if self._loop is not None and self._loop.running:
            self._loop.stop()

    def deadline(self, manager: Host) -> float | None:
        """Clock time when `manager`'s engine will be idle-stopped, None if it will not be
        (nothing runs, it is in use, a switch or agent call is pending, or it is protected);
        on a budgeted host, the earliest of its engines'."""
        due = [when for _, when in self.deadlines(manager)]
        return min(due) if due else None

    def deadlines(self, manager: Host) -> list[tuple[str, float]]:
        """(engine, when it will be idle-stopped) for each engine an idle stop may take."""
        return [(e, since + self.idle_seconds_of(manager, e))
                for e, since in manager.idle_candidates()]

    def idle_seconds_of(self, manager: Host, engine: str) -> float:
        """How long `engine` on `manager`'s host may sit idle: its own TTL, else the
        top-level one."""
        own = self._own_ttl(manager, engine)
        return own if own is not None else self.idle_seconds

    @staticmethod
    def _own_ttl(manager: Host, engine: str) -> float | None:
        preset = manager.host.engines.get(engine)
        return preset.idle_stop_seconds if preset is not None else None

    def check(self) -> None:
        """Start an idle stop on every host whose deadline has passed, unless closing
        (one stop per host at a time: the next check takes the next engine)."""
        now = self._clock.seconds()
        for manager in self.managers:
            if self.closing:
                return
            key = id(manager)
            due = [(when, e) for e, when in self.deadlines(manager) if when <= now]
            if key in self._stops or manager.closing or not due:
                continue
            _, engine = min(due)
            try:
                if manager.host.budgeted:
                    why = "idle" if self._own_ttl(manager, engine) is None else "ttl"
                    d = manager.stop_engine(engine, why)
                else:
                    d = manager.stop_engine()
            except Exception:
                self.log.failure("idle stop on {host}", host=manager.host.name)
                continue
            if not d.called:
                self._stops[key] = d
                d.addBoth(self._stopped, key)

    def _stopped(self, result: bool | Failure, key: int) -> None:
        del self._stops[key]
        if isinstance(result, Failure):
            self.log.failure("idle stop", result)
        for observer in self._observers.pop(key, []):
            observer.callback(None)

    def operations(self) -> list[Deferred[Any]]:
        """One Deferred per idle stop in progress, firing when it is done."""
        observers: list[Deferred[Any]] = []
        for key in self._stops:
            d: Deferred[None] = Deferred()
            self._observers.setdefault(key, []).append(d)
            observers.append(d)
        return observers
