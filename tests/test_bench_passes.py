"""The cpu phase's passes (bench/passes.py): the order the targets take them
in, and how a target's figures are pooled. Fake phases: no process, no socket."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench import cli, steal
from bench.passes import pooled, turns
from bench.scenarios import Plan
from bench.targets import Target

FIRST: dict[str, Any] = {
    "streams": 150, "events": 22500, "incomplete": 0, "most_in_flight": 150, "seconds": 5.97,
    "lag_p50_ms": 0.1, "lag_p99_ms": 0.4, "lag_max_ms": 3.0, "steady_lag_p99_ms": 0.35,
    "steady_events": 15000, "steady_cpu_ms_per_1k": 30.0, "kept_up": True,
    "cpu_ms_per_1k": 40.0, "engine_cpu_ms_per_1k": 30.0, "client_cpu_ms_per_1k": 28.0,
    "runqueue_wait_ms": 5.0,
}
SECOND: dict[str, Any] = {
    **FIRST, "incomplete": 1, "seconds": 6.01, "lag_p99_ms": 0.9, "steady_lag_p99_ms": 0.3,
    "steady_events": 16000, "steady_cpu_ms_per_1k": 36.0, "cpu_ms_per_1k": 44.0,
    "runqueue_wait_ms": 7.5,
}


def test_a_targets_two_passes_are_pooled_over_their_events() -> None:
    """The steady CPU per event over both steady windows (not the mean of the two
    figures), the whole phase's the same way, the worse lag, counts summed; the
    passes kept."""
    out = pooled([FIRST, SECOND])
    assert out["steady_cpu_ms_per_1k"] == round((30.0 * 15000 + 36.0 * 16000) / 31000, 2)
    assert out["steady_cpu_ms_per_1k"] != (30.0 + 36.0) / 2
    assert out["steady_events"] == 31000
    assert out["cpu_ms_per_1k"] == 42.0 and out["events"] == 45000
    assert out["lag_p99_ms"] == 0.9 and out["steady_lag_p99_ms"] == 0.35
    assert out["seconds"] == 6.01 and out["incomplete"] == 1
    assert out["runqueue_wait_ms"] == 12.5
    assert out["kept_up"] is True and out["streams"] == 150
    assert out["passes"] == [FIRST, SECOND]


def test_a_pass_that_fell_behind_or_has_no_readings_leaves_no_clean_figure() -> None:
    assert pooled([FIRST, {**SECOND, "kept_up": False}])["kept_up"] is False
    direct = pooled([{**FIRST, "steady_cpu_ms_per_1k": None, "runqueue_wait_ms": None},
                     {**SECOND, "steady_cpu_ms_per_1k": None, "runqueue_wait_ms": None}])
    assert direct["steady_cpu_ms_per_1k"] is None and direct["runqueue_wait_ms"] is None


def test_the_cpu_phase_runs_four_times_in_mirrored_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A B C, C B A, A B C, C B A for the cpu phase, once each for the others;
    each target's cpu figures are its four passes pooled."""
    calls: list[str] = []

    async def phase(target: Target, plan: Plan) -> dict[str, Any]:
        calls.append(target.name)
        return {"events": 10, "steady_events": 5, "steady_cpu_ms_per_1k": float(len(calls))}

    monkeypatch.setitem(cli.PER_TARGET, "cpu", phase)
    monkeypatch.setitem(cli.PER_TARGET, "paced", phase)
    monkeypatch.setattr(cli, "SETTLE_SECONDS", 0)
    monkeypatch.setattr(steal, "sample", lambda: None)
    targets = {name: Target(name, 1) for name in ("direct", "llmproxy", "nginx")}
    results = asyncio.run(cli.run(["paced", "cpu"], targets, Plan(), []))
    assert calls == ["direct", "llmproxy", "nginx",
                     "direct", "llmproxy", "nginx", "nginx", "llmproxy", "direct",
                     "direct", "llmproxy", "nginx", "nginx", "llmproxy", "direct"]
    assert results["llmproxy"]["paced"] == {"events": 10, "steady_events": 5,
                                             "steady_cpu_ms_per_1k": 2.0, "steal_pct": None}
    assert results["llmproxy"]["cpu"]["steady_cpu_ms_per_1k"] == (5.0 + 8.0 + 11.0 + 14.0) / 4
    assert results["nginx"]["cpu"]["steady_cpu_ms_per_1k"] == (6.0 + 7.0 + 12.0 + 13.0) / 4
    assert [p["steady_cpu_ms_per_1k"] for p in results["direct"]["cpu"]["passes"]] == [
        4.0, 9.0, 10.0, 15.0]


def test_a_quick_run_takes_the_cpu_phase_in_one_round() -> None:
    """Forwards and backwards once (a smoke run), twice in a full run; any
    other phase once."""
    assert turns("cpu", ["a", "b"], Plan.quick().cpu_rounds) == ["a", "b", "b", "a"]
    assert turns("cpu", ["a", "b"], Plan().cpu_rounds) == ["a", "b", "b", "a"] * 2
    assert turns("paced", ["a", "b"], Plan().cpu_rounds) == ["a", "b"]
