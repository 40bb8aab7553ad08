"""llmproxy-agent log and the engine logs: the last lines of one engine's log or of every
one's, following new lines across rotations (none lost, none twice), the command line for a
person, and the rotation a watch does while the engine writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmproxy.agent import logs, state
from tests import procs
from tests.agentrun import Agent, Stream, call, order, sim_command, start_order
from tests.procs import free_port


@pytest.fixture
def sd(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d


def appender(path: Path) -> int:
    """A descriptor writing to ``path`` as the engine's does (O_APPEND)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def lines_of(stream: Stream) -> list[tuple[str, str]]:
    return [(e["engine"], e["line"]) for e in stream.of("log")]


def test_log_sends_the_last_lines_then_ends(sd: Path, streams: list[Stream]) -> None:
    """Without follow: the last N lines (a line still being written counts), then the call
    ends by itself with status 0."""
    state.log_path(sd, "e").write_text("".join(f"line {i}\r\n" for i in range(100)) + "half")
    s = Stream(sd, order("log", engine="e", lines=3))
    streams.append(s)
    assert s.wait_done() == 0
    assert lines_of(s) == [("e", "line 98"), ("e", "line 99"), ("e", "half")]


def test_log_of_every_engine(sd: Path) -> None:
    """Without an engine: every engine's log, each line naming its engine; an engine without
    a log gives nothing and is no error."""
    state.log_path(sd, "a").write_text("a1\na2\na3\n")
    state.log_path(sd, "b").write_text("b1\n")
    s = Stream(sd, order("log", lines=2))
    assert s.wait_done() == 0
    assert lines_of(s) == [("a", "a2"), ("a", "a3"), ("b", "b1")]
    none = Stream(sd, order("log", engine="nothing-here"))
    assert none.wait_done() == 0 and none.lines == []


@pytest.mark.parametrize(("fields", "needle"), [
    ({"engine": "../x"}, "engine must be a name"),
    ({"lines": -1}, "lines must be a whole number"),
    ({"lines": 2.5}, "lines must be a whole number"),
    ({"follow": "yes"}, "follow must be true or false"),
])
def test_a_bad_log_order_is_answered_like_any_other(sd: Path, fields: dict[str, object],
                                                     needle: str) -> None:
    """An unusable log order: one answer line, ok false, exit 2."""
    status, answer = call(sd, order("log", **fields))
    assert status == 2 and answer["ok"] is False and needle in answer["error"]


def test_follow_survives_rotations(sd: Path, streams: list[Stream]) -> None:
    """With follow: the last lines, then every line the engine writes, each once and in order,
    across two rotations (copy and truncate) and a line written in two halves; a log that did
    not exist yet is read from its start; the call ends when stdin closes."""
    path = state.log_path(sd, "e")
    fd = appender(path)
    os.write(fd, b"old 1\nold 2\n")
    s = Stream(sd, order("log", lines=1, follow=True))
    streams.append(s)
    s.expect("log", line="old 2")
    expected = [("e", "old 2")]
    for round_ in range(3):
        for i in range(5):
            os.write(fd, f"r{round_} line {i}\n".encode())
            expected.append(("e", f"r{round_} line {i}"))
        time.sleep(0.3)  # some read before the rotation, the rest from its copy
        os.write(fd, f"r{round_} late\n".encode())
        expected.append(("e", f"r{round_} late"))
        assert logs.rotate(path, limit=10) is True
        assert path.stat().st_size == 0
    os.write(fd, b"split ")
    time.sleep(0.3)
    os.write(fd, b"in two\n")
    expected.append(("e", "split in two"))
    state.log_path(sd, "new").write_text("first\n")
    expected.append(("new", "first"))
    s.expect("log", engine="new", line="first", timeout=5)
    os.close(fd)
    assert s.close() == 0
    assert lines_of(s) == expected


def test_a_person_reads_a_log_as_plain_lines(sd: Path) -> None:
    """`llmproxy-agent log ENGINE -n 2` prints plain lines; `-f` follows until Ctrl-C."""
    state.log_path(sd, "e").write_text("one\ntwo\nthree\n")
    argv = [sys.executable, "-m", "llmproxy.agent", "--state-dir", str(sd), "log", "e"]
    done = subprocess.run([*argv, "-n", "2"], capture_output=True, text=True, timeout=30,
                          env=procs.env(), stdin=subprocess.DEVNULL, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, "two\nthree\n", "")
    following = subprocess.Popen([*argv, "-f", "-n", "1"], stdout=subprocess.PIPE, text=True,
                                 env=procs.env(), stdin=subprocess.DEVNULL)
    try:
        assert following.stdout is not None
        assert following.stdout.readline() == "three\n"  # stdin at its end does not stop it
        with state.log_path(sd, "e").open("a") as f:
            f.write("four\n")
        assert following.stdout.readline() == "four\n"
        following.send_signal(signal.SIGINT)
        assert following.wait(5) == 0
    finally:
        following.kill()
        following.wait()


@pytest.mark.integration
def test_the_watch_rotates_a_long_log_losing_nothing(tmp_path: Path,
                                                     streams: list[Stream]) -> None:
    """While watching, an engine's log over log_rotate_bytes is copied to .1 and emptied; the
    engine's O_APPEND writes go on at its start, and no line is lost."""
    run = Agent(tmp_path / "state")
    try:
        port = free_port()
        assert run(start_order("e", sim_command(port), port))["ok"] is True
        path = state.log_path(run.state_dir, "e")
        s = Stream(run.state_dir, order("watch", interval=0.1, log_rotate_bytes=4096))
        streams.append(s)
        s.expect("hello")
        fd = appender(path)
        os.write(fd, b"".join(b"before %04d\n" % i for i in range(500)))
        deadline = time.monotonic() + 5
        while not logs.rotated(path).exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.write(fd, b"after\n")
        os.close(fd)
        copy = logs.rotated(path).read_text().splitlines()
        assert copy[-500:] == [f"before {i:04d}" for i in range(500)]
        assert path.read_text() == "after\n"
    finally:
        run.cleanup()


def test_rotate_leaves_short_logs_alone(sd: Path) -> None:
    """A log within the limit, or none at all, is not rotated."""
    path = state.log_path(sd, "e")
    assert logs.rotate(path, 10) is False
    path.write_text("short\n")
    assert logs.rotate(path, 10) is False and not logs.rotated(path).exists()


def test_a_long_line_is_cut_and_says_so(tmp_path: Path) -> None:
    """An engine's line of any length is sent cut at LINE_SHOWN characters, so it
    always fits the proxy's bound on one JSON line."""
    path = tmp_path / "engine-a.log"
    path.write_bytes(b"short\n" + b"x" * 100_000 + b"\nlast\n")
    short, long, last = logs.tail_lines(path, 3)
    assert (short, last) == ("short", "last")
    assert long.startswith("x" * logs.LINE_SHOWN + " ... (cut: the line had 100000 bytes)")
    assert len(long) < logs.LINE_SHOWN + 50


def test_a_follower_sends_a_line_without_end_cut(tmp_path: Path) -> None:
    """A line that never ends is not held in memory: past PARTIAL_MAX it is sent
    (cut), and what follows it after its newline comes as usual."""
    path = tmp_path / "engine-a.log"
    path.write_bytes(b"")
    follower = logs.Follower(path, None)
    try:
        with open(path, "ab") as f:
            f.write(b"y" * (logs.PARTIAL_MAX + 1))
        got = follower.poll()
        assert len(got) == 1 and got[0].startswith("y" * logs.LINE_SHOWN + " ... (cut")
        with open(path, "ab") as f:
            f.write(b"yy\nnext\n")
        assert follower.poll() == ["yy", "next"]
    finally:
        follower.close()


def test_an_exit_events_tail_is_bounded_keeping_the_last_lines() -> None:
    lines = [f"{i:03} " + "\u00e9" * logs.LINE_SHOWN for i in range(20)]
    kept = logs.bounded_tail(lines)
    assert kept and kept == lines[-len(kept):] and len(kept) < 20
    assert len(__import__("json").dumps(kept)) <= logs.TAIL_JSON_BYTES
    assert logs.bounded_tail(["a", "b"]) == ["a", "b"]
