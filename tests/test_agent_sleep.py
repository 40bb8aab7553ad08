"""The agent's sleep order (llmproxy/agent/sleep.py), run as the real agent process: the
host's sleep command runs after SLEEP_DELAY, detached, once the answer is out; never
while an engine of the host lives, never for another proxy than the lease holder, and a
malformed command is bad input."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent.protocol import SLEEP_DELAY
from tests.agentrun import Agent, Stream, call, order, sim_command, start_order
from tests.procs import free_port, wait_until

pytestmark = pytest.mark.integration


def test_the_sleep_command_runs_after_the_answer(run: Agent, tmp_path: Path) -> None:
    """Answered ("sleeping", the pid of what runs it); the command runs afterwards, in
    a session of its own (the ssh session's end does not end it)."""
    marker = tmp_path / "slept"
    script = f"ps -o sid= -p $$ > {marker}.tmp && mv {marker}.tmp {marker}"
    answer = run(order("sleep", command=["sh", "-c", script]))
    assert answer["ok"] is True and answer["sleeping"] is True, answer
    assert wait_until(marker.exists, 10)
    assert int(marker.read_text()) == answer["pid"]    # its own session, led by it


def test_never_with_an_engine_running(run: Agent, tmp_path: Path) -> None:
    port = free_port()
    started = run(start_order("e", sim_command(port), port))
    assert started["ok"] is True, started
    marker = tmp_path / "slept"
    answer = run(order("sleep", command=["touch", str(marker)]))
    assert answer == {"ok": False, "protocol": answer["protocol"],
                      "error": "engines run here: e"}
    time.sleep(SLEEP_DELAY + 0.5)
    assert not marker.exists()


def test_never_for_a_proxy_that_does_not_hold_the_lease(run: Agent, streams: list[Stream],
                                                        tmp_path: Path) -> None:
    holder: dict[str, Any] = {"machine": "proxy-a", "pid": 1111, "runtime_dir": "/run/a"}
    other = {**holder, "machine": "proxy-b", "pid": 2222, "runtime_dir": "/run/b"}
    watch = Stream(run.state_dir, order("watch", holder=holder, interval=0.1))
    streams.append(watch)
    watch.expect("lease", held=True)
    marker = tmp_path / "slept"
    answer = run(order("sleep", command=["touch", str(marker)], holder=other))
    assert answer["ok"] is False and "held by proxy-a pid 1111" in answer["error"], answer
    time.sleep(SLEEP_DELAY + 0.5)
    assert not marker.exists()


@pytest.mark.parametrize("command", [None, [], "systemctl suspend", ["ok", ""], [1]])
def test_a_malformed_command_is_bad_input(run: Agent, command: Any) -> None:
    status, answer = call(run.state_dir, order("sleep", command=command))
    assert status == 2 and answer["ok"] is False
    assert answer["error"].startswith("command must be a non-empty list of strings"), answer
