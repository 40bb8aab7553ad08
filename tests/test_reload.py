"""Reload logic with Clock and fakes: which changes apply and which are refused
by name, coalescing, the SIGHUP latch, and numbered roster reads."""

from __future__ import annotations

import signal
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from llmproxy.config import Config, ConfigError, parse_config
from llmproxy.hosts.roster import RosterEntry, Rosters
from llmproxy.lifecycle.reload import (
    APPLIED,
    KEPT,
    Reloader,
    applied_changes,
    refused_changes,
)
from llmproxy.lifecycle.signals import SignalLatch

BASE: dict[str, Any] = {
    "listen": "127.0.0.1:8080",
    "hosts": [{"name": "a", "url": "http://10.0.0.1:1"}, {"name": "b", "url": "http://10.0.0.2:1"}],
    "models": {"m": {"host": "a"}, "n": {"host": "b"}},
    "aliases": {"x": "m"},
}


def cfg(**changes: Any) -> Config:
    return parse_config({**BASE, **changes})


def test_refused_changes_name_every_field() -> None:
    """listen, a host's url, a timing: each named with `restart to apply`."""
    new = cfg(listen="127.0.0.1:9090", drain_seconds=5,
              hosts=[{"name": "a", "url": "http://10.0.0.9:1"},
                     {"name": "b", "url": "http://10.0.0.2:1"}])
    assert refused_changes(cfg(), new) == [
        "listen changed: restart to apply",
        "hosts[0].url changed: restart to apply",
        "drain_seconds changed: restart to apply",
    ]
    fewer = cfg(hosts=[{"name": "a", "url": "http://10.0.0.1:1"}], models={"m": {"host": "a"}})
    assert refused_changes(cfg(), fewer) == ["hosts changed (2 -> 1 hosts): restart to apply"]


def test_applied_changes_in_words() -> None:
    """Model, alias and naming changes are described as they will be logged."""
    new = cfg(models={"m": {"host": "a", "ctx": 8}, "o": {"host": "b"}},
              aliases={"y": "o"}, naming="host")
    assert refused_changes(cfg(), new) == []
    assert applied_changes(cfg(), new) == [
        "models (+o, -n, ~m)", "aliases (+y, -x)", "naming (plain -> host)"]


class Harness:
    def __init__(self) -> None:
        self.clock = Clock()
        self.running = cfg()
        self.file: Config | ConfigError = cfg()
        self.applied: list[Config] = []
        self.pending: Deferred[None] | None = None
        self.events: list[str] = []
        self.reloader = Reloader(
            load=self.load, current=lambda: self.running, apply=self.apply, clock=self.clock,
            on_begin=lambda: self.events.append("begin"),
            on_end=lambda r: self.events.append(r.outcome),
            engine_models=lambda: {"m"})

    def load(self) -> Config:
        self.events.append("read")
        if isinstance(self.file, ConfigError):
            raise self.file
        return self.file

    def apply(self, new: Config, changes: list[str]) -> Deferred[None]:
        self.events.append("apply")
        self.applied.append(new)
        self.running = new
        return self.pending if self.pending is not None else succeed(None)


def test_applied_reload_bumps_the_generation_and_logs_one_line() -> None:
    """A valid change is applied once, the generation moves, one line says what."""
    h = Harness()
    h.file = cfg(aliases={"x": "m", "y": "n"})
    with capturedLogs() as events:
        result = h.reloader.request()
    assert result.result.outcome == APPLIED and h.reloader.generation == 2
    lines = [formatEvent(e) for e in events]
    assert lines == ["reload: applied aliases (+y)"]
    assert h.events == ["begin", "read", "apply", "applied"]


def test_change_to_a_running_engine_model_says_so() -> None:
    """Changing a model a running engine serves adds the preset warning."""
    h = Harness()
    h.file = cfg(models={"m": {"host": "a", "ctx": 4096}, "n": {"host": "b"}})
    message = h.reloader.request().result.message
    assert message.endswith("a running engine keeps its old preset (ctx, options) until it "
                            "next starts (m)")


def test_refused_and_invalid_files_keep_the_running_config() -> None:
    """A refused change or an invalid file: kept, nothing applied, reason given."""
    h = Harness()
    h.file = cfg(listen="127.0.0.1:1")
    kept = h.reloader.request().result
    assert kept.outcome == KEPT and "listen changed: restart to apply" in kept.message
    h.file = ConfigError(["models.q.host: no host named 'z'"])
    kept = h.reloader.request().result
    assert kept.outcome == KEPT
    assert kept.message == ("reload: kept the running config: the file is invalid: "
                            "models.q.host: no host named 'z'")
    assert h.applied == [] and h.reloader.generation == 1


def test_coalescing_runs_exactly_one_more_pass() -> None:
    """While a pass is applying, later requests make exactly one more pass."""
    h = Harness()
    gate: Deferred[None] = Deferred()
    h.pending = gate
    h.file = cfg(aliases={"x": "m", "y": "m"})
    first = h.reloader.request()
    h.pending = None
    h.file = cfg(aliases={"x": "m", "z": "m"})
    second = h.reloader.request()
    h.file = cfg(aliases={"x": "m", "w": "m"})
    third = h.reloader.request()
    assert h.events == ["begin", "read", "apply"]
    gate.callback(None)
    assert h.events == ["begin", "read", "apply", "applied", "begin", "read", "apply", "applied"]
    assert first.result.message == "reload: applied aliases (+y)"
    assert second.result is third.result
    assert dict(h.running.aliases) == {"x": "m", "w": "m"}      # the last file won
    assert h.reloader.generation == 3


def test_hangup_before_the_first_read_is_satisfied_by_it() -> None:
    """SIGHUP before the config is read: the read covers it, no reload follows."""
    handlers: dict[int, Any] = {}
    latch = SignalLatch()
    latch.install(handlers.__setitem__)
    handlers[signal.SIGHUP](signal.SIGHUP, None)
    latch.config_read()
    calls: list[Any] = []
    latch.connect(FakeReactor(calls), lambda: None)
    assert calls == []


def test_hangup_after_the_read_but_before_the_reactor_is_delivered_once() -> None:
    """SIGHUP between the first read and the reactor running: one reload once running;
    later ones are handed to the reactor thread as they come."""
    handlers: dict[int, Any] = {}
    latch = SignalLatch()
    latch.install(handlers.__setitem__)
    latch.config_read()
    handlers[signal.SIGHUP](signal.SIGHUP, None)
    handlers[signal.SIGHUP](signal.SIGHUP, None)
    calls: list[Any] = []
    target = object()
    latch.connect(FakeReactor(calls), target)  # type: ignore[arg-type]
    assert calls == [target]
    handlers[signal.SIGHUP](signal.SIGHUP, None)
    assert calls == [target, target]


class FakeReactor:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def callFromThread(self, f: Any, *args: Any) -> None:
        self.calls.append(f)


def rosters_by_hand() -> tuple[Rosters, list[Deferred[tuple[RosterEntry, ...]]], Clock]:
    """Rosters whose reads the test answers by hand, in any order."""
    clock = Clock()
    pending: list[Deferred[tuple[RosterEntry, ...]]] = []

    def fetch(host: Any) -> Deferred[tuple[RosterEntry, ...]]:
        d: Deferred[tuple[RosterEntry, ...]] = Deferred()
        pending.append(d)
        return d

    return Rosters(clock, fetch, timeout=5), pending, clock


def test_roster_read_older_than_the_stored_one_is_dropped() -> None:
    """Overlapping reads: read 2 succeeds first, read 1 finishes late and is dropped."""
    rosters, pending, _ = rosters_by_hand()
    hosts = cfg().hosts[:1]
    rosters.read_all(hosts)                 # read 1
    rosters.read_all(hosts)                 # read 2
    pending[1].callback((RosterEntry("new"),))
    pending[0].callback((RosterEntry("old"),))
    stored = rosters.by_host["a"]
    assert stored.generation == 2 and [e.id for e in stored.models] == ["new"]


def test_failed_newer_read_keeps_the_older_good_roster() -> None:
    """Read 2 fails (timeout): read 1's roster stays, with read 2's error noted."""
    rosters, pending, clock = rosters_by_hand()
    hosts = cfg().hosts[:1]
    rosters.read_all(hosts)
    pending[0].callback((RosterEntry("good"),))
    done = rosters.read_all(hosts)
    clock.advance(5)
    assert done.called
    stored = rosters.by_host["a"]
    assert stored.generation == 1 and [e.id for e in stored.models] == ["good"]
    assert stored.last_error == "no answer within 5s"
