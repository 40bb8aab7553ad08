"""Automatic prefix affinity for real: twistd llmproxy in front of three simulated
engines serving one model with `affinity: "prefix"`; the engines' own records
say which conversation reached which engine."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Proxy, SimEngine, env

pytestmark = pytest.mark.integration


@pytest.fixture
def engines() -> Iterator[list[SimEngine]]:
    sims: list[SimEngine] = []
    try:
        for _ in range(3):
            sims.append(SimEngine(["m"]))
        yield sims
    finally:
        for sim in sims:
            sim.stop()


def turn(port: int, task: str, turns: int = 0) -> None:
    """One request of the conversation about `task`, `turns` turns in."""
    messages = [{"role": "system", "content": "You are a careful coding agent."},
                {"role": "user", "content": task}]
    for i in range(turns):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"turn {i}"})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": messages}),
                 {"X-Sim-Tokens": "2", "X-Sim-Delay": "0"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.read()


def homes(engines: list[SimEngine]) -> dict[str, set[int]]:
    """Each conversation (its first user message) and the engines it reached."""
    seen: dict[str, set[int]] = {}
    for i, engine in enumerate(engines):
        for record in engine.requests():
            task = record["body"]["messages"][1]["content"]
            seen.setdefault(task, set()).add(i)
    return seen


def test_one_prefix_one_host_many_spread_and_a_cordon_moves_only_its_own(
        engines: list[SimEngine], tmp_path: Path) -> None:
    """Every turn of a conversation reaches one engine; 30 conversations reach all
    three; with one host cordoned, every conversation of the two others stays on
    its engine, and the cordoned host's conversations move to the others."""
    names = ["h1", "h2", "h3"]
    hosts = [{"name": n, "url": e.url} for n, e in zip(names, engines, strict=True)]
    proxy = Proxy({"runtime_dir": str(tmp_path / "run"), "hosts": hosts,
                   "models": {"m": {"hosts": names, "affinity": "prefix"}}}, tmp_path)
    try:
        for turns in range(5):
            turn(proxy.port, "refactor the parser", turns)
        assert len(homes(engines)["refactor the parser"]) == 1
        tasks = [f"task {i}" for i in range(30)]
        for task in tasks:
            turn(proxy.port, task)
            turn(proxy.port, task, 2)
        before = homes(engines)
        assert all(len(before[t]) == 1 for t in tasks)
        assert set().union(*(before[t] for t in tasks)) == {0, 1, 2}

        gone = next(iter(before["task 0"]))
        result = subprocess.run([sys.executable, "-m", "llmproxy.cli", "cordon", names[gone],
                                 "--url", proxy.url], env=env(), capture_output=True,
                                text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr
        for engine in engines:
            reset(engine)
        for task in tasks:
            turn(proxy.port, task, 4)
        after = homes(engines)
        for task in tasks:
            assert gone not in after[task]
            if before[task] != {gone}:
                assert after[task] == before[task], task
    finally:
        proxy.stop()


def reset(engine: SimEngine) -> None:
    """Forget the engine's record (`POST /sim/reset`)."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=10)
    conn.request("POST", "/sim/reset")
    assert conn.getresponse().status in (200, 204)
