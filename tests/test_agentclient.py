"""SSHAgentTransport against a fake process reactor (argv, environment, stdin, answers, errors,
timeouts), plus one real spawn of the real agent through a local stand-in for ssh."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from zope.interface.verify import verifyObject

from llmproxy.config import HostConfig
from llmproxy.hosts.agentclient import AgentError, IAgentTransport, SSHAgentTransport, answer_error
from llmproxy.testing.agentfakes import FakeAgentTransport, FakeProcess, FakeProcessReactor

ROOT = Path(__file__).resolve().parent.parent
SSH = ("ssh", "-o", "BatchMode=yes")
HOST = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5",
                  agent=("/opt/venv/bin/llmproxy-agent",))
ENVIRON = {"PATH": "/usr/bin:/bin", "HOME": "/home/proxy", "SSH_AUTH_SOCK": "/tmp/agent.sock",
           "LANG": "C.UTF-8", "SECRET_TOKEN": "x", "LISTEN_FDS": "1"}


class Harness:
    """A transport on a fake reactor with a recording killpg."""

    def __init__(self) -> None:
        self.reactor = FakeProcessReactor()
        self.killed: list[tuple[int, int]] = []
        self.transport = SSHAgentTransport(self.reactor, SSH, environ=ENVIRON,
                                           killpg=lambda pid, sig: self.killed.append((pid, sig)))
        self.results: list[Any] = []

    def call(self, order: dict[str, Any], timeout: float = 30.0,
             host: HostConfig = HOST) -> Deferred[dict[str, Any]]:
        d = self.transport.call(host, order, timeout)
        d.addBoth(self.results.append)
        return d

    @property
    def process(self) -> FakeProcess:
        return self.reactor.processes[-1]

    def error(self) -> str:
        assert len(self.results) == 1, self.results
        result = self.results[0]
        assert isinstance(result, Failure), result
        assert result.check(AgentError), result
        return str(result.value)


def test_argv_runs_ssh_in_its_own_session_with_only_the_needed_environment() -> None:
    """The child is `setsid --wait SSH... TARGET AGENT...`, with PATH/HOME/SSH_AUTH_SOCK/LANG
    passed explicitly and nothing else from the proxy's environment."""
    h = Harness()
    h.call({"op": "status"})
    p = h.process
    assert p.executable == "setsid"
    assert p.args == ["setsid", "--wait", "ssh", "-o", "BatchMode=yes", "llm@10.0.0.5",
                      "/opt/venv/bin/llmproxy-agent"]
    assert p.env == {"PATH": "/usr/bin:/bin", "HOME": "/home/proxy",
                     "SSH_AUTH_SOCK": "/tmp/agent.sock", "LANG": "C.UTF-8"}


def test_order_is_written_as_json_then_stdin_is_closed() -> None:
    """The agent reads its order to EOF: the JSON is written in full, stamped with this proxy's
    protocol (whatever the caller put there), and stdin closed."""
    h = Harness()
    order = {"op": "start", "engine": "big", "command": ["llama-server", "-m", "x y.gguf"],
             "health_url": "http://10.0.0.5:8081/health", "timeout": 120.0, "protocol": 7}
    h.call(order)
    assert json.loads(h.process.stdin) == {**order, "protocol": 3}
    assert h.process.stdin.endswith(b"\n")
    assert h.process.stdin_closed


def test_the_last_stdout_line_is_the_answer_even_when_split_across_reads() -> None:
    """Output arriving in pieces is joined; the last non-empty line is parsed as the answer."""
    h = Harness()
    h.call({"op": "status"})
    h.process.out(b"Welcome to gpu1\n{\"ok\": true, \"protocol\": 3, \"engines\": ")
    h.process.out(b"[{\"engine\": \"big\", \"pid\": 42}]}\n\n")
    h.process.exit(0)
    assert h.results == [{"ok": True, "protocol": 3, "engines": [{"engine": "big", "pid": 42}]}]


def test_an_ok_false_answer_is_returned_not_raised_whatever_the_exit_status() -> None:
    """The agent's own refusal (exit 2 for bad input) is an answer for the caller to judge."""
    h = Harness()
    h.call({"op": "nonsense"})
    h.process.out(b'{"ok": false, "protocol": 3, "error": "unknown op"}\n')
    h.process.exit(2)
    assert h.results == [{"ok": False, "protocol": 3, "error": "unknown op"}]


@pytest.mark.parametrize(("answer", "speaks"), [
    (b'{"ok": true, "engine": "big", "pid": 42, "healthy": true}',
     "protocol 1 (its answer has no protocol field)"),
    (b'{"ok": false, "error": "unknown op \'stop\'"}', "protocol 1 (its answer has no protocol "
     "field)"),
    (b'{"ok": true, "protocol": 4, "engines": []}', "protocol 4"),
    (b'{"ok": true, "protocol": "2", "engines": []}', "protocol '2'"),
])
def test_an_answer_of_another_protocol_is_an_error_naming_both(answer: bytes,
                                                               speaks: str) -> None:
    """An agent from another install (no protocol field: an older one; another number) is never
    read as ours, whether it said ok or not: an AgentError naming both versions."""
    h = Harness()
    h.call({"op": "status"})
    h.process.out(answer + b"\n")
    h.process.exit(0)
    assert h.error() == (f"the agent on gpu1 speaks {speaks}, this proxy speaks 3: install "
                         "the same llmproxy version on gpu1 as on the proxy")


def test_the_fake_transport_checks_the_protocol_as_the_real_one() -> None:
    """FakeAgentTransport answers in protocol 3 unless told otherwise, and fails an answer of
    another protocol with the same AgentError, so the code above it sees what it would."""
    fake = FakeAgentTransport()
    results: list[Any] = []
    fake.call(HOST, {"op": "status"}, 30).addBoth(results.append)
    fake.last().answer({"ok": True, "engines": []})
    fake.call(HOST, {"op": "status"}, 30).addBoth(results.append)
    fake.last().answer({"ok": True, "protocol": 1, "engine": None})
    assert results[0] == {"ok": True, "protocol": 3, "engines": []}
    assert isinstance(results[1], Failure) and results[1].check(AgentError)
    assert str(results[1].value).startswith("the agent on gpu1 speaks protocol 1, this proxy")
    assert fake.orders == [{"op": "status"}, {"op": "status"}]


def test_exit_without_answer_names_the_exit_status_and_the_stderr_tail() -> None:
    """ssh failing (status 255) gives an AgentError with its status and what it said."""
    h = Harness()
    h.call({"op": "status"})
    h.process.err(b"debug1: something\n")
    h.process.err(b"ssh: connect to host 10.0.0.5 port 22: Connection refused\n")
    h.process.exit(255)
    assert h.error() == ("agent on gpu1: exit status 255 without an answer; stderr: debug1: "
                         "something | ssh: connect to host 10.0.0.5 port 22: Connection refused")


def test_a_long_stderr_is_cut_to_its_tail() -> None:
    """Only the end of a chatty stderr goes into the reason."""
    h = Harness()
    h.call({"op": "status"})
    h.process.err(b"x" * 5000 + b"THE END\n")
    h.process.exit(1)
    reason = h.error()
    assert reason.endswith("xxxTHE END")
    assert len(reason) < 500


def test_unparsable_output_is_an_error_naming_it_and_the_exit_status() -> None:
    """A non-JSON last line (a shell's complaint, say) is not mistaken for an answer."""
    h = Harness()
    h.call({"op": "status"})
    h.process.out(b"bash: llmproxy-agent: command not found\n")
    h.process.exit(127)
    assert h.error() == ("agent on gpu1: unparsable answer 'bash: llmproxy-agent: command not "
                         "found' (exit status 127); stderr empty")


def test_a_json_value_that_is_not_an_object_is_unparsable() -> None:
    """Only a JSON object is an answer."""
    h = Harness()
    h.call({"op": "status"})
    h.process.out(b"[1, 2]\n")
    h.process.exit(0)
    assert "unparsable answer '[1, 2]' (exit status 0)" in h.error()


def test_a_child_killed_by_a_signal_says_so() -> None:
    """Death by signal is reported as such, not as an exit status."""
    h = Harness()
    h.call({"op": "status"})
    h.process.exit(signal=9)
    assert h.error() == "agent on gpu1: killed by signal 9 without an answer; stderr empty"


def test_timeout_kills_the_process_group_and_fails_at_once() -> None:
    """No answer within the timeout: SIGKILL to the child's process group (its pid, as a
    session leader) and an AgentError; the late exit is then ignored."""
    h = Harness()
    with capturedLogs() as events:
        h.call({"op": "start"}, timeout=150)
        h.reactor.advance(149.9)
        assert h.results == []
        assert h.killed == []
        h.reactor.advance(0.1)
    pid = h.process.pid
    assert h.killed == [(pid, signal.SIGKILL)]
    assert h.error() == "agent on gpu1: no answer within 150s"
    assert any("no answer within 150s to start: killing process group" in formatEvent(e)
               for e in events)
    h.process.exit(signal=9)
    assert len(h.results) == 1


def test_an_answer_in_time_cancels_the_timer() -> None:
    """After the answer, nothing is killed when the timeout would have passed."""
    h = Harness()
    h.call({"op": "status"}, timeout=10)
    h.process.out(b'{"ok": true, "protocol": 3}\n')
    h.process.exit(0)
    assert h.reactor.getDelayedCalls() == []
    h.reactor.advance(100)
    assert h.killed == []


def test_a_vanished_group_at_timeout_is_not_an_error_of_its_own() -> None:
    """killpg raising ProcessLookupError (the group is gone) still gives the timeout error."""
    h = Harness()

    def gone(pid: int, sig: int) -> None:
        raise ProcessLookupError

    h.transport = SSHAgentTransport(h.reactor, SSH, environ=ENVIRON, killpg=gone)
    h.call({"op": "status"}, timeout=5)
    h.reactor.advance(5)
    assert h.error() == "agent on gpu1: no answer within 5s"


def test_cancelling_a_call_kills_its_process_group() -> None:
    """A caller giving up does not leave the ssh child running."""
    h = Harness()
    d = h.call({"op": "status"})
    d.cancel()
    assert h.killed == [(h.process.pid, signal.SIGKILL)]
    assert h.reactor.getDelayedCalls() == []


def test_a_host_without_ssh_is_never_called() -> None:
    """Without an ssh target there is no agent: AgentError at once, nothing spawned."""
    h = Harness()
    h.call({"op": "status"}, host=HostConfig("laptop", "http://10.0.0.7:11434"))
    assert h.error() == "agent on laptop: the host has no ssh target"
    assert h.reactor.processes == []


def test_a_spawn_failure_is_an_agent_error() -> None:
    """setsid missing (or any spawn error) fails the call with the reason."""
    h = Harness()
    h.reactor.spawn_error = FileNotFoundError(2, "No such file or directory")
    h.call({"op": "status"})
    assert h.error().startswith("agent on gpu1: cannot run setsid: ")
    assert h.reactor.getDelayedCalls() == []


def test_both_transports_provide_the_interface() -> None:
    """The real and the fake transport are interchangeable at the seam."""
    assert verifyObject(IAgentTransport, SSHAgentTransport(FakeProcessReactor(), SSH))
    assert verifyObject(IAgentTransport, FakeAgentTransport())


def test_answer_error_gives_the_agents_reason_with_its_last_log_line() -> None:
    """ok answers have no error; a refusal's reason carries the engine log's last line."""
    assert answer_error({"ok": True}) is None
    assert answer_error({"ok": False, "error": "big exited with status 1",
                         "log_tail": "loading\nerror: no such model file\n\n"}) == (
        "big exited with status 1 (last log line: error: no such model file)")
    assert answer_error({"ok": False}) == "the agent answered ok: false without a reason"
    assert answer_error({}) == "the agent answered ok: false without a reason"


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_real_spawn_runs_the_real_agent_through_an_ssh_stand_in(tmp_path: Path) -> None:
    """With the real reactor, setsid and the real llmproxy-agent (behind a stand-in for ssh
    that drops the host argument), a status call comes back parsed."""
    from twisted.internet import reactor

    stand_in = tmp_path / "fake-ssh"
    stand_in.write_text(f'#!/bin/sh\nshift\nexport PYTHONPATH={ROOT}\nexec "$@"\n')
    stand_in.chmod(0o755)
    host = HostConfig("local", "http://127.0.0.1:9", ssh="localhost",
                      agent=(sys.executable, "-m", "llmproxy.agent", "--state-dir",
                             str(tmp_path / "state")))
    transport = SSHAgentTransport(reactor, [str(stand_in)], environ=os.environ)
    answer = await transport.call(host, {"op": "status"}, timeout=30)
    assert answer == {"ok": True, "protocol": 3, "engines": [], "lease": None}


def test_kill_all_ends_every_call_in_flight_and_only_those() -> None:
    """For an exit at once (a second signal): every call still in flight gets SIGKILL
    to its process group; a call that already ended is left alone."""
    h = Harness()
    h.call({"op": "status"})
    done = h.process
    done.out(b'{"ok": true, "protocol": 3}\n')
    done.exit(0)
    h.call({"op": "start"})
    first = h.process
    h.call({"op": "stop"})
    second = h.process
    assert h.transport.kill_all() == 2
    assert sorted(h.killed) == sorted([(first.pid, signal.SIGKILL), (second.pid, signal.SIGKILL)])
    assert done.pid not in [pid for pid, _ in h.killed]
    assert h.transport.kill_all() == 0
