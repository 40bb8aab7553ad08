"""llmproxy-agent with several hosts on one ssh target (protocol 4): each order names its
host, and each host's engines, exits and watch live in a state directory of the host's own,
so engine names repeat across hosts and an exit goes to the watch of the host whose engine
it was, never to whichever watch looks first."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent import state
from tests.agentrun import Agent, Stream, call, gone, order, sim_command, start_order
from tests.procs import free_port

pytestmark = pytest.mark.integration

HOSTS = ("h1", "h2", "h3")
FAST = {"interval": 0.1, "health_seconds": 0.2, "tick_seconds": 0.3}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    """An agent on one state directory, every host's engines stopped after the test."""
    run = Agent(tmp_path / "state")
    try:
        yield run
    finally:
        for host in HOSTS:
            run.popen(order("stop", host=host, grace=0)).wait(30)
        run.cleanup()


def start(run: Agent, host: str, engine: str = "a") -> dict[str, Any]:
    port = free_port()
    answer = run(start_order(engine, sim_command(port), port, host=host))
    assert answer["ok"] is True, answer
    return answer


def listed(run: Agent, host: str) -> dict[str, int]:
    return {e["engine"]: e["engine_pid"] for e in run(order("status", host=host))["engines"]}


def test_hosts_on_one_target_keep_engines_of_the_same_name_apart(agent: Agent) -> None:
    """Engine `a` of h1 and engine `a` of h2 run side by side (the second start does not
    replace the first); each host's status lists only its own, and a stop of h1's leaves
    h2's running; a person's `status --host h2` sees h2's."""
    one, two = start(agent, "h1"), start(agent, "h2")
    assert one["engine_pid"] != two["engine_pid"]
    assert listed(agent, "h1") == {"a": one["engine_pid"]}
    assert listed(agent, "h2") == {"a": two["engine_pid"]}
    assert listed(agent, "h3") == {}
    by_hand = agent(None, "status", "--host", "h2")["engines"]
    assert [e["engine_pid"] for e in by_hand] == [two["engine_pid"]]
    stopped = agent(order("stop", host="h1", engine="a", grace=2))["stopped"]
    assert [s["pid"] for s in stopped] == [one["pid"]]
    assert gone(one["engine_pid"]) and listed(agent, "h2") == {"a": two["engine_pid"]}
    assert (agent.state_dir / "hosts" / "h2" / "engines" / "a.json").exists()


def test_each_watch_reports_only_the_exits_of_its_own_host(agent: Agent,
                                                          streams: list[Stream]) -> None:
    """Three hosts, each with an engine `a`, each watched: a kill -9 of each engine is told
    once, to its own host's watch, with its own pid; no watch tells another host's exit."""
    engines = {host: start(agent, host) for host in HOSTS}
    watches = {}
    for host in HOSTS:
        watches[host] = Stream(agent.state_dir, order("watch", host=host, **FAST))
        streams.append(watches[host])
        hello = watches[host].expect("hello")
        assert [e["pid"] for e in hello["engines"]] == [engines[host]["pid"]]
    for host in HOSTS:
        os.kill(engines[host]["engine_pid"], signal.SIGKILL)
        exit_event = watches[host].expect("exit", timeout=5)
        assert exit_event["pid"] == engines[host]["pid"] and exit_event["signal"] == 9
    for host in HOSTS:
        watches[host].expect("tick", timeout=5)     # a look or more after the last kill
        assert [e["pid"] for e in watches[host].of("exit")] == [engines[host]["pid"]]


def test_a_protocol_3_agents_engines_go_to_the_first_host_that_asks(agent: Agent) -> None:
    """Engines an older agent kept in the shared directory (an order naming no host) are
    taken over by the first host that asks, so an upgrade orphans none."""
    port = free_port()
    old = agent(start_order("a", sim_command(port), port))
    assert old["ok"] is True, old
    assert listed(agent, "h1") == {"a": old["engine_pid"]}
    assert listed(agent, "h2") == {}
    assert state.records(agent.state_dir) == []
    assert (agent.state_dir / "hosts" / "h1" / "engine-a.log").exists()


@pytest.mark.parametrize("host", ["", "../x", "a/b", 7, ".hidden"])
def test_a_bad_host_name_is_bad_input(tmp_path: Path, host: object) -> None:
    """A host that is not a name (it names a directory) is refused with exit 2."""
    status, answer = call(tmp_path, order("status", host=host))
    assert status == 2 and answer["ok"] is False
    assert answer["error"].startswith("host must be a name matching"), answer
    assert not (tmp_path / "hosts").exists() or not any((tmp_path / "hosts").iterdir())
