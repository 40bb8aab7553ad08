"""The VM's steal time in the bench (bench/steal.py): read from /proc/stat's text,
carried by each phase's figures, named beside a budget it may have moved."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench import budgets, cli, report, steal
from bench.scenarios import Plan
from bench.targets import Target

STAT = """cpu  844516 1278 124437 3617068 2405 0 41126 11564 0 0
cpu0 403488 663 62403 1826690 1492 0 20604 5856 0 0
intr 1234 0 9
"""


def test_the_machine_line_gives_steal_and_total_ticks() -> None:
    """The `cpu` line, not a CPU's own; guest time (in user already) not counted twice."""
    assert steal.parse_cpu_line(STAT) == (11564, 844516 + 1278 + 124437 + 3617068 + 2405
                                          + 0 + 41126 + 11564)


@pytest.mark.parametrize("text", ["", "cpu  1 2 3 4 5 6 7\n", "cpu  1 2 x 4 5 6 7 8\n",
                                  "cpu0 1 2 3 4 5 6 7 8\n"])
def test_a_line_without_steal_gives_nothing(text: str) -> None:
    assert steal.parse_cpu_line(text) is None


def test_the_share_stolen_between_two_samples(tmp_path: Path) -> None:
    assert steal.stolen_pct((100, 10_000), (130, 11_000)) == 3.0
    assert steal.stolen_pct((100, 10_000), (100, 10_000)) is None
    assert steal.stolen_pct(None, (100, 10_000)) is None
    assert steal.sample(tmp_path / "absent") is None
    (tmp_path / "stat").write_text(STAT)
    assert steal.sample(tmp_path / "stat") == steal.parse_cpu_line(STAT)


def test_every_phase_and_turn_carries_its_steal(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interleaved phase: one share for all its targets; a target's own turns:
    each its own, the worst of a mirrored phase's four kept."""
    samples = iter([(0, 1000), (10, 2000),          # latency: 1 %
                    (10, 2000), (10, 3000),          # cpu: direct 0 %
                    (10, 3000), (60, 4000),          # llmproxy 5 %
                    (60, 4000), (80, 5000),          # llmproxy again 2 %
                    (80, 5000), (80, 6000),          # direct again 0 %
                    (80, 6000), (80, 7000),          # the second round: direct 0 %
                    (80, 7000), (90, 8000),          # llmproxy 1 %
                    (90, 8000), (120, 9000),         # llmproxy 3 %
                    (120, 9000), (120, 10000)])      # direct 0 %
    monkeypatch.setattr(steal, "sample", lambda: next(samples))

    async def both(targets: list[Target], plan: Plan) -> dict[str, Any]:
        return {t.name: {"p50_ms": 0.1} for t in targets}

    async def turn(target: Target, plan: Plan) -> dict[str, Any]:
        return {"events": 10, "steady_events": 5, "steady_cpu_ms_per_1k": 1.0}

    monkeypatch.setitem(cli.INTERLEAVED, "latency", both)
    monkeypatch.setitem(cli.PER_TARGET, "cpu", turn)
    monkeypatch.setattr(cli, "SETTLE_SECONDS", 0)
    targets = {name: Target(name, 1) for name in ("direct", "llmproxy")}
    results = asyncio.run(cli.run(["latency", "cpu"], targets, Plan(), []))
    assert results["direct"]["latency"]["steal_pct"] == 1.0
    assert results["llmproxy"]["latency"]["steal_pct"] == 1.0
    assert results["llmproxy"]["cpu"]["steal_pct"] == 5.0
    assert [p["steal_pct"] for p in results["llmproxy"]["cpu"]["passes"]] == [5.0, 2.0, 1.0, 3.0]
    row = dict(report.rows(Plan().__dict__))["VM steal, most in a phase (% of CPU time)"]
    assert row(results, "llmproxy") == "5.0 cpu"
    assert row(results, "direct") == "1.0 latency"
    assert row({}, "nginx") == "-"
    wide = {"direct": {"throughput": {"events_per_s": 1, "steal_pct": 12.5}},
            "llmproxy": {"throughput": {"events_per_s": 2, "steal_pct": 18.75}}}
    table = report.table(wide, ["direct", "llmproxy"], Plan().__dict__)
    [line] = [t for t in table.splitlines() if t.startswith("VM steal")]
    assert line.split()[-4:] == ["12.5", "throughput", "18.8", "throughput"]


def _results(**steal_pct: float) -> dict[str, Any]:
    return {
        "direct": {"latency": {"p50_ms": 0.2, "p99_ms": 0.4, "steal_pct": steal_pct["latency"]},
                   "ttfb": {"p50_ms": 0.2, "p99_ms": 0.4, "steal_pct": 0.1}},
        "llmproxy": {"latency": {"p50_ms": 0.8, "p99_ms": 1.0,
                                 "steal_pct": steal_pct["latency"]},
                     "ttfb": {"p50_ms": 0.4, "p99_ms": 0.6, "steal_pct": 0.1},
                     "cpu": {"steady_cpu_ms_per_1k": 30.0, "steal_pct": steal_pct["proxy_cpu"]}},
        "nginx": {"cpu": {"steady_cpu_ms_per_1k": 20.0, "steal_pct": steal_pct["nginx_cpu"]}},
    }


def test_a_phase_with_much_stolen_is_named_beside_its_budgets_never_excused() -> None:
    checks = {c.key: c for c in budgets.evaluate(_results(latency=7.5, proxy_cpu=0.2,
                                                             nginx_cpu=4.0))}
    assert checks["added_latency_p50"].status == "fail"
    assert "took 7.5 % of its CPU time during the latency phase" in \
        checks["added_latency_p50"].note
    assert "7.5 %" in checks["added_latency_p99"].note
    assert checks["added_ttfb_p50"].note == ""
    assert checks["cpu_vs_nginx"].status == "pass"
    assert "4.0 % of its CPU time during the cpu phase (nginx's turn)" in \
        checks["cpu_vs_nginx"].note
    quiet = {c.key: c for c in budgets.evaluate(_results(latency=budgets.STOLEN_PCT,
                                                            proxy_cpu=0.0, nginx_cpu=0.0))}
    assert quiet["added_latency_p50"].status == "fail" and quiet["added_latency_p50"].note == ""
    assert quiet["cpu_vs_nginx"].note == ""
