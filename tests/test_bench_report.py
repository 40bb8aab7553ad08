"""The benchmark's table, budget lines and JSON (bench/report.py, cli.publish): both
modes of llmproxy side by side. Made-up figures: no process, no socket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import cli, report
from bench.budgets import REFERENCE, evaluate
from bench.scenarios import Plan
from tests.test_bench_budgets import results

COLUMNS = ["direct", "llmproxy", "llmproxy-reference", "nginx"]


def _row(text: str, start: str) -> list[str]:
    return next(line for line in text.splitlines() if line.strip().startswith(start)).split()


def test_the_table_shows_both_modes_side_by_side() -> None:
    """A column per target, llmproxy's and llmproxy-reference's beside each other,
    '-' where a figure was not measured."""
    text = report.table(results(), COLUMNS, Plan().__dict__)
    assert text.splitlines()[0].split()[1:] == COLUMNS
    assert _row(text, "added p50")[-3:] == ["+0.350", "+0.700", "-"]
    assert _row(text, "CPU per event vs nginx")[-3:] == ["1.71x", "4.00x", "1.00x"]
    assert _row(text, "paced lag p99")[-3:] == ["4.000", "15.000", "-"]
    assert _row(text, "peak RSS")[-3:] == ["90.0", "110.0", "-"]


def test_each_column_is_as_wide_as_its_own_name_and_cells() -> None:
    """A long target name widens its own column only."""
    targets = ["direct", "llmproxy", "llmproxy-without-sendnow"]
    r = results()
    r["llmproxy-without-sendnow"] = r[REFERENCE]
    header = report.table(r, targets, Plan().__dict__).splitlines()[0]
    label_width = max(len(label) for label, _ in report.rows(Plan().__dict__))
    assert header == "figure".ljust(label_width) + "      direct    llmproxy" \
        "  llmproxy-without-sendnow"


def test_the_table_leaves_out_phases_that_were_not_run() -> None:
    """Rows of a phase no target measured are left out, not shown as dashes."""
    text = report.table(results(), COLUMNS, Plan().__dict__)
    assert "latency p50" in text
    assert "events/s" in text          # the direct target measured it
    assert "wall time" not in text     # rss: only peak RSS and completion were given


def test_the_budgets_are_printed_under_a_heading_per_set() -> None:
    """The speedups' set, then the reference path's, then the harness's, each line
    under its heading, the measured values aligned across the sets."""
    r = results({"paced_lag_p99_ms": 25.0})
    del r["nginx"]
    text = report.budget_sections(evaluate(r))
    lines = text.splitlines()
    headings = [line for line in lines if not line.startswith("  ")]
    assert headings == ["llmproxy, speedups on:",
                        "llmproxy-reference, the reference path alone (LLMPROXY_SPEEDUPS=0):",
                        "the harness:"]
    assert len(lines) == 3 + 15
    after = lines[lines.index(headings[1]) + 1:lines.index(headings[2])]
    assert after[0].split()[:5] == ["PASS", "added", "latency", "p50", "(non-streamed)"]
    failing = next(line for line in after if line.split()[0] == "FAIL")
    assert "paced event lag p99" in failing and "25.000 ms  <= 20 ms" in failing
    skipped = [line for line in after if line.split()[0] == "SKIP"]
    assert len(skipped) == 1 and "2.5x" not in skipped[0] and "<= 5x nginx" in skipped[0]
    assert "no C floor" in skipped[0]
    # The same limits read the same in both sets: streams all complete, RSS below.
    whole = [line for line in lines if "all complete" in line]
    assert [line.endswith("1,000 streams  == 1,000") for line in whole] == [True, True]
    memory = [line.split("MiB")[1] for line in lines if "peak RSS" in line]
    assert memory == ["  < 150 ", "  < 150 "]


def test_the_modes_line_says_what_each_proxy_runs() -> None:
    text = report.modes({
        "llmproxy": {"enabled": True, "active": ["sendnow", "site"], "off": {}},
        "llmproxy-reference": {"enabled": False, "active": [],
                               "off": {"sendnow": "LLMPROXY_SPEEDUPS=0"}},
        "twisted": None,
    })
    assert text.splitlines() == [
        "llmproxy: speedups on; active: sendnow, site; off: none",
        "llmproxy-reference: speedups off; active: none; off: sendnow (LLMPROXY_SPEEDUPS=0)"]


def _publish(tmp_path: Path, r: dict[str, Any], *extra: str) -> tuple[int, dict[str, Any]]:
    path = tmp_path / "bench-results.json"
    args = cli.parse_args(["--json", str(path), *extra])
    info = {"cores": 2, "os": "Debian 12", "python": "3.11.2",
            "python_executable": "/usr/bin/python3.11", "nginx": "1.22.1",
            "speedups": {"llmproxy": {"enabled": True, "active": [], "off": {}},
                         REFERENCE: {"enabled": False, "active": [], "off": {}}}}
    status = cli.publish(args, info, Plan(), COLUMNS, r)
    return status, json.loads(path.read_text())


def test_the_json_has_both_modes_and_each_budgets_target(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench-results.json carries both targets' figures, their added latency, every
    budget of both sets with its target; the run exits 0 when all are met."""
    status, doc = _publish(tmp_path, results())
    assert status == 0
    assert doc["targets"] == COLUMNS
    assert {"llmproxy", REFERENCE} <= set(doc["results"])
    assert doc["added"][REFERENCE]["latency_p50_ms"] == pytest.approx(0.70)
    targets = {b["key"]: b["target"] for b in doc["budgets"]}
    assert targets["added_latency_p50"] == "llmproxy"
    assert targets["reference_added_latency_p50"] == REFERENCE
    assert doc["failed"] == []
    assert doc["meta"]["speedups"][REFERENCE]["enabled"] is False
    out = capsys.readouterr().out
    assert "llmproxy-reference: speedups off" in out
    assert "all budgets met" in out


def test_a_failure_of_either_set_fails_the_run(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Exit status 1 when a budget of the reference path fails, as of the speedups'
    (0 with --no-fail, the failure still in the JSON)."""
    status, doc = _publish(tmp_path, results({"latency_p50_ms": 1.5}))
    assert status == 1
    assert doc["failed"] == ["reference_added_latency_p50"]
    status, doc = _publish(tmp_path, results(rss_peak_rss_mib=151.0))
    assert status == 1
    assert doc["failed"] == ["rss_streams"]
    status, doc = _publish(tmp_path, results({"latency_p50_ms": 1.5}), "--no-fail")
    assert status == 0 and doc["failed"] == ["reference_added_latency_p50"]
    assert "1 budget(s) failed" in capsys.readouterr().out
