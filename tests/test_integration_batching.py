"""The batch schedule for real (hosts/batching.py): twistd llmproxy drives
llmproxy-agent over a real sshd on 127.0.0.1, one slot, engines a and b. A
stream on a holds the slot while a request for b and then twelve for a queue:
arrival order lets 8 of the a's pass the waiting switch (the fairness bound),
switches to b, then back to a for the rest; batch serves all twelve a's, then
switches once. The switches are counted from the proxy's own engine.switch
lines, not from timing."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests import sshd as sshd_harness
from tests.procs import Proxy
from tests.test_integration_engines import config, post, queued, stop_engine, wait_until

pytestmark = pytest.mark.integration


def starts(out: str) -> list[str]:
    return [line.split("] engine ", 1)[1].split(" on gpu1")[0] for line in out.splitlines()
            if " on gpu1 ready in " in line and "] engine " in line]


def replay(sshd: sshd_harness.SSHD, tmp_path: Path, schedule: str) -> list[str]:
    tmp_path.mkdir()
    doc = config(sshd, tmp_path)
    doc["hosts"][0].update(max_concurrent=1, schedule=schedule, max_wait_seconds=60,
                           queue_timeout_seconds=120)
    proxy = Proxy(doc, tmp_path)
    statuses: list[int] = []

    def send(model: str, **headers: str) -> None:
        resp = post(proxy.port, model, **headers)
        resp.read()
        statuses.append(resp.status)

    try:
        post(proxy.port, "ma", **{"X-Sim-Tokens": "1"}).read()        # a runs
        threads = [threading.Thread(target=send, args=("ma",), kwargs={
            "X-Sim-Tokens": "40", "X-Sim-Delay": "0.1"}, daemon=True)]  # holds the slot
        threads[0].start()
        assert wait_until(lambda: proxy.get_json("/status")["hosts"][0]["capacity"][
            "in_flight"] == 1)
        threads.append(threading.Thread(target=send, args=("mb",), daemon=True))
        threads[-1].start()
        assert wait_until(lambda: queued(proxy) == 1)
        for _ in range(12):
            threads.append(threading.Thread(target=send, args=("ma",), kwargs={
                "X-Sim-Tokens": "1", "X-Sim-Delay": "0.01"}, daemon=True))
            threads[-1].start()
        assert wait_until(lambda: queued(proxy) == 13)
        for t in threads:
            t.join(60)
        assert statuses == [200] * 14
        return starts(proxy.output())
    finally:
        proxy.stop()
        stop_engine(sshd, tmp_path)


def test_the_batch_schedule_switches_less_than_arrival_order(
        sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    arrival = replay(sshd, tmp_path / "arrival", "arrival")
    batch = replay(sshd, tmp_path / "batch", "batch")
    assert arrival == ["a", "b", "a"]
    assert batch == ["a", "b"]
