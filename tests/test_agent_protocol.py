"""The agent's wire protocol (llmproxy/agent/protocol.py): every event the agent writes
decodes to one typed record, anything else is a BadEvent saying why, an exit is said one
way, and the proxy's stream ends on a line it cannot read (a clear reason, no traceback)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmproxy.agent import protocol
from llmproxy.agent.protocol import (
    EVENT_FIELD,
    EVENTS,
    AgentEvent,
    AgentWarning,
    BadEvent,
    Exit,
    Gpu,
    Health,
    Hello,
    LeaseState,
    LogLine,
    Memory,
    Refused,
    Seen,
    Tick,
    decode,
    exit_text,
    returncode_exit,
)
from llmproxy.config import HostConfig
from llmproxy.hosts.agentclient import SSHAgentTransport
from llmproxy.hosts.agentstream import AgentStream
from llmproxy.testing.agentfakes import FakeProcessReactor

HOST = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5", agent="llmproxy-agent")

# One line of each event as the agent writes it (llmproxy/agent/watch.py, logs.py).
WRITTEN: dict[str, tuple[dict[str, Any], AgentEvent]] = {
    protocol.HELLO: ({"protocol": 4, "engines": [
        {"engine": "big", "pid": 7, "healthy": True}, "junk"]},
        Hello(4, (Seen("big", True),))),
    protocol.LEASE: ({"held": False, "holder": {"machine": "b", "pid": 1}, "at": 1.0},
                     LeaseState(False, {"machine": "b", "pid": 1})),
    protocol.EXIT: ({"engine": "big", "pid": 7, "engine_pid": 8, "exit_status": None,
                     "signal": 9, "log_tail": ["CUDA out of memory"], "at": 1.0},
                    Exit("big", None, 9, ("CUDA out of memory",))),
    protocol.HEALTH: ({"engine": "big", "pid": 7, "healthy": False, "at": 1.0},
                      Health("big", False)),
    protocol.GPU: ({"gpus": [{"index": 0}], "at": 1.0}, Gpu(({"index": 0},))),
    protocol.MEMORY: ({"engine": "big", "memory_bytes": 5 * 2**30, "at": 1.0},
                      Memory("big", 5 * 2**30)),
    protocol.WARNING: ({"message": "nvidia-smi failed", "at": 1.0},
                       AgentWarning("nvidia-smi failed")),
    protocol.TICK: ({"at": 1.0}, Tick()),
    protocol.LOG_LINE: ({"engine": "big", "line": "loading"}, LogLine("loading", "big")),
}


def test_every_event_name_is_written_here_once() -> None:
    """The table above covers exactly the protocol's events."""
    assert set(WRITTEN) == EVENTS


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_each_event_decodes_to_its_record(name: str) -> None:
    fields, record = WRITTEN[name]
    assert decode({EVENT_FIELD: name, **fields}) == record


def test_a_refusal_in_a_stream_is_a_record() -> None:
    assert decode({"ok": False, "protocol": 4, "error": "no log yet"}) == Refused("no log yet")


@pytest.mark.parametrize(("doc", "why"), [
    ([1, 2], "not a JSON event: [1, 2]"),
    ({"event": "reboot"}, "an unknown event 'reboot'"),
    ({"ok": True}, "an unknown event None"),
    ({"event": "exit", "signal": 9}, "a malformed exit event (no engine name)"),
    ({"event": "health", "engine": 3}, "a malformed health event (no engine name)"),
    ({"event": "lease", "held": True}, "a malformed lease event (no holder)"),
    ({"event": "hello", "engines": "big"}, "a malformed hello event (its engines are not a list)"),
    ({"event": "gpu", "gpus": None}, "a malformed gpu event (its gpus are not a list)"),
    ({"event": "log", "engine": "big"}, "a malformed log event (no line)"),
    ({"event": "engine_memory", "engine": "big", "memory_bytes": "5G"},
     "a malformed engine_memory event (no memory_bytes)"),
    ({"event": "engine_memory", "engine": "big", "memory_bytes": -1},
     "a malformed engine_memory event (no memory_bytes)"),
    ({"event": "engine_memory", "memory_bytes": 1},
     "a malformed engine_memory event (no engine name)"),
])
def test_what_is_no_event_is_a_bad_event_saying_why(doc: object, why: str) -> None:
    with pytest.raises(BadEvent) as caught:
        decode(doc)
    assert str(caught.value).startswith(why)


def test_an_exit_is_said_one_way() -> None:
    """Signal before status; a subprocess's negative return code is its signal."""
    assert (exit_text(None, 9), exit_text(3, None), exit_text(None, None)) == \
        ("signal 9", "exit status 3", "exit status unknown")
    assert (returncode_exit(3), returncode_exit(-9)) == ((3, None), (None, 9))
    assert Exit("big", 1, None).how == "exit status 1"


def open_stream() -> tuple[AgentStream, FakeProcessReactor, list[AgentEvent], list[int]]:
    reactor, events, killed = FakeProcessReactor(), [], []
    transport = SSHAgentTransport(reactor, ["ssh"], environ={"PATH": "/usr/bin"},
                                  killpg=lambda pid, sig: None)
    stream = AgentStream(reactor, transport, HOST, {"op": "watch"}, events.append,
                         killpg=lambda pid, sig: killed.append(pid))
    return stream, reactor, events, killed


def test_the_stream_hands_on_records_decoded_once() -> None:
    stream, reactor, events, _ = open_stream()
    reactor.processes[-1].out(b'{"event": "health", "engine": "big", "healthy": true}\n'
                              b'{"event": "tick", "at": 1}\n')
    assert events == [Health("big", True), Tick()] and not stream.ended.called


@pytest.mark.parametrize(("line", "why"), [
    ({"event": "reboot", "at": 1}, "agent on gpu1: an unknown event 'reboot'"),
    ({"event": "exit", "pid": 7}, "agent on gpu1: a malformed exit event (no engine name)"),
    ({"event": "hello", "protocol": 3, "engines": []},
     "agent on gpu1: the agent on gpu1 speaks protocol 3, this proxy speaks 4"),
])
def test_a_line_the_proxy_cannot_read_ends_the_stream_saying_why(line: dict[str, Any],
                                                                   why: str) -> None:
    """Nothing of it reaches the watch, the session's group is killed, the reason is
    the stream's end (the watch logs it and reopens)."""
    stream, reactor, events, killed = open_stream()
    reactor.processes[-1].out(json.dumps(line).encode() + b"\n")
    assert events == [] and str(stream.ended.result).startswith(why), stream.ended.result
    assert killed == [reactor.processes[-1].pid]


def test_the_protocol_module_runs_on_python_3_9() -> None:
    """The GPU host's python3 may be 3.9: the module parses as 3.9, evaluates no ``X | Y``
    (only annotations, which are never evaluated, hold one) and asks no ``slots=``."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(protocol.__file__).read_text(), feature_version=(3, 9))
    annotations = [n.annotation for n in ast.walk(tree) if isinstance(n, ast.arg | ast.AnnAssign)
                   and n.annotation is not None]
    annotations += [n.returns for n in ast.walk(tree)
                    if isinstance(n, ast.FunctionDef) and n.returns is not None]
    typed = {id(n) for a in annotations for n in ast.walk(a)}
    assert not [n.lineno for n in ast.walk(tree) if isinstance(n, ast.BinOp)
                and isinstance(n.op, ast.BitOr) and id(n) not in typed]
    assert not [k for n in ast.walk(tree) if isinstance(n, ast.keyword) for k in [n.arg]
                if k == "slots"]
