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


def test_the_engine_client_is_off_and_says_why_without_httptools_or_with_an_old_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast engine client parses with httptools: when it cannot be imported,
    or is older than 0.6, its guard turns the speedup off and names httptools."""
    import sys
    import types

    from llmproxy.speedups import engineclient

    monkeypatch.setitem(sys.modules, "httptools", None)     # an import of it fails
    why = engineclient.guard()
    assert why is not None and "httptools (llhttp)" in why and "not installed" in why
    old = types.ModuleType("httptools")
    old.__version__ = "0.5.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "httptools", old)
    assert engineclient.guard() == "httptools 0.5.0 is older than 0.6"


def test_without_httptools_the_speedups_still_load_and_the_engine_client_is_reported_off(
) -> None:
    """In a process where httptools cannot be imported, the speedup modules
    still import and the selection reports engine_client off (loud fallback),
    the other speedups on."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import llmproxy

    root = str(Path(llmproxy.__file__).parents[1])     # this checkout's llmproxy
    code = ("import sys, json; sys.modules['httptools'] = None\n"
            f"sys.path.insert(0, {root!r})\n"
            "from llmproxy.speedups import select\n"
            "print(json.dumps(select({}).as_json()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True,
                         text=True, timeout=60)
    report = json.loads(out.stdout)
    assert "engine_client" not in report["active"] and report["active"]
    assert "httptools" in report["off"]["engine_client"]
