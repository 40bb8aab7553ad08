"""One call of a host's agent as a process (hosts/agentclient.py runs it): the
order written to its stdin, its stdout read into the JSON answer, the tail of
its stderr kept to say why a call ended without one."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from llmproxy.agent.protocol import PROTOCOL, exit_text
from llmproxy.core.redact import quote_log

STDERR_TAIL_CHARS = 400
_STDOUT_LIMIT = 1024 * 1024
_STDERR_KEEP = 8192


class AgentError(Exception):
    """An agent call failed; str() is the reason (ssh exit status + stderr tail, a timeout,
    an unparsable answer, or the agent's own ``{"ok": false, "error"}``)."""


def answer_error(answer: Mapping[str, Any]) -> str | None:
    """None for an ``"ok": true`` answer, else the agent's reason (with its last log line)."""
    if answer.get("ok") is True:
        return None
    reason = str(answer.get("error") or "the agent answered ok: false without a reason")
    tail = [line for line in str(answer.get("log_tail") or "").splitlines() if line.strip()]
    return f"{reason} (last log line: {quote_log(tail[-1].strip())})" if tail else reason


def protocol_error(host: str, answer: Mapping[str, Any]) -> str | None:
    """None for an answer of this proxy's PROTOCOL, else why it cannot be read (naming both
    versions): an agent from another install must never be misread."""
    given = answer.get("protocol")
    if type(given) is int and given == PROTOCOL:
        return None
    speaks = ("protocol 1 (its answer has no protocol field)" if given is None
              else f"protocol {given!r}")
    return (f"the agent on {host} speaks {speaks}, this proxy speaks {PROTOCOL}: install the "
            f"same llmproxy version on {host} as on the proxy, or remove the host's \"agent\" "
            "so that the proxy brings its own")


def ended_text(reason: Failure) -> str:
    """How the ssh call's process ended (`killed by signal 9`, `exit status 255`)."""
    value = reason.value
    if isinstance(value, ProcessTerminated) and value.signal is not None:
        return f"killed by {exit_text(None, value.signal)}"
    if isinstance(value, (ProcessDone, ProcessTerminated)):
        return exit_text(value.exitCode, None)
    return f"ended: {value}"


def _tail(data: bytes) -> str:
    text = " | ".join(line.strip() for line in data.decode("utf-8", "replace").splitlines()
                      if line.strip())
    if not text:
        return "stderr empty"
    return "stderr: " + (text if len(text) <= STDERR_TAIL_CHARS
                         else "..." + text[-STDERR_TAIL_CHARS:])


class AgentProcess(ProcessProtocol):
    """One agent call: writes the order, collects the output, parses the answer."""

    def __init__(self, host: str, order: bytes, done: Deferred[dict[str, Any]]) -> None:
        # `order`: all of the call's stdin (a JSON line, or the agent's code for an install)
        self.host = host
        self.order = order
        self.done = done
        self.stdout = b""
        self.stderr = b""

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(self.order)
        self.transport.closeStdin()

    def outReceived(self, data: bytes) -> None:
        if len(self.stdout) < _STDOUT_LIMIT:
            self.stdout += data

    def errReceived(self, data: bytes) -> None:
        self.stderr = (self.stderr + data)[-_STDERR_KEEP:]

    def processEnded(self, reason: Failure) -> None:
        if self.done.called:
            return  # timed out or cancelled already
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        if not lines:
            self.done.errback(AgentError(
                f"agent on {self.host}: {ended_text(reason)} without an answer; "
                f"{_tail(self.stderr)}"))
            return
        try:
            answer = json.loads(lines[-1])
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            shown = lines[-1][:200].decode("utf-8", "replace")
            self.done.errback(AgentError(
                f"agent on {self.host}: unparsable answer {shown!r} ({ended_text(reason)}); "
                f"{_tail(self.stderr)}"))
            return
        mismatch = protocol_error(self.host, answer)
        if mismatch is not None:
            self.done.errback(AgentError(mismatch))
            return
        self.done.callback(answer)
