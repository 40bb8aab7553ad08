"""The benchmark's Twisted floor (bench/floor.py) relays what the engine sends,
whole, on kept-alive connections: its figures are those of a working relay."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.client import Connection, chat_request
from bench.targets import HOST, Process, start_engine, start_floor

pytestmark = pytest.mark.integration


async def _exchanges(port: int) -> list[tuple[bool, int, int]]:
    """(complete, status, events) of a small completion, a stream of 40 events and
    a paced stream of 5, in that order on one connection, and two streams at once
    on two more."""
    conn = await Connection.open(HOST, port)
    out = []
    for raw, sse, events in ((chat_request(HOST, port, stream=False), False, None),
                             (chat_request(HOST, port, stream=True, events=40), True, 40),
                             (chat_request(HOST, port, stream=True, events=5, rate=100), True, 5)):
        ex = await conn.request(raw, sse=sse, want_lags=sse)
        out.append((ex.complete and (events is None or (ex.done and ex.events == events)),
                    ex.status, ex.events))
    conn.close()
    others = [await Connection.open(HOST, port) for _ in range(2)]
    both = await asyncio.gather(*[c.request(chat_request(HOST, port, stream=True, events=8),
                                            sse=True, want_lags=False) for c in others])
    out += [(ex.complete and ex.done and ex.events == 8, ex.status, ex.events) for ex in both]
    for c in others:
        c.close()
    return out


def test_the_floor_relays_answers_and_streams_whole(tmp_path: Path) -> None:
    processes: list[Process] = []
    try:
        engine, engine_port = start_engine(tmp_path)
        processes.append(engine)
        floor = start_floor(tmp_path, engine_port)
        assert floor.process is not None
        processes.append(floor.process)
        results = asyncio.run(asyncio.wait_for(_exchanges(floor.port), 20))
    finally:
        for process in processes:
            process.stop()
    assert [complete for complete, _, _ in results] == [True] * 5, results
    assert {status for _, status, _ in results} == {200}
    assert [events for _, _, events in results][1:] == [40, 5, 8, 8]


def test_a_bench_stopped_by_sigterm_stops_what_it_started(tmp_path: Path) -> None:
    """`timeout` or a cancelled job sends SIGTERM: the run exits (143) after
    stopping its engine and its targets, none left running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parent.parent
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench", "--quick", "--targets", "direct,llmproxy",
         "--phases", "paced", "--json", "-"],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: list[str] = []
    try:
        assert bench.stdout is not None
        for line in bench.stdout:                 # its targets are up
            if "engine on port" in line:
                break
        # The engine and llmproxy (not a passing `git rev-parse`: the run's
        # metadata may be asking for its commit just then).
        children = [pid for pid in Path(f"/proc/{bench.pid}/task/{bench.pid}/children")
                    .read_text().split() if _started_as(int(pid)) in ("engine", "llmproxy")]
        assert len(children) == 2
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        left = [pid for pid in children if _running(int(pid))]
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [pid for pid in children if _running(int(pid))]
        assert left == []
    finally:
        if bench.poll() is None:
            os.kill(bench.pid, signal.SIGKILL)
            bench.wait()
        for pid in children:                      # what a failed run left behind
            if _running(int(pid)):
                os.kill(int(pid), signal.SIGKILL)


def _started_as(pid: int) -> str | None:
    """What a bench child is, by its arguments: the engine, llmproxy, or other."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return "engine" if b"bench.engine" in args else "llmproxy" if b"llmproxy" in args else None


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
