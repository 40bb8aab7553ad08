"""The benchmark's budgets (bench/budgets.py): two sets, one per mode of llmproxy
(speedups on: the `llmproxy` target; the reference path: `llmproxy-reference`),
each evaluated from made-up figures of one run. Pure arithmetic: no process."""

from __future__ import annotations

from typing import Any

import pytest

from bench import budgets
from bench.budgets import PROXY, REFERENCE, evaluate, failed


def results(reference: dict[str, Any] | None = None, **proxy: Any) -> dict[str, Any]:
    """A run's results where both llmproxy targets meet every budget of their set;
    `proxy` overrides llmproxy's figures as `phase_figure=value`, `reference` those of
    llmproxy-reference the same way. The reference figures exceed the speedups'
    limits (added p50 +0.70 ms, 4x nginx's CPU, 15 ms paced lag, a burst lag 2.5x
    nginx's) but not its own."""
    out: dict[str, Any] = {
        "direct": {"latency": {"p50_ms": 0.25, "p99_ms": 0.50},
                   "ttfb": {"p50_ms": 0.25, "p99_ms": 0.60},
                   "throughput": {"events_per_s": 150_000}},
        PROXY: {"latency": {"p50_ms": 0.60, "p99_ms": 2.00},
                "ttfb": {"p50_ms": 0.70, "p99_ms": 2.00},
                "cpu": {"steady_cpu_ms_per_1k": 60.0, "kept_up": True},
                "paced": {"lag_p99_ms": 4.0, "cpu_ms_per_1k": 60.0},
                "burst": {"lag_p99_ms": 12.0},
                "rss": {"streams": 1000, "completed": 1000, "peak_rss_mib": 90.0}},
        REFERENCE: {"latency": {"p50_ms": 0.95, "p99_ms": 3.00},
                    "ttfb": {"p50_ms": 1.10, "p99_ms": 3.50},
                    "cpu": {"steady_cpu_ms_per_1k": 140.0, "kept_up": True},
                    "paced": {"lag_p99_ms": 15.0, "cpu_ms_per_1k": 150.0},
                    "burst": {"lag_p99_ms": 18.0},
                    "rss": {"streams": 1000, "completed": 1000, "peak_rss_mib": 110.0}},
        "nginx": {"cpu": {"steady_cpu_ms_per_1k": 35.0, "kept_up": True},
                  "paced": {"cpu_ms_per_1k": 35.0},
                  "burst": {"lag_p99_ms": 7.2}},
    }
    for target, figures in ((PROXY, proxy), (REFERENCE, reference or {})):
        for key, value in figures.items():
            phase, figure = key.split("_", 1)
            out[target][phase][figure] = value
    return out


def by_key(checks: list[budgets.Check]) -> dict[str, budgets.Check]:
    return {c.key: c for c in checks}


SPEEDUPS_KEYS = ["added_latency_p50", "added_ttfb_p50", "added_latency_p99", "paced_lag_p99",
                 "burst_lag_vs_nginx", "cpu_vs_nginx", "streams_whole", "rss_streams"]
REFERENCE_KEYS = ["reference_added_latency_p50", "reference_paced_lag_p99",
                  "reference_burst_lag_p99", "reference_cpu_vs_nginx", "reference_streams_whole",
                  "reference_rss_streams"]


def test_the_limits_are_the_issues() -> None:
    """Speedups on: +0.5 ms p50 and TTFB p50, +2 ms p99, 5 ms paced lag, a burst lag p99
    within 2x nginx's, 2.5x nginx's CPU, 1,000 streams in under 150 MB; the reference
    path: +1 ms p50, 20 ms paced lag, 20 ms burst lag, 5x nginx's CPU, 1,000 streams in
    under 150 MB."""
    on = {c.key: c.limit for c in evaluate(results()) if c.target == PROXY}
    assert on == {"added_latency_p50": 0.5, "added_ttfb_p50": 0.5, "added_latency_p99": 2.0,
                  "paced_lag_p99": 5.0, "burst_lag_vs_nginx": 2.0, "cpu_vs_nginx": 2.5,
                  "streams_whole": 1000.0, "rss_streams": 150.0}
    ref = {c.key: c.limit for c in evaluate(results()) if c.target == REFERENCE}
    assert ref == {"reference_added_latency_p50": 1.0, "reference_paced_lag_p99": 20.0,
                   "reference_burst_lag_p99": 20.0, "reference_cpu_vs_nginx": 5.0,
                   "reference_streams_whole": 1000.0,
                   "reference_rss_streams": 150.0}


def test_every_budget_met() -> None:
    """Figures within every limit pass every budget of both sets, in a fixed order;
    added latency is the target's percentile minus the direct connection's, the CPU
    budget a ratio to nginx's."""
    checks = evaluate(results())
    assert [c.key for c in checks] == [*SPEEDUPS_KEYS, *REFERENCE_KEYS, "harness_events_per_s"]
    assert {c.status for c in checks} == {"pass"}
    assert failed(checks) == []
    by = by_key(checks)
    assert by["added_latency_p50"].value == pytest.approx(0.35)
    assert by["added_ttfb_p50"].value == pytest.approx(0.45)
    assert by["added_latency_p99"].value == pytest.approx(1.50)
    assert by["cpu_vs_nginx"].value == pytest.approx(60.0 / 35.0)
    assert by["reference_added_latency_p50"].value == pytest.approx(0.70)
    assert by["reference_cpu_vs_nginx"].value == pytest.approx(4.0)
    assert by["reference_paced_lag_p99"].value == 15.0
    assert by["harness_events_per_s"].target == "direct"


# (target, check, figure, at the limit, just past it): added figures over the
# direct connection's p50 0.25 ms and p99 0.5 ms, CPU over nginx's 35 ms per 1k.
LIMITS = [
    (PROXY, "added_latency_p50", "latency_p50_ms", 0.75, 0.7501),
    (PROXY, "added_ttfb_p50", "ttfb_p50_ms", 0.75, 0.7501),
    (PROXY, "added_latency_p99", "latency_p99_ms", 2.5, 2.5001),
    (PROXY, "paced_lag_p99", "paced_lag_p99_ms", 5.0, 5.001),
    (PROXY, "burst_lag_vs_nginx", "burst_lag_p99_ms", 14.4, 14.41),
    (PROXY, "cpu_vs_nginx", "cpu_steady_cpu_ms_per_1k", 87.5, 87.51),
    (PROXY, "rss_streams", "rss_peak_rss_mib", 149.9, 150.0),
    (REFERENCE, "reference_added_latency_p50", "latency_p50_ms", 1.25, 1.2501),
    (REFERENCE, "reference_paced_lag_p99", "paced_lag_p99_ms", 20.0, 20.001),
    (REFERENCE, "reference_burst_lag_p99", "burst_lag_p99_ms", 20.0, 20.001),
    (REFERENCE, "reference_cpu_vs_nginx", "cpu_steady_cpu_ms_per_1k", 175.0, 175.1),
    (REFERENCE, "reference_rss_streams", "rss_peak_rss_mib", 149.9, 150.0),
]


@pytest.mark.parametrize(("target", "key", "figure", "at", "past"), LIMITS,
                         ids=[row[1] for row in LIMITS])
def test_each_budget_passes_at_its_limit_and_fails_past_it(
        target: str, key: str, figure: str, at: float, past: float) -> None:
    """A figure equal to its limit passes (<=), except the RSS ones, which must be
    below it; just past the limit fails that budget and no other."""
    def run(value: float) -> list[budgets.Check]:
        figures = {figure: value}
        return evaluate(results(**figures) if target == PROXY else results(figures))

    passing = by_key(run(at))[key]
    assert passing.status == "pass", passing
    assert passing.target == target
    if key.endswith("rss_streams"):
        assert passing.value == at < passing.limit
    else:
        assert passing.value == pytest.approx(passing.limit)
    assert [c.key for c in failed(run(past))] == [key]


def test_an_incomplete_stream_fails_either_set() -> None:
    """1,000 streams must all complete in both modes: one short is a failure, named."""
    check = by_key(evaluate(results(rss_completed=999)))["streams_whole"]
    assert check.status == "fail" and "1 incomplete" in check.note
    checks = evaluate(results({"rss_completed": 998}))
    assert [c.key for c in failed(checks)] == ["reference_streams_whole"]
    assert "2 incomplete" in by_key(checks)["reference_streams_whole"].note


def test_the_two_sets_are_checked_separately() -> None:
    """The reference path's figures are held to its own limits, not the speedups';
    a failure of one set leaves the other's verdicts alone."""
    ok = by_key(evaluate(results()))
    assert ok["reference_added_latency_p50"].value > budgets.ADDED_P50_MS
    assert ok["reference_cpu_vs_nginx"].value > budgets.CPU_RATIO_TO_NGINX
    assert ok["reference_paced_lag_p99"].value > budgets.PACED_LAG_P99_MS
    assert ok["reference_added_latency_p50"].status == "pass"
    only_proxy = failed(evaluate(results(latency_p50_ms=1.0, paced_lag_p99_ms=9.0)))
    assert [(c.key, c.target) for c in only_proxy] == [
        ("added_latency_p50", PROXY), ("paced_lag_p99", PROXY)]
    only_reference = failed(evaluate(results({"paced_lag_p99_ms": 25.0,
                                              "cpu_steady_cpu_ms_per_1k": 200.0})))
    assert [(c.key, c.target) for c in only_reference] == [
        ("reference_paced_lag_p99", REFERENCE), ("reference_cpu_vs_nginx", REFERENCE)]


def test_without_the_reference_target_its_budgets_are_skipped_never_passed() -> None:
    """No llmproxy-reference in the run: each of its budgets is skipped with a note
    naming what it needs; the speedups' set stands on its own."""
    r = results()
    del r[REFERENCE]
    checks = evaluate(r)
    reference = [c for c in checks if c.target == REFERENCE]
    assert [c.key for c in reference] == REFERENCE_KEYS
    for c in reference:
        assert c.status == "skip", c
        assert REFERENCE in c.note, c
        assert c.value is None
    assert {c.status for c in checks if c.target == PROXY} == {"pass"}
    assert failed(checks) == []


@pytest.mark.parametrize(("phase", "keys"), [
    ("latency", ["reference_added_latency_p50"]),
    ("paced", ["reference_paced_lag_p99"]),
    ("burst", ["reference_burst_lag_p99"]),
    ("cpu", ["reference_cpu_vs_nginx"]),
    ("rss", ["reference_streams_whole", "reference_rss_streams"]),
])
def test_a_missing_reference_figure_skips_its_budget_with_a_note(
        phase: str, keys: list[str]) -> None:
    """The reference target measured, one of its phases not: that phase's budgets
    are skipped, each with a note; the others still judged."""
    r = results()
    del r[REFERENCE][phase]
    checks = by_key(evaluate(r))
    for key in keys:
        assert checks[key].status == "skip"
        assert checks[key].note
    judged = [k for k in REFERENCE_KEYS if k not in keys]
    assert {checks[k].status for k in judged} == {"pass"}


def test_without_nginx_both_cpu_budgets_are_skipped_not_passed() -> None:
    """No nginx in the run: each set's CPU budget, and the burst lag's ratio to
    nginx's, say they were skipped and why."""
    r = results()
    del r["nginx"]
    checks = by_key(evaluate(r))
    for key in ("cpu_vs_nginx", "reference_cpu_vs_nginx", "burst_lag_vs_nginx"):
        assert checks[key].status == "skip"
        assert "nginx" in checks[key].note
    assert checks["added_latency_p50"].status == "pass"
    assert checks["reference_added_latency_p50"].status == "pass"


def test_without_the_direct_target_added_figures_are_skipped() -> None:
    """Added latency needs the direct figures of the same run; without them it is skipped."""
    r = results()
    del r["direct"]
    checks = by_key(evaluate(r))
    for key in ("added_latency_p50", "added_ttfb_p50", "added_latency_p99",
                "reference_added_latency_p50", "harness_events_per_s"):
        assert checks[key].status == "skip", key
    assert checks["paced_lag_p99"].status == "pass"
    assert checks["reference_paced_lag_p99"].status == "pass"


def test_todays_figures_fail_the_budgets_they_exceed() -> None:
    """The figures measured before issue 13 (+1.03 ms p50, 37 ms paced lag p99, about 4x
    nginx's CPU) fail exactly those budgets of the speedups' set."""
    checks = evaluate(results(latency_p50_ms=1.28, paced_lag_p99_ms=37.0,
                              cpu_steady_cpu_ms_per_1k=140.0))
    assert sorted(c.key for c in failed(checks)) == [
        "added_latency_p50", "cpu_vs_nginx", "paced_lag_p99"]
    assert by_key(checks)["added_latency_p50"].value == pytest.approx(1.03)


def test_a_proxy_that_fell_behind_gets_no_clean_cpu_figure() -> None:
    """A llmproxy target that fell behind in the cpu phase relayed events in batches and
    its CPU per event looks cheaper: the check still counts but says so."""
    check = by_key(evaluate(results(cpu_kept_up=False)))["cpu_vs_nginx"]
    assert check.status == "pass"
    assert "fell behind" in check.note and "flattered" in check.note
    check = by_key(evaluate(results({"cpu_kept_up": False})))["reference_cpu_vs_nginx"]
    assert check.status == "pass"
    assert f"{REFERENCE} fell behind" in check.note


def test_a_disturbed_machine_is_named_beside_the_paced_lag_never_excused() -> None:
    """When the direct connection, with no proxy at all, had a paced lag p99 above a
    quiet machine's, the paced-lag checks say so; their verdicts stay the figures'."""
    r = results(paced_lag_p99_ms=9.9)
    r["direct"]["paced"] = {"lag_p99_ms": 3.3}
    checks = by_key(evaluate(r))
    assert checks["paced_lag_p99"].status == "fail"
    assert "held this run back" in checks["paced_lag_p99"].note
    assert "3.3 ms" in checks["paced_lag_p99"].note
    assert checks["reference_paced_lag_p99"].status == "pass"
    assert "3.3 ms" in checks["reference_paced_lag_p99"].note
    r["direct"]["paced"] = {"lag_p99_ms": 0.4}
    quiet = by_key(evaluate(r))["paced_lag_p99"]
    assert quiet.status == "fail" and quiet.note == ""
    r = results(paced_lag_p99_ms=2.0)
    r["direct"]["paced"] = {"lag_p99_ms": 1.5}
    check = by_key(evaluate(r))["paced_lag_p99"]
    assert check.status == "pass" and "1.5 ms" in check.note


def test_a_disturbed_machine_is_named_beside_the_latency_and_ttfb_budgets() -> None:
    """The direct connection's own p99 above a quiet machine's: the latency checks
    (p50 and p99) or the TTFB check say so, each by its own phase."""
    r = results(latency_p50_ms=0.80)
    r["direct"]["latency"]["p99_ms"] = 2.0
    checks = by_key(evaluate(r))
    assert checks["added_latency_p50"].status == "fail"
    assert "latency p99 of 2.0 ms" in checks["added_latency_p50"].note
    assert "latency p99 of 2.0 ms" in checks["added_latency_p99"].note
    assert "latency p99 of 2.0 ms" in checks["reference_added_latency_p50"].note
    assert checks["added_ttfb_p50"].note == ""
    r["direct"]["ttfb"]["p99_ms"] = 3.0
    assert "TTFB p99 of 3.0 ms" in by_key(evaluate(r))["added_ttfb_p50"].note


def test_a_slow_floor_is_named_beside_the_added_p50_budgets_never_excused() -> None:
    """nginx adding more than a quiet machine's to the direct connection's p50
    in a phase: that phase's added-p50 budgets say so; the verdicts stay."""
    r = results(ttfb_p50_ms=0.90)
    r["nginx"]["ttfb"] = {"p50_ms": 0.25 + 0.101}
    r["nginx"]["latency"] = {"p50_ms": 0.25 + 0.05}
    checks = by_key(evaluate(r))
    assert checks["added_ttfb_p50"].status == "fail"
    assert "nginx, the C floor, added 0.101 ms to the p50" in checks["added_ttfb_p50"].note
    assert checks["added_latency_p50"].note == ""
    r["nginx"]["ttfb"] = {"p50_ms": 0.25 + 0.09}
    r["nginx"]["latency"] = {"p50_ms": 0.25 + 0.2}
    checks = by_key(evaluate(r))
    assert checks["added_ttfb_p50"].note == ""
    assert "added 0.200 ms" in checks["reference_added_latency_p50"].note


def test_the_reference_targets_own_steal_is_named_beside_its_budgets() -> None:
    """The VM's host taking CPU time during llmproxy-reference's cpu turn is named
    beside the reference's CPU budget, not the speedups'."""
    r = results({"cpu_steal_pct": 6.0})
    checks = by_key(evaluate(r))
    assert f"during the cpu phase ({REFERENCE}'s turn)" in checks["reference_cpu_vs_nginx"].note
    assert checks["cpu_vs_nginx"].note == ""


def test_a_slow_harness_is_reported() -> None:
    """The engine and client must do 80,000 events/s direct, or the run says it is suspect."""
    r = results()
    r["direct"]["throughput"]["events_per_s"] = 60_000
    check = by_key(evaluate(r))["harness_events_per_s"]
    assert check.status == "fail"
    assert "suspect" in check.note


def test_the_burst_lag_is_judged_against_nginx_of_the_same_run() -> None:
    """The speedups' burst budget is a ratio to nginx's burst lag p99 of the same run:
    the same llmproxy figure passes beside a slow nginx and fails beside a quick one;
    a disturbed machine (the direct connection's own burst p99 above a quiet
    machine's, 15 ms: the client reads 200 events a step) is named in the note,
    the verdict staying the figure's."""
    r = results(burst_lag_p99_ms=12.0)
    r["nginx"]["burst"] = {"lag_p99_ms": 5.0}
    check = by_key(evaluate(r))["burst_lag_vs_nginx"]
    assert check.status == "fail" and check.value == pytest.approx(2.4)
    r["nginx"]["burst"] = {"lag_p99_ms": 8.0}
    assert by_key(evaluate(r))["burst_lag_vs_nginx"].status == "pass"
    r["direct"]["burst"] = {"lag_p99_ms": 12.0}     # the client's own, on a quiet machine
    assert by_key(evaluate(r))["burst_lag_vs_nginx"].note == ""
    r["direct"]["burst"] = {"lag_p99_ms": 16.5}
    checks = by_key(evaluate(r))
    assert checks["burst_lag_vs_nginx"].status == "pass"
    assert "16.5 ms" in checks["burst_lag_vs_nginx"].note
    assert "burst lag p99" in checks["reference_burst_lag_p99"].note
