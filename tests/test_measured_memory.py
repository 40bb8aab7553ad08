"""Measured GPU memory (hosts/measured.py) on task.Clock: a budgeted host places by the
measured figure where there is one (else the declared memory_gb, else the whole budget), the
figures persist in runtime_dir/memory.json (a corrupt, malformed or stale file is ignored with
one log line), and a figure far above the declared one is one warning event per figure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher

from llmproxy.config import Config, EngineConfig, HostConfig, ListenAddress
from llmproxy.core.capacity import EngineMemoryAbove
from llmproxy.core.events import EngineSwitch
from llmproxy.hosts.adoption import adopt_within
from llmproxy.hosts.host import Host
from llmproxy.hosts.measured import FILE_NAME, GIB, MeasuredMemory, far_above
from llmproxy.testing.agentfakes import FakeAgentTransport, engine_found
from llmproxy.testing.fakes import Acquire

URL = "http://10.0.0.5:"
STARTED = {"ok": True, "pid": 9, "healthy": True, "stopped": []}


def engine(name: str, port: int, gb: float | None) -> EngineConfig:
    return EngineConfig(name, ("llama-server", "--port", str(port), "-m", name),
                        memory_gb=gb, url=f"{URL}{port}")


HOST = HostConfig("gpu1", f"{URL}8081", ssh="llm@10.0.0.5", memory_gb=80, engines={
    "chat": engine("chat", 8081, 40), "code": engine("code", 8084, 30),
    "free": engine("free", 8085, None)}, min_engine_seconds=0)
CONFIG = Config(ListenAddress("127.0.0.1", 0), (HOST,))


def store(tmp_path: Path, events: list[Any] | None = None,
          config: Config = CONFIG) -> MeasuredMemory:
    out = events if events is not None else []
    return MeasuredMemory(config, lambda create: str(tmp_path), Clock(), out.append)


def budgeted(measured: MeasuredMemory) -> tuple[Host, FakeAgentTransport, list[Any]]:
    agent, events = FakeAgentTransport(), []
    host = Host(HOST, Clock(), transport=agent, publish=events.append,
                measured=measured.of_host("gpu1"))
    return host, agent, events


def started(host: Host, agent: FakeAgentTransport, name: str) -> Acquire:
    a = Acquire(host, name)
    assert agent.last().order["op"] == "start" and agent.last().order["engine"] == name
    agent.last().answer({**STARTED, "engine": name})
    return a


@pytest.mark.parametrize(("measured_gb", "code_starts"), [(None, True), (60, False)])
def test_placement_counts_the_measured_figure(tmp_path: Path, measured_gb: float | None,
                                              code_starts: bool) -> None:
    """chat (declares 40) streams on 80 GB: code (30) starts beside it by the declared
    figures, but waits for chat when chat was measured at 60 GiB."""
    measured = store(tmp_path)
    if measured_gb is not None:
        measured.measured("gpu1", "chat", int(measured_gb * GIB))
    host, agent, events = budgeted(measured)
    chat = started(host, agent, "chat")
    assert chat.lease.engine == "chat"
    assert host.memory_used() == (measured_gb or 40)
    calls = len(agent.calls)
    code = Acquire(host, "code")
    if code_starts:
        assert agent.last().order["engine"] == "code"
    else:
        assert code.waiting and len(agent.calls) == calls
        assert any(isinstance(e, EngineSwitch) and e.stage == "waiting" for e in events)
    [row] = [r for r in host.residents(0.0) if r["engine"] == "chat"]
    assert (row["declared_memory_gb"], row["measured_memory_gb"]) == (40, measured_gb)


def test_an_engine_without_memory_gb_counts_for_the_whole_budget_until_measured(
        tmp_path: Path) -> None:
    """`free` declares no memory_gb: beside a busy chat it waits (it counts for all 80 GB);
    measured at 10 GiB it starts beside chat."""
    measured = store(tmp_path)
    host, agent, _ = budgeted(measured)
    started(host, agent, "chat")
    calls = len(agent.calls)
    assert Acquire(host, "free").waiting and len(agent.calls) == calls
    measured2 = store(tmp_path / "b")
    measured2.measured("gpu1", "free", 10 * GIB)
    host2, agent2, _ = budgeted(measured2)
    started(host2, agent2, "chat")
    started(host2, agent2, "free")
    assert host2.memory_used() == 50


def test_figures_survive_a_new_store_and_stale_entries_do_not(tmp_path: Path) -> None:
    """A figure is on file at once (atomically: no temp file left) and a new store (the
    successor, a restart) reads it; an entry whose engine now has another command, or is
    no longer configured, is ignored with one log line."""
    first = store(tmp_path)
    first.measured("gpu1", "chat", 5 * GIB)
    first.measured("gpu1", "code", 7 * GIB)
    first.measured("gpu9", "chat", 1)            # not a configured host: never kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE_NAME]
    second = store(tmp_path)
    assert second.gb("gpu1", "chat") is None
    second.load()
    assert (second.gb("gpu1", "chat"), second.gb("gpu1", "code")) == (5, 7)
    changed = HostConfig(HOST.name, HOST.url, ssh=HOST.ssh, memory_gb=80, engines={
        "chat": engine("chat", 9999, 40)})
    lines: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(lines.append)
    try:
        third = store(tmp_path, config=Config(ListenAddress("127.0.0.1", 0), (changed,)))
        third.load()
    finally:
        globalLogPublisher.removeObserver(lines.append)
    assert third.gb("gpu1", "chat") is None and third.gb("gpu1", "code") is None
    assert len([e for e in lines if "stale" in e.get("log_format", "")]) == 1


@pytest.mark.parametrize("text", ["{not json", "[]", '{"engines": 3}',
                                  '{"engines": [1, {"host": "gpu1"}, {"host": "gpu1", '
                                  '"engine": "chat", "memory_bytes": -4, "command": []}]}',
                                  "\x00\xff"])
def test_a_corrupt_file_is_ignored_with_one_log_line(tmp_path: Path, text: str) -> None:
    (tmp_path / FILE_NAME).write_text(text, errors="surrogateescape")
    lines: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(lines.append)
    try:
        measured = store(tmp_path)
        measured.load()
    finally:
        globalLogPublisher.removeObserver(lines.append)
    assert measured.gb("gpu1", "chat") is None
    assert len([e for e in lines if e.get("log_level") is not None and
                e["log_level"].name == "warn"]) == 1


def test_an_unwritable_runtime_dir_keeps_the_figure_and_logs(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("")
    measured = store(file)                        # a file where the directory should be
    measured.measured("gpu1", "chat", 3 * GIB)
    assert measured.gb("gpu1", "chat") == 3


def test_a_figure_far_above_the_declared_one_is_one_warning_per_figure(tmp_path: Path) -> None:
    """chat declares 40: 50 GiB is more than 1.25x and 1 GiB over (a warning naming both
    figures), the same figure again is not, another far figure is; 45 GiB is not far."""
    events: list[Any] = []
    measured = store(tmp_path, events)
    measured.measured("gpu1", "chat", 45 * GIB)
    measured.measured("gpu1", "chat", 51 * GIB)
    measured.measured("gpu1", "chat", 51 * GIB)
    measured.measured("gpu1", "chat", 45 * GIB)
    measured.measured("gpu1", "chat", 51 * GIB)
    measured.measured("gpu1", "chat", 60 * GIB)
    above = [e for e in events if isinstance(e, EngineMemoryAbove)]
    assert [(e.engine, e.declared_gb, e.measured_gb) for e in above] == [
        ("chat", 40.0, 51.0), ("chat", 40.0, 60.0)]
    level, line = above[0].line()
    assert level == "warn" and "51.00 GiB" in line and "memory_gb says 40" in line
    assert not far_above(2.0, 2.9) and far_above(2.0, 3.1) and not far_above(None, 99)


def test_the_file_names_host_engine_command_and_bytes(tmp_path: Path) -> None:
    measured = store(tmp_path)
    measured.measured("gpu1", "chat", 123)
    assert json.loads((tmp_path / FILE_NAME).read_text()) == {"engines": [
        {"host": "gpu1", "engine": "chat", "command": list(HOST.engines["chat"].command),
         "memory_bytes": 123}]}


def test_a_measurement_that_makes_room_lets_a_waiting_start_go(tmp_path: Path) -> None:
    """`free` (no memory_gb) waits beside a busy chat; once measured at 10 GiB, the queue's
    next pass (the fleet pumps it on each changed figure) starts it beside chat."""
    measured = store(tmp_path)
    host, agent, _ = budgeted(measured)
    started(host, agent, "chat")
    waiting = Acquire(host, "free")
    calls = len(agent.calls)
    assert waiting.waiting
    assert measured.measured("gpu1", "free", 10 * GIB)
    assert not measured.measured("gpu1", "free", 10 * GIB)      # no change: no pass
    host.scheduler.pump()
    assert len(agent.calls) == calls + 1 and agent.last().order["engine"] == "free"


@pytest.mark.parametrize(("figure", "adopted"), [(None, ["chat"]), (10.0, ["chat", "free"])])
def test_adoption_counts_the_measured_figure(figure: float | None, adopted: list[str]) -> None:
    """chat (40) and free (no memory_gb) run on 80 GB: an upgrade's successor adopts both when
    free was measured at 10 GiB, only the older one while free counts for the whole budget."""
    found = [engine_found("chat", HOST.engines["chat"].command, started_at=1.0),
             engine_found("free", HOST.engines["free"].command, pid=78, started_at=2.0)]
    got, passed = adopt_within(HOST, found, lambda e: figure if e == "free" else None)
    assert got == adopted
    assert [name for name, _ in passed] == ([] if figure else ["free"])


def test_only_a_significant_change_replaces_the_figure_rewrites_the_file_or_warns(
        tmp_path: Path) -> None:
    """chat declares 40 and is measured at 51 GiB (one warning, the file written); then
    moves by MiBs (up to 256 MiB, or 2 % of the figure when more): the figure, the file
    and the warnings stay as they were; a move of 2 GiB replaces the figure, rewrites
    the file and warns for the new figure."""
    events: list[Any] = []
    measured = store(tmp_path, events)
    path = tmp_path / FILE_NAME
    assert measured.measured("gpu1", "chat", 51 * GIB)
    path.write_text("kept")
    for moved in (1, 100, 2 ** 10 - 1):
        assert not measured.measured("gpu1", "chat", 51 * GIB + moved * 2 ** 20)
        assert not measured.measured("gpu1", "chat", 51 * GIB - moved * 2 ** 20)
    assert measured.gb("gpu1", "chat") == 51 and path.read_text() == "kept"
    assert measured.measured("gpu1", "chat", 53 * GIB)
    assert measured.gb("gpu1", "chat") == 53 and path.read_text() != "kept"
    above = [e.measured_gb for e in events if isinstance(e, EngineMemoryAbove)]
    assert above == [51.0, 53.0]
    small = store(tmp_path / "small")
    assert small.measured("gpu1", "code", 2 * GIB)
    assert not small.measured("gpu1", "code", 2 * GIB + 256 * 2 ** 20)
    assert small.measured("gpu1", "code", 2 * GIB + 257 * 2 ** 20)
