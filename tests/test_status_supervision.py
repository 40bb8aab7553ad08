"""What /status and `llmproxy status` say of supervision, the watch and the GPUs: the
fleet's per-host document passes through /status as the host's `engine`, and the CLI
shows a failed or restarting engine with its last exit and log line, a watch that is
down, and one line per GPU, with the engine's text made safe for a terminal."""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock

from llmproxy.cli.status import describe_status, plain
from llmproxy.config import parse_config
from llmproxy.observe.eventstream import EventLog
from llmproxy.observe.inflight import InFlight
from llmproxy.observe.status import StatusView, status_doc

GIB = 2**30
SUPERVISION = {
    "c": {"state": "failed", "crashes": 5, "last_exit": "exit status 3",
          "last_line": "CUDA out of memory", "restart_in_seconds": None},
    "a": {"state": "restarting", "crashes": 2, "last_exit": "signal 9",
          "last_line": None, "restart_in_seconds": 1.6}}
WATCH = {"connected": True, "last_error": None, "down_seconds": None, "healthy": {"a": True},
         "gpus": [{"index": 0, "name": "NVIDIA GeForce RTX 4090",
                   "memory_used_bytes": 2 * GIB, "memory_total_bytes": 24 * GIB,
                   "utilization_ratio": 0.37, "temperature_celsius": 45.0,
                   "power_watts": None}]}


def host_doc(engine: dict[str, Any]) -> dict[str, Any]:
    return {"version": "x", "state": "ready", "hosts": [
        {"name": "gpu1", "url": "http://a", "roster": {"generation": 1, "models": ["m"],
                                                       "fetched_seconds_ago": 1},
         "engine": {"running": None, "in_flight": 0, "queued": 0, **engine}}]}


def test_status_passes_supervision_and_watch_through() -> None:
    """/status's host entry carries the fleet's supervision and watch documents as they are."""
    config = parse_config({"hosts": [{"name": "gpu1", "url": "http://127.0.0.1:1",
                                      "ssh": "u@h", "engines": {"a": {"command": ["x"]}}}]})
    clock = Clock()
    engines = {"gpu1": {"running": None, "supervision": SUPERVISION, "watch": WATCH}}
    doc = status_doc(StatusView(
        state="ready", events=EventLog(clock), config=config, rosters={},
        inflight=InFlight(clock), now=0.0, started=0.0, ready=True, listening=None,
        engines=engines, config_state={}, stopping=False, upgrade={}))
    engine = doc["hosts"][0]["engine"]
    assert engine["supervision"] == SUPERVISION and engine["watch"] == WATCH


def test_the_cli_shows_failed_and_restarting_engines_and_the_gpus() -> None:
    """A failed engine with its crashes, last exit and log line; a restarting one with
    when it restarts; one short line per GPU, leaving out the figure the agent lacked."""
    lines = describe_status(host_doc({"supervision": SUPERVISION, "watch": WATCH}),
                            "http://p").splitlines()
    assert "    engine c failed: 5 crash(es) in 10 min, last exit status 3: CUDA out of " \
           "memory" in lines, lines
    assert "    engine a restarting (restart in 2s): 2 crash(es) in 10 min, last signal 9" \
        in lines, lines
    assert "    gpu 0 NVIDIA GeForce RTX 4090: 2.0 of 24.0 GiB, 37%, 45 C" in lines, lines
    assert not [line for line in lines if "unreachable" in line]


def test_the_cli_shows_a_watch_that_is_down() -> None:
    """A disconnected watch: the host is unreachable, for how long and why."""
    watch = {**WATCH, "connected": False, "last_error": "ssh exited with status 255",
             "down_seconds": 12.4, "gpus": []}
    lines = describe_status(host_doc({"watch": watch}), "http://p").splitlines()
    assert "    unreachable: the watch is down for 12s: ssh exited with status 255" in lines


def test_an_engines_text_cannot_drive_the_terminal() -> None:
    """An escape sequence or a line break in a log line is shown escaped, on one line,
    and a long line is cut."""
    evil = {"c": {**SUPERVISION["c"], "last_line": "\x1b[2J\x1b]0;owned\x07line\nnext"}}
    text = describe_status(host_doc({"supervision": evil}), "http://p")
    assert "\x1b" not in text and "\x07" not in text
    assert "last exit status 3: \\x1b[2J\\x1b]0;owned\\x07line\\nnext" in text
    assert len(plain("x" * 1000)) == 200
