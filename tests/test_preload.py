"""A managed host's `preload` engine and the operator's engine commands at the
fleet, with a fake agent on a task.Clock: the preload starts after adoption
only where nothing runs, goes through the host's queue (requests that come
meanwhile wait behind it), and every command says how it ended."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from llmproxy.config import ConfigError, parse_config
from llmproxy.core.capacity import EngineCommand
from llmproxy.core.events import Event
from llmproxy.hosts.fleet import Fleet
from llmproxy.testing.agentfakes import FakeAgentTransport, engine_found, status_answer

HOST: dict[str, Any] = {"name": "gpu1", "url": "http://10.0.0.5:8081", "ssh": "llm@10.0.0.5",
                        "preload": "big", "min_engine_seconds": 0,
                        "engines": {"big": {"command": ["llama-server", "-m", "big.gguf"]},
                                    "small": {"command": ["llama-server", "-m", "small"]}}}
STARTED = {"ok": True, "engine": "big", "pid": 7, "healthy": True, "stopped": []}


def make(host: dict[str, Any] = HOST) -> tuple[Fleet, FakeAgentTransport, list[Event]]:
    agent = FakeAgentTransport()
    events: list[Event] = []
    config = parse_config({"hosts": [host]})      # never writes: no cordon here
    return Fleet(config, Clock(), {}, events.append, transport=agent), agent, events


def test_the_preload_engine_starts_after_adoption_where_nothing_runs() -> None:
    """Adoption finds nothing: the preload engine is started through the queue; a
    request for another engine that comes meanwhile waits behind it; it is said
    in an event."""
    fleet, agent, events = make()
    fleet.adopt()
    agent.last().answer(status_answer())
    [done] = fleet.preload()
    assert agent.last().order["op"] == "start" and agent.last().order["engine"] == "big"
    waiting = fleet.managers["gpu1"].acquire("small")
    agent.last().answer(STARTED)
    assert done.result is None and fleet.managers["gpu1"].running is None
    assert agent.last().order["engine"] == "small"          # then the request's switch
    assert not waiting.called
    commands = [e for e in events if isinstance(e, EngineCommand)]
    assert [(e.op, e.stage, e.engine) for e in commands] == [
        ("preload", "begun", "big"), ("preload", "done", "big")]
    assert commands[-1].line() == ("info", "preload of big on gpu1: done in 0.0s")


def test_an_adopted_engine_is_kept_not_replaced_by_the_preload() -> None:
    """Something configured already runs (an upgrade's successor adopts it): no preload."""
    fleet, agent, _ = make()
    fleet.adopt()
    agent.last().answer(status_answer(engine_found("small", ["llama-server", "-m", "small"],
                                                   pid=3)))
    assert fleet.preload() == [] and len(agent.calls) == 1


def test_a_failed_preload_says_why() -> None:
    """The agent cannot start it: the Deferred fires with the reason, as an event too."""
    fleet, agent, events = make()
    [done] = fleet.preload()
    agent.last().answer({"ok": False, "error": "big exited with status 1"})
    agent.last("status").answer(status_answer())
    assert done.result == "switching host gpu1 to engine big failed: big exited with status 1"
    assert isinstance(events[-1], EngineCommand) and events[-1].stage == "failed"


@pytest.mark.parametrize(("value", "error"), [
    ("huge", "hosts[0].preload: no engine 'huge' on this host"),
    ("", "hosts[0].preload: must name an engine, or be a non-empty list of engines"),
    ([], "hosts[0].preload: must name an engine, or be a non-empty list of engines"),
    (["big", "big"], "hosts[0].preload: names an engine twice"),
    (["big", "small"], "hosts[0].preload: several engines need the host's memory_gb (without "
                       "it the host runs one engine at a time)"),
])
def test_a_bad_preload_names_the_field(value: object, error: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"hosts": [{**HOST, "preload": value}]})
    assert list(info.value.errors) == [error]


def test_an_unmanaged_host_cannot_preload() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"hosts": [{"name": "l", "url": "http://l", "preload": "big"}]})
    assert list(info.value.errors) == [
        "hosts[0].preload: needs engines: only a managed host preloads"]


def test_an_operators_start_of_the_running_engine_is_done_at_once() -> None:
    """`engine gpu1 start big` while big runs: done, no agent call."""
    fleet, agent, _ = make()
    fleet.managers["gpu1"].controller.assume("big")
    d = Deferred.fromCoroutine(fleet.command("gpu1", "start", "big"))
    assert d.result is None and agent.calls == []
