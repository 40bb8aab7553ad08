"""The supervision rules (hosts/supervise.py) on a clock of plain numbers: the
backoff schedule, the crash-loop window, never restarting an engine the proxy
stopped, and the hung-engine rule."""

from __future__ import annotations

from llmproxy.agent.protocol import exit_text
from llmproxy.hosts.supervise import (
    CRASH_LIMIT,
    CRASH_WINDOW,
    EngineRecord,
    Silence,
    Verdict,
    after_exit,
    backoff,
    cleared,
    engine_lines,
    hung,
    progressed,
)


def test_the_backoff_doubles_from_1_s_up_to_60_s() -> None:
    assert [backoff(n) for n in range(1, 10)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def test_crashes_restart_with_backoff_and_the_fifth_within_ten_minutes_fails() -> None:
    record = EngineRecord()
    verdicts = [after_exit(record, t, stopped_by_proxy=False) for t in (0, 10, 20, 30)]
    assert [v.restart_in for v in verdicts] == [1, 2, 4, 8]
    assert after_exit(record, 40, stopped_by_proxy=False) == Verdict(None, failed=True,
                                                                     crashes=CRASH_LIMIT)
    assert record.failed


def test_crashes_older_than_the_window_are_forgotten() -> None:
    """Four crashes, then a fifth more than ten minutes after the first: only the
    ones within the window count (no `failed`), and the backoff follows them."""
    record = EngineRecord()
    for t in (0, 100, 200, 300):
        after_exit(record, t, stopped_by_proxy=False)
    verdict = after_exit(record, CRASH_WINDOW + 1, stopped_by_proxy=False)
    assert verdict == Verdict(8.0, crashes=4) and not record.failed


def test_an_engine_the_proxy_stopped_is_never_restarted_nor_counted() -> None:
    record = EngineRecord()
    assert after_exit(record, 0, stopped_by_proxy=True) == Verdict(None)
    assert record.crashes == []


def test_restart_never_counts_the_crash_but_starts_nothing() -> None:
    record = EngineRecord()
    assert after_exit(record, 0, stopped_by_proxy=False, restart="never") == \
        Verdict(None, crashes=1)


def test_an_operators_start_clears_the_failed_state() -> None:
    record = EngineRecord()
    for t in range(CRASH_LIMIT):
        after_exit(record, t, stopped_by_proxy=False)
    assert record.failed
    cleared(record)
    assert not record.failed and after_exit(record, 10, stopped_by_proxy=False).restart_in == 1


def test_the_exit_is_said_by_signal_or_status() -> None:
    assert (exit_text(None, 9), exit_text(3, None), exit_text(None, None)) == \
        ("signal 9", "exit status 3", "exit status unknown")


def test_the_agents_own_marks_are_not_the_engines_last_line() -> None:
    """The agent marks starts and exits in the log itself; the last line the
    engine wrote is the one before the exit mark."""
    tail = ["--- llmproxy-agent 2026-01-01 10:00:00: starting a", "loading model",
            "CUDA out of memory",
            "--- llmproxy-agent 2026-01-01 10:00:01: the engine (pid 7) exited with status 3"]
    assert engine_lines(tail) == ["loading model", "CUDA out of memory"]
    assert engine_lines([]) == []


def test_hung_needs_both_a_failing_health_check_and_silent_responses() -> None:
    """Unhealthy for 30 s and nothing sent for 30 s: hung. Healthy, or unhealthy
    for less, or a response seen sending 10 s ago: not hung."""
    assert hung(0.0, 0.0, 30.0, 30.0)
    assert hung(0.0, -5.0, 30.0, 30.0)
    assert not hung(None, 0.0, 30.0, 30.0)
    assert not hung(10.0, 10.0, 30.0, 30.0)
    assert not hung(0.0, 20.0, 30.0, 30.0)


def test_progress_is_a_response_that_sent_more_or_a_new_one_that_sent_any() -> None:
    """Between two samples of the bytes each response in flight has sent: one
    that grew, or a new one with bytes, is progress; the same figures, one that
    ended, or a new one with nothing sent yet, is not."""
    assert progressed({"r1": 10}, {"r1": 11})
    assert progressed({"r1": 10}, {"r1": 10, "r2": 1})
    assert progressed({}, {"r2": 5})
    assert not progressed({"r1": 10}, {"r1": 10})
    assert not progressed({"r1": 10, "r2": 3}, {"r1": 10})
    assert not progressed({"r1": 10}, {"r1": 10, "r2": 0})
    assert not progressed({}, {})


def test_a_silence_is_hung_once_unhealthy_and_quiet_for_the_limit() -> None:
    """Sampled each second: bytes flowing keep it from hung however long the
    health check fails; once they stop, the limit counts from the last sample
    that saw them grow."""
    silence = Silence(0.0, 0.0, {"r1": 100})
    for t in range(1, 41):
        silence.sample(float(t), {"r1": 100 + t})      # a byte every second
        assert not silence.hung(float(t), 30.0)
    for t in range(41, 71):
        silence.sample(float(t), {"r1": 140})           # stuck from 40 s on
        assert silence.hung(float(t), 30.0) == (t >= 70), t
