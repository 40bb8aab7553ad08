"""The benchmark's own logic (bench/): its statistics, its budgets, its HTTP parsing.

Pure functions on given numbers and bytes: no process, no socket, no timing.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest

from bench import budgets, report
from bench.budgets import evaluate, failed
from bench.cli import parse_args
from bench.client import Exchange, ResponseParser, chat_request
from bench.engine import _COMPLETION_RESPONSE, _DONE_CHUNK, _STREAM_HEAD, event_chunk
from bench.scenarios import Plan
from bench.stats import parse_cpu_ticks, parse_status_kib, per_thousand, percentile, summary_ms

# -- statistics ---------------------------------------------------------------------------


def test_percentile_interpolates_between_closest_ranks() -> None:
    """Percentiles follow numpy's default (linear) definition, whatever the input order."""
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    values = [float(v) for v in range(1, 101)]
    assert math.isclose(percentile(values, 99), 99.01)
    assert percentile(values, 50) == 50.5
    assert percentile([7.0], 99) == 7.0


def test_percentile_refuses_nonsense() -> None:
    """No values, or a percentile outside 0..100, is an error rather than a made-up figure."""
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_is_in_milliseconds() -> None:
    """Durations measured in seconds are reported in milliseconds."""
    s = summary_ms([0.001, 0.002, 0.003])
    assert s["n"] == 3
    assert s["p50_ms"] == 2.0
    assert s["max_ms"] == 3.0
    assert summary_ms([]) == {"n": 0}


def test_cpu_per_thousand_events() -> None:
    """0.5 s of CPU for 10,000 events is 50 ms per 1,000; nothing relayed gives no figure."""
    assert per_thousand(0.5, 10_000) == pytest.approx(50.0)
    assert per_thousand(0.5, 0) is None


def test_cpu_ticks_survive_odd_command_names() -> None:
    """utime + stime are fields 14 and 15 counted after the command name, which may hold
    spaces and parentheses."""
    fields = ["S", "1", "2", "3", "0", "-1", "4194560", "10", "0", "0", "0", "123", "45",
              "0", "0", "20", "0", "1"]
    stat = "4242 (twistd (odd) name) " + " ".join(fields)
    assert parse_cpu_ticks(stat) == 123 + 45


def test_status_values_in_kib() -> None:
    """VmHWM and VmRSS are read from /proc/PID/status in KiB."""
    text = "Name:\ttwistd\nVmHWM:\t   81234 kB\nVmRSS:\t   70000 kB\n"
    assert parse_status_kib(text, "VmHWM") == 81234
    assert parse_status_kib(text, "VmSwap") is None


# -- budgets ------------------------------------------------------------------------------

def results(**proxy: Any) -> dict[str, Any]:
    """A run's results where llmproxy meets every budget, with `proxy` overriding figures
    as `phase_figure=value`."""
    out: dict[str, Any] = {
        "direct": {"latency": {"p50_ms": 0.20, "p99_ms": 0.50},
                   "ttfb": {"p50_ms": 0.25, "p99_ms": 0.60},
                   "throughput": {"events_per_s": 150_000}},
        "llmproxy": {"latency": {"p50_ms": 0.60, "p99_ms": 2.00},
                     "ttfb": {"p50_ms": 0.70, "p99_ms": 2.00},
                     "cpu": {"steady_cpu_ms_per_1k": 60.0, "kept_up": True},
                     "paced": {"lag_p99_ms": 4.0, "cpu_ms_per_1k": 60.0},
                     "rss": {"streams": 1000, "completed": 1000, "peak_rss_mib": 90.0}},
        "nginx": {"cpu": {"steady_cpu_ms_per_1k": 35.0, "kept_up": True},
                  "paced": {"cpu_ms_per_1k": 35.0}},
    }
    for key, value in proxy.items():
        phase, figure = key.split("_", 1)
        out["llmproxy"][phase][figure] = value
    return out


def by_key(checks: list[budgets.Check]) -> dict[str, budgets.Check]:
    return {c.key: c for c in checks}


def test_every_budget_met() -> None:
    """Figures within every limit pass every budget; added latency is llmproxy's
    percentile minus the direct connection's, the CPU budget a ratio to nginx's."""
    checks = by_key(evaluate(results()))
    assert {c.status for c in checks.values()} == {"pass"}
    assert checks["added_latency_p50"].value == pytest.approx(0.40)
    assert checks["added_ttfb_p50"].value == pytest.approx(0.45)
    assert checks["added_latency_p99"].value == pytest.approx(1.50)
    assert checks["cpu_vs_nginx"].value == pytest.approx(60.0 / 35.0)
    assert failed(list(checks.values())) == []


def test_todays_figures_fail_the_budgets_they_exceed() -> None:
    """The figures measured before issue 13 (+1.03 ms p50, 37 ms paced lag p99, about 4x
    nginx's CPU) fail exactly those budgets."""
    checks = evaluate(results(latency_p50_ms=1.23, paced_lag_p99_ms=37.0,
                              cpu_steady_cpu_ms_per_1k=140.0))
    assert sorted(c.key for c in failed(checks)) == [
        "added_latency_p50", "cpu_vs_nginx", "paced_lag_p99"]
    assert by_key(checks)["added_latency_p50"].value == pytest.approx(1.03)


def test_limits_are_inclusive_except_rss() -> None:
    """A figure equal to its limit passes (<=), except the RSS one, which must be below."""
    at_limit = evaluate(results(latency_p50_ms=0.70, paced_lag_p99_ms=5.0,
                                cpu_steady_cpu_ms_per_1k=70.0, rss_peak_rss_mib=150.0))
    statuses = {c.key: c.status for c in at_limit}
    assert statuses["added_latency_p50"] == "pass"
    assert statuses["paced_lag_p99"] == "pass"
    assert statuses["cpu_vs_nginx"] == "pass"
    assert statuses["rss_streams"] == "fail"


def test_a_proxy_that_fell_behind_gets_no_clean_cpu_figure() -> None:
    """When llmproxy fell behind in the cpu phase, it relayed events in batches and its
    CPU per event looks cheaper: the check still counts but says so."""
    check = by_key(evaluate(results(cpu_kept_up=False)))["cpu_vs_nginx"]
    assert check.status == "pass"
    assert "fell behind" in check.note
    assert "flattered" in check.note


def test_a_disturbed_machine_is_named_beside_the_paced_lag_never_excused() -> None:
    """When the direct connection, with no proxy at all, had a paced lag p99 above a
    quiet machine's, the paced-lag check says so; its verdict stays the figure's."""
    r = results(paced_lag_p99_ms=9.9)
    r["direct"]["paced"] = {"lag_p99_ms": 3.3}
    check = by_key(evaluate(r))["paced_lag_p99"]
    assert check.status == "fail"
    assert "held this run back" in check.note and "3.3 ms" in check.note
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
    assert checks["added_ttfb_p50"].note == ""
    r["direct"]["ttfb"]["p99_ms"] = 3.0
    assert "TTFB p99 of 3.0 ms" in by_key(evaluate(r))["added_ttfb_p50"].note


def test_a_slow_floor_is_named_beside_the_added_p50_budgets_never_excused() -> None:
    """nginx adding more than a quiet machine's to the direct connection's p50
    in a phase: that phase's added-p50 budget says so; the verdict stays."""
    r = results(ttfb_p50_ms=0.90)
    r["nginx"]["ttfb"] = {"p50_ms": 0.25 + 0.101}
    r["nginx"]["latency"] = {"p50_ms": 0.20 + 0.05}
    checks = by_key(evaluate(r))
    assert checks["added_ttfb_p50"].status == "fail"
    assert "nginx, the C floor, added 0.101 ms to the p50" in checks["added_ttfb_p50"].note
    assert checks["added_latency_p50"].note == ""
    r["nginx"]["ttfb"] = {"p50_ms": 0.25 + 0.09}
    assert by_key(evaluate(r))["added_ttfb_p50"].note == ""


def test_an_incomplete_stream_fails() -> None:
    """1,000 streams must all complete: one short is a failure, named in the note."""
    check = by_key(evaluate(results(rss_completed=999)))["streams_whole"]
    assert check.status == "fail"
    assert "1 incomplete" in check.note


def test_without_nginx_the_cpu_budget_is_skipped_not_passed() -> None:
    """No nginx in the run: the CPU budget says it was skipped and why; the rest stand."""
    r = results()
    del r["nginx"]
    checks = by_key(evaluate(r))
    assert checks["cpu_vs_nginx"].status == "skip"
    assert "nginx" in checks["cpu_vs_nginx"].note
    assert checks["added_latency_p50"].status == "pass"


def test_without_the_direct_target_added_figures_are_skipped() -> None:
    """Added latency needs the direct figures of the same run; without them it is skipped."""
    r = results()
    del r["direct"]
    checks = by_key(evaluate(r))
    for key in ("added_latency_p50", "added_ttfb_p50", "added_latency_p99",
                "harness_events_per_s"):
        assert checks[key].status == "skip", key
    assert checks["paced_lag_p99"].status == "pass"


def test_a_slow_harness_is_reported() -> None:
    """The engine and client must do 80,000 events/s direct, or the run says it is suspect."""
    r = results()
    r["direct"]["throughput"]["events_per_s"] = 60_000
    check = by_key(evaluate(r))["harness_events_per_s"]
    assert check.status == "fail"
    assert "suspect" in check.note


def test_the_table_shows_every_target_and_dashes_for_missing_figures() -> None:
    """The table has a column per target and '-' where a figure was not measured."""
    text = report.table(results(), ["direct", "llmproxy", "nginx"],
                        Plan().__dict__)
    header, *lines = text.splitlines()
    assert header.split()[1:] == ["direct", "llmproxy", "nginx"]
    added_p50 = next(line for line in lines if line.strip().startswith("added p50"))
    assert added_p50.split()[-2:] == ["+0.400", "-"]
    ratio = next(line for line in lines if "vs nginx" in line)
    assert ratio.split()[-2:] == ["1.71x", "1.00x"]
    assert "PASS" in report.budget_lines(evaluate(results()))


def test_the_table_leaves_out_phases_that_were_not_run() -> None:
    """Rows of a phase no target measured are left out, not shown as dashes."""
    r = results()
    text = report.table(r, ["direct", "llmproxy", "nginx"], Plan().__dict__)
    assert "latency p50" in text
    assert "events/s" in text          # the direct target measured it
    assert "wall time" not in text     # rss: only peak RSS and completion were given


# -- the client's parser against the engine's bytes ----------------------------------------

def stream_bytes(times: list[float]) -> bytes:
    return _STREAM_HEAD + b"".join(event_chunk(t) for t in times) + _DONE_CHUNK


def feed_in_pieces(data: bytes, size: int, *, sse: bool, wall: float = 0.0,
                   ) -> tuple[Exchange, bytes | None]:
    ex = Exchange()
    parser = ResponseParser(ex, sse=sse, want_lags=True)
    rest = None
    for i in range(0, len(data), size):
        rest = parser.feed(data[i:i + size], now=float(i), wall=wall)
        if rest is not None:
            assert i + size >= len(data), "ended before the last byte"
    return ex, rest


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1 << 20])
def test_an_event_stream_parses_the_same_however_it_is_split(size: int) -> None:
    """A chunked event stream split anywhere yields every event, [DONE], the end, and the
    lag of each event (receive time minus the engine's `t`)."""
    times = [100.0, 100.5, 101.0]
    ex, rest = feed_in_pieces(stream_bytes(times), size, sse=True, wall=102.0)
    assert rest == b""
    assert ex.status == 200
    assert ex.events == 3
    assert ex.done
    assert ex.complete
    assert ex.lags == pytest.approx([2.0, 1.5, 1.0])
    assert ex.sent_at == pytest.approx(times)


def test_a_non_streamed_answer_ends_at_its_content_length() -> None:
    """A Content-Length body ends the response at its last byte; what follows is returned."""
    ex, rest = feed_in_pieces(_COMPLETION_RESPONSE, 5, sse=False)
    assert rest == b""
    assert ex.complete
    assert ex.body_bytes == len(_COMPLETION_RESPONSE.split(b"\r\n\r\n", 1)[1])
    ex = Exchange()
    parser = ResponseParser(ex, sse=False)
    assert parser.feed(_COMPLETION_RESPONSE + b"HTTP/1.1", now=0.0) == b"HTTP/1.1"
    assert ex.complete


def test_a_cut_stream_is_an_error_not_a_complete_answer() -> None:
    """An event stream cut before its last chunk is incomplete, with no [DONE]."""
    data = stream_bytes([1.0, 2.0])
    ex = Exchange()
    parser = ResponseParser(ex, sse=True)
    assert parser.feed(data[:-len(_DONE_CHUNK)], now=0.0) is None
    parser.eof(now=1.0)
    assert ex.error is not None
    assert not ex.complete
    assert not ex.done
    assert ex.events == 2


def test_a_body_without_length_ends_at_eof() -> None:
    """No Content-Length and no chunking: the body runs to the connection's close."""
    ex = Exchange()
    parser = ResponseParser(ex, sse=False)
    assert parser.feed(b"HTTP/1.1 200 OK\r\n\r\nhello", now=0.0) is None
    parser.eof(now=1.0)
    assert ex.complete
    assert ex.body_bytes == 5
    assert not parser.keep_alive


def test_requests_carry_the_stream_shape_for_the_engine() -> None:
    """A streamed request asks the engine for its event count and rate in headers; its
    Content-Length matches its body."""
    raw = chat_request("127.0.0.1", 8080, stream=True, events=2000, rate=50)
    head, body = raw.split(b"\r\n\r\n", 1)
    assert b"X-Bench-Events: 2000" in head
    assert b"X-Bench-Rate: 50" in head
    assert f"Content-Length: {len(body)}".encode() in head
    assert b'"stream":true' in body


# -- options ------------------------------------------------------------------------------

def test_targets_and_phases_are_checked() -> None:
    """Unknown targets are refused; selections keep the canonical order."""
    args = parse_args(["--targets", "nginx,direct", "--phases", "rss,latency", "--quick"])
    assert args.targets == ["direct", "nginx"]
    assert args.phases == ["latency", "rss"]
    assert args.quick
    with pytest.raises(SystemExit):
        parse_args(["--targets", "haproxy"])
    assert isinstance(parse_args([]), argparse.Namespace)
