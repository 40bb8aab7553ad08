"""Rosters follow the engines (issue 45, item 8): a managed host's roster is read again when
one of its engines becomes ready and when its watch says hello, so /v1/models and /status
stop saying what the last periodic read saw; on a task.Clock with fake fetches and a fake
ssh process."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from llmproxy.agent.protocol import PROTOCOL
from llmproxy.config import HostConfig, parse_config
from llmproxy.core.events import EngineSwitch
from llmproxy.hosts.agentclient import SSHAgentTransport
from llmproxy.hosts.catalog import roster_ok
from llmproxy.hosts.fleet import Fleet
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.runtime import Runtime
from llmproxy.testing.agentfakes import FakeProcessReactor

# An agent command of their own: the watches open at once (no agent code sent first).
CONFIG = {"hosts": [
    {"name": "gpu1", "url": "http://127.0.0.1:1", "ssh": "u@h", "agent": ["llmproxy-agent"],
     "engines": {"a": {"command": ["x"]}}},
    {"name": "gpu2", "url": "http://127.0.0.1:2", "ssh": "u@h", "agent": ["llmproxy-agent"],
     "engines": {"a": {"command": ["x"]}}}]}


class Fetches:
    """A roster fetcher whose reads the test answers: refused until an engine runs."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.serving: set[str] = set()

    def __call__(self, host: HostConfig) -> Deferred[tuple[RosterEntry, ...]]:
        self.asked.append(host.name)
        if host.name in self.serving:
            return succeed((RosterEntry(f"model-of-{host.name}"),))
        d: Deferred[tuple[RosterEntry, ...]] = Deferred()
        d.errback(ConnectionRefusedError("connection refused"))
        return d


def runtime() -> tuple[Runtime, Fetches, Clock]:
    clock, fetches = Clock(), Fetches()
    rt = Runtime(parse_config(CONFIG), clock, fetches, lambda event: None)
    return rt, fetches, clock


def test_an_engine_ready_rereads_its_hosts_roster_at_once() -> None:
    """Start-up's read failed (nothing runs yet: "roster failed"); the engine's switch
    `done` reads that host's roster again in the same turn, and the catalog and the
    roster's state say what the engine serves; other stages read nothing."""
    rt, fetches, _clock = runtime()
    rt.read_rosters()
    assert rt.rosters.by_host["gpu1"].last_error is not None
    assert rt.catalog.resolve("model-of-gpu1") is None
    fetches.serving.add("gpu1")
    fetches.asked.clear()
    rt.follow(EngineSwitch(1.0, "gpu1", "begun", "a"))
    assert fetches.asked == []
    rt.follow(EngineSwitch(2.0, "gpu1", "done", "a", elapsed=1.0))
    assert fetches.asked == ["gpu1"]
    roster = rt.rosters.by_host["gpu1"]
    assert roster_ok(roster) and roster.last_error is None
    assert [e.id for e in roster.models] == ["model-of-gpu1"]
    assert rt.catalog.resolve("model-of-gpu1") is not None
    assert rt.rosters.by_host["gpu2"].models == ()


def test_a_host_the_config_lost_is_not_read() -> None:
    """A switch of a host no longer in the config (a reload removed it) reads nothing."""
    rt, fetches, _clock = runtime()
    rt.follow(EngineSwitch(1.0, "gone", "done", "a"))
    assert fetches.asked == []


def test_a_watch_hello_rereads_its_hosts_roster() -> None:
    """A (re)opened watch's hello, on the real ssh transport over a fake process: the
    fleet hands the host's name to `on_hello`, the runtime's roster read."""
    reactor = FakeProcessReactor()
    config = parse_config(CONFIG)
    said: list[str] = []
    fleet = Fleet(config, reactor, {}, lambda event: None,
                  transport=SSHAgentTransport(reactor, ["ssh"]), on_hello=said.append)
    fleet.start()
    processes: list[Any] = reactor.processes
    hello = {"event": "hello", "protocol": PROTOCOL, "engines": []}
    for process in processes:
        process.out(json.dumps(hello).encode() + b"\n")
    assert sorted(said) == ["gpu1", "gpu2"]
    fleet.close()
