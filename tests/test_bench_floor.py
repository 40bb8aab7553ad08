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
