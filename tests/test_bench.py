"""The benchmark's own logic (bench/): its statistics, its HTTP parsing, its options.
(Its budgets: test_bench_budgets.py; its table and JSON: test_bench_report.py.)

Pure functions on given numbers and bytes: no process, no socket, no timing.
"""

from __future__ import annotations

import argparse
import math

import pytest

from bench import cli
from bench.cli import parse_args
from bench.client import Exchange, ResponseParser, chat_request
from bench.engine import _COMPLETION_RESPONSE, _DONE_CHUNK, _STREAM_HEAD, event_chunk
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
    assert args.without == []
    with pytest.raises(SystemExit):
        parse_args(["--targets", "haproxy"])
    assert isinstance(parse_args([]), argparse.Namespace)
    args = parse_args(["--targets", "llmproxy-reference,direct,llmproxy"])
    assert args.targets == ["direct", "llmproxy", "llmproxy-reference"]


def test_both_modes_of_llmproxy_are_measured_by_default() -> None:
    """With its speedups and on the reference path alone, beside direct and nginx
    (which is left out, and said so, when it is not installed)."""
    assert cli.DEFAULT_TARGETS == ("direct", "llmproxy", "llmproxy-reference", "nginx")
    assert cli.wanted_targets(parse_args([]), "/usr/sbin/nginx") == list(cli.DEFAULT_TARGETS)
    assert cli.wanted_targets(parse_args([]), None) == ["direct", "llmproxy",
                                                        "llmproxy-reference"]
    assert cli.wanted_targets(parse_args(["--targets", "nginx"]), None) is None


def test_without_adds_a_target_per_speedup_beside_llmproxys() -> None:
    """`--without a,b --without c`: one llmproxy-without-NAME target each (once),
    after the llmproxy targets; a name that cannot be a speedup's is refused."""
    args = parse_args(["--without", "sendnow,site", "--without", "sendnow"])
    assert args.without == ["sendnow", "site", "sendnow"]
    assert cli.wanted_targets(args, "/usr/sbin/nginx") == [
        "direct", "llmproxy", "llmproxy-reference", "llmproxy-without-sendnow",
        "llmproxy-without-site", "nginx"]
    args = parse_args(["--targets", "direct,llmproxy,twisted", "--without", "x"])
    assert cli.wanted_targets(args, None) == ["direct", "llmproxy", "llmproxy-without-x",
                                              "twisted"]
    assert cli.ordered(["direct"], ["x"]) == ["direct", "llmproxy-without-x"]
    for bad in ("", "a b", "a/b", ",", "a,=b"):
        with pytest.raises(SystemExit):
            parse_args(["--without", bad])
