"""Residency, preload and the operator's engine commands for real: twistd llmproxy
drives llmproxy-agent over a real sshd on 127.0.0.1, and the agent runs
simulated engines (see test_integration_engines)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import sshd as sshd_harness
from tests.procs import BodyReader, Proc, Proxy
from tests.test_integration_engines import (
    Waiters,
    agent_status,
    config,
    post,
    queued,
    stop_engine,
    wait_until,
)

pytestmark = pytest.mark.integration


def engine_cli(proxy: Proxy, *args: str) -> Proc:
    return Proc([sys.executable, "-m", "llmproxy.cli", "engine", *args, "--url", proxy.url])


def model_of(resp: Any) -> str:
    model: str = json.loads(resp.read())["model"]
    return model


@pytest.mark.parametrize("residency", [60, None], ids=["60s", "default"])
def test_min_engine_seconds_keeps_the_engine_through_alternating_requests(
        sshd: sshd_harness.SSHD, tmp_path: Path, residency: int | None) -> None:
    """min_engine_seconds 60 (and the default, 30) after the switch to a: a request
    for b waits although a is idle between requests, while twelve requests for a
    come one after another and are served by a (no switch: a runs all along; more
    than the fairness bound of 8 pass the waiting switch); once they stop, b gets
    the host. Two starts in all, where without residency each request would switch."""
    doc = config(sshd, tmp_path)
    if residency is None:
        del doc["hosts"][0]["min_engine_seconds"]
    else:
        doc["hosts"][0]["min_engine_seconds"] = residency
    proxy = Proxy(doc, tmp_path)
    quick = {"X-Sim-Tokens": "1", "X-Sim-Delay": "0.01"}
    try:
        assert model_of(post(proxy.port, "ma", **quick)) == "ma"   # a starts: resident
        other = Waiters(proxy.port, n=1)                            # a request for b
        assert wait_until(lambda: queued(proxy) == 1)
        for _ in range(12):
            assert model_of(post(proxy.port, "ma", **quick)) == "ma"
            engine = proxy.get_json("/status")["hosts"][0]["engine"]
            assert (engine["running"], engine["queued"]) == ("a", 1)
            assert other.results == []
        other.join()
        assert [(status, json.loads(body)["model"]) for status, _, body in other.results] == [
            (200, "mb")]
        proxy.wait_for(r"engine b on gpu1 ready", 10)     # (its line may still be on its way)
        out = proxy.output()
        assert "switching gpu1 from a to b: waiting while a is resident" in out
        starts = [line.split("] ", 1)[1].split(" ready")[0] for line in out.splitlines()
                  if " on gpu1 ready in " in line]
        assert starts == ["engine a on gpu1", "engine b on gpu1"]
        assert agent_status(sshd, tmp_path)["engine"] == "b"
    finally:
        proxy.stop()
        stop_engine(sshd, tmp_path)


def test_engine_stop_waits_for_the_running_stream_and_exits_0(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """`llmproxy engine gpu1 stop` while a stream runs on the engine: the command is
    still waiting while the stream runs, the stream completes in full, then the engine
    stops and the command exits 0."""
    proxy = Proxy(config(sshd, tmp_path), tmp_path)
    try:
        assert post(proxy.port, "ma").status == 200
        engine_pid = agent_status(sshd, tmp_path)["pid"]
        stream = BodyReader(post(proxy.port, "ma", stream=True, **{"X-Sim-Delay": "0.1",
                                                              "X-Sim-Tokens": "20"}))
        command = engine_cli(proxy, "gpu1", "stop")
        assert wait_until(lambda: proxy.get_json("/status")["hosts"][0]["engine"]
                          ["stop_requested"])
        assert command.popen.poll() is None and stream.is_alive()
        stream.join(30)
        assert stream.error is None and stream.body.count(b"tok") == 20
        assert stream.body.rstrip().endswith(b"[DONE]")
        assert command.popen.wait(30) == 0, command.output()
        assert "gpu1: stopped its engine; running: none" in command.output()
        assert agent_status(sshd, tmp_path)["engine"] is None and engine_pid
    finally:
        proxy.stop()
        stop_engine(sshd, tmp_path)


def test_preload_starts_the_engine_and_engine_start_says_how_it_went(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """`preload: a`: a runs after start-up without any request. `engine gpu1 start b`
    with a b that cannot start exits 1 with the agent's reason; `start a` exits 0."""
    doc = config(sshd, tmp_path, broken=True)
    doc["hosts"][0]["preload"] = "a"
    proxy = Proxy(doc, tmp_path)
    try:
        assert wait_until(lambda: proxy.get_json("/status")["hosts"][0]["engine"]["running"]
                          == "a", timeout=30)
        assert agent_status(sshd, tmp_path)["engine"] == "a"
        assert "preload of a on gpu1: done in" in proxy.output()
        failed = engine_cli(proxy, "gpu1", "start", "b")
        assert failed.popen.wait(60) == 1
        assert "switching host gpu1 to engine b failed:" in failed.output()
        assert "exited (exit status 1)" in failed.output()
        started = engine_cli(proxy, "gpu1", "start", "a")
        assert started.popen.wait(60) == 0, started.output()
        assert agent_status(sshd, tmp_path)["engine"] == "a"
    finally:
        proxy.stop()
        stop_engine(sshd, tmp_path)
