"""The benchmark's engine (bench/engine.py) makes a batched engine's bursts: streams
asked for with `X-Bench-Batch: 1` get their events in the same steps, whenever
each of them started."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from bench.client import Connection, chat_request
from bench.targets import HOST, start_engine

pytestmark = pytest.mark.integration


async def _sent_times(port: int, batch: bool) -> list[list[float]]:
    """The engine's send time of each event of three streams of 6 events at 50/s,
    started 7 ms apart."""
    conns = [await Connection.open(HOST, port) for _ in range(3)]
    raw = chat_request(HOST, port, stream=True, events=6, rate=50, batch=batch)
    futures = []
    for conn in conns:
        futures.append(conn.request(raw, sse=True, want_lags=True))
        await asyncio.sleep(0.007)
    exchanges = await asyncio.gather(*futures)
    for conn in conns:
        conn.close()
    assert all(ex.complete and ex.done and ex.events == 6 for ex in exchanges), exchanges
    return [list(ex.sent_at or []) for ex in exchanges]


def test_batched_streams_get_their_events_in_the_same_steps(tmp_path: Path) -> None:
    """Batched streams started apart share each step's send time (a step writes one
    event to every stream of the batch), 20 ms apart; paced streams without the
    batch keep their own schedules."""
    engine, port = start_engine(tmp_path)
    try:
        batched = asyncio.run(asyncio.wait_for(_sent_times(port, batch=True), 20))
        paced = asyncio.run(asyncio.wait_for(_sent_times(port, batch=False), 20))
    finally:
        engine.stop()
    # Every stream joins the batch's next step: 18 events sent in at most 8 steps
    # (each stream's 6, the later ones a step or two behind), each stream's in 6.
    assert all(len(set(times)) == 6 for times in batched)
    assert len({t for times in batched for t in times}) <= 8, batched
    # The steps keep a fixed grid of 20 ms: a step the loop ran late is followed by a
    # shorter gap, so the rhythm is the mean gap; each gap is still a step of its own.
    first = batched[0]
    gaps = [b - a for a, b in itertools.pairwise(first)]
    assert 0.015 < (first[-1] - first[0]) / len(gaps) < 0.06, gaps
    assert all(gap > 0.005 for gap in gaps), gaps
    assert len({t for times in paced for t in times}) == 18
