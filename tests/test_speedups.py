"""The speedups switch, the guards, and how the process reports what is on."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from twisted.logger import LogLevel, capturedLogs

from llmproxy import speedups
from llmproxy.observe.fastpaths import FastPathMetrics, log_report
from llmproxy.speedups import Selection, Speedup, guards, run_guard, select, switched_on


def test_every_guard_matches_the_installed_twisted() -> None:
    """Each speedup's guard passes on the Twisted this project pins; when an
    upgrade changes code a speedup follows, this fails and names the guard."""
    known = speedups.known()
    assert known, "no speedup is registered (llmproxy.speedups.MODULES)"
    failing = {s.name: run_guard(s) for s in known if run_guard(s) is not None}
    assert failing == {}


def test_a_changed_source_is_named() -> None:
    """A digest that does not match names the object and both digests; a name
    that is gone is said to be gone."""
    name = "twisted.web.http.HTTPChannel.lineReceived"
    real = guards.source_digest(guards.resolve(name))
    assert guards.changed_sources({name: real}) is None
    why = guards.changed_sources({name: "0" * 16, "twisted.web.http.NoSuchThing": "1" * 16})
    assert why is not None
    assert f"{name} changed (source {real}, known {'0' * 16})" in why
    assert "twisted.web.http.NoSuchThing is gone" in why


def _fake(monkeypatch: pytest.MonkeyPatch, *made: Speedup) -> None:
    monkeypatch.setattr(speedups, "known", lambda: made)


def test_the_switch_turns_every_speedup_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLMPROXY_SPEEDUPS=0 runs the reference path alone, and says why each is off."""
    _fake(monkeypatch, Speedup("a", "", lambda: None), Speedup("b", "", lambda: None))
    for value in ("0", "off", "false", " NO "):
        assert not switched_on({"LLMPROXY_SPEEDUPS": value})
        assert select({"LLMPROXY_SPEEDUPS": value}) == Selection(
            False, (), {"a": "LLMPROXY_SPEEDUPS=0", "b": "LLMPROXY_SPEEDUPS=0"})
    assert switched_on({}) and switched_on({"LLMPROXY_SPEEDUPS": "1"})


def test_a_failing_or_raising_guard_turns_only_its_speedup_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard that finds another Twisted, or raises, is a reason: the others stay on."""
    def broken() -> str | None:
        raise AttributeError("no such thing")

    _fake(monkeypatch, Speedup("ok", "", lambda: None), Speedup("old", "", lambda: "changed"),
          Speedup("broken", "", broken))
    chosen = select({})
    assert chosen.enabled and chosen.active == ("ok",)
    assert chosen.off == {"old": "changed",
                          "broken": "its guard failed: AttributeError: no such thing"}
    assert chosen.on("ok") and not chosen.on("old")
    assert chosen.as_json() == {"enabled": True, "active": ["ok"], "off": dict(chosen.off)}


def _levels(report: dict[str, Any]) -> list[tuple[LogLevel, str]]:
    with capturedLogs() as events:
        log_report("speedups", report)
    from twisted.logger import formatEvent

    return [(e["log_level"], formatEvent(e)) for e in events]


def test_the_start_up_log_names_each_speedup_off_and_why() -> None:
    """No silent fallback: one line for what is on, a warning per one off."""
    assert _levels({"enabled": True, "active": ["a"], "off": {"b": "changed"}}) == [
        (LogLevel.info, "speedups: on: a"), (LogLevel.warn, "speedups: b is off: changed")]
    assert _levels({"enabled": False, "active": [], "off": {"a": "LLMPROXY_SPEEDUPS=0"}}) == [
        (LogLevel.warn, "speedups: off (LLMPROXY_SPEEDUPS=0): the reference path alone")]


def test_the_metrics_say_which_are_on() -> None:
    """`llmproxy_speedup_active` is 1 for each one on and 0 for each one off."""
    registry = CollectorRegistry()
    registry.register(FastPathMetrics({"active": ["a"], "off": {"b": "x"}},
                                      {"active": [], "off": {"c": "y"}}))
    text = generate_latest(registry).decode()
    assert 'llmproxy_speedup_active{speedup="a"} 1.0' in text
    assert 'llmproxy_speedup_active{speedup="b"} 0.0' in text
    assert 'llmproxy_compat_active{entry="c"} 0.0' in text


def test_named_speedups_can_be_left_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLMPROXY_SPEEDUPS_OFF leaves the named ones off (how the bench measures
    each one's gain), and says so; the others stay on."""
    _fake(monkeypatch, Speedup("a", "", lambda: None), Speedup("b", "", lambda: None))
    chosen = select({"LLMPROXY_SPEEDUPS_OFF": " b, nonesuch"})
    assert chosen == Selection(True, ("a",), {"b": "LLMPROXY_SPEEDUPS_OFF names it"})
