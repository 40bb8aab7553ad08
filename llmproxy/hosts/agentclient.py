"""Calling a GPU host's ``llmproxy-agent`` over ssh: one JSON order in, one JSON answer out.

Both sides speak protocol PROTOCOL (llmproxy/agent/protocol.py): every order carries
``"protocol": PROTOCOL`` and the name of its host (the agent keeps each host's engines apart,
even when hosts share an ssh target), and an answer of another protocol (or of none: an agent
from an older install) is an AgentError naming both, never read as if it were ours.

A host without an ``agent`` command runs the agent this proxy brings (hosts/agentbundle.py):
a call answered ``bundle_missing`` installs it on the host and is made once more.

Every call runs as ``setsid --wait SSH... TARGET AGENT...`` in its own session, so a terminal's
Ctrl-C or a ``KillMode=mixed`` SIGTERM to the proxy's process group does not kill a switch in
flight; every call has a timeout, after which the call's whole process group is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Interface, implementer

from llmproxy.agent.protocol import HOST_FIELD, PROTOCOL, exit_text
from llmproxy.config import HostConfig
from llmproxy.core.reactors import IProcessClock
from llmproxy.core.redact import quote_log
from llmproxy.hosts.agentbundle import Bundle, bundle

# What an ssh client needs from the proxy's environment (spawnProcess passes none by default).
PASSED_ENV = ("PATH", "HOME", "SSH_AUTH_SOCK", "LANG")
STDERR_TAIL_CHARS = 400
_STDOUT_LIMIT = 1024 * 1024
_STDERR_KEEP = 8192


def agent_argv(ssh_command: Sequence[str], host: HostConfig, code: Bundle | None = None,
               *install: str) -> list[str]:
    """The command line of a call to `host`'s agent (`llmproxy doctor` runs it too): its
    ``agent`` command, else the agent this proxy brings (`code`, by default this proxy's;
    `install`: ``("install",)`` for the call that sends it)."""
    assert host.ssh is not None
    agent = host.agent or (code or bundle()).remote(PROTOCOL, *install)
    return ["setsid", "--wait", *ssh_command, host.ssh, *agent]


class AgentError(Exception):
    """An agent call failed; str() is the reason (ssh exit status + stderr tail, a timeout,
    an unparsable answer, or the agent's own ``{"ok": false, "error"}``)."""


class IAgentTransport(Interface):
    """How orders reach a host's agent: ssh in production, a fake in tests."""

    def call(host: HostConfig, order: dict[str, Any], timeout: float) -> Deferred[dict[str, Any]]:
        """Run the host's agent with `order` (stamped ``"protocol": PROTOCOL``) as JSON on
        stdin; fires with the parsed JSON answer (``"ok": false`` answers are returned, not
        raised); fails with AgentError when no answer could be had within `timeout` seconds,
        or the answer is of another protocol (`protocol_error`)."""

    def kill_all() -> int:
        """End every call in flight now (the process exits at once); how many."""


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


class _AgentProcess(ProcessProtocol):
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


@implementer(IAgentTransport)
class SSHAgentTransport:
    """Runs ``setsid --wait *ssh_command host.ssh *host.agent`` per call via spawnProcess.

    `environ` is where PATH, HOME, SSH_AUTH_SOCK and LANG are taken from; `killpg` is
    injectable for tests. The child is a session leader, so its pid is its process group.
    """

    log = Logger()

    def __init__(self, reactor: IProcessClock, ssh_command: Sequence[str], *,
                 environ: Mapping[str, str] = os.environ,
                 killpg: Callable[[int, int], None] = os.killpg,
                 agent_code: Callable[[], Bundle] = bundle) -> None:
        self._reactor = reactor
        self._agent_code = agent_code
        # ssh targets known to hold this proxy's agent code (installed, or answered with it)
        self._installed: set[str] = set()
        self.ssh_command = tuple(ssh_command)
        self._environ = environ
        self._killpg = killpg
        self._running: set[int] = set()   # process groups of the calls in flight
        # Who sends the orders (``machine``, ``pid``, ``runtime_dir``): the agent checks it
        # against the host's lease (llmproxy/agent/lease.py). None: orders name nobody.
        self.holder: dict[str, Any] | None = None

    def stamp(self, order: dict[str, Any], host: HostConfig | None = None) -> dict[str, Any]:
        """`order` as it is sent: with the protocol, `host`'s name and, when set, the holder."""
        stamped = {**order, "protocol": PROTOCOL}
        if host is not None:
            stamped[HOST_FIELD] = host.name
        if self.holder is not None:
            stamped["holder"] = dict(self.holder)
        return stamped

    def argv(self, host: HostConfig, *install: str) -> list[str]:
        """The command line of a call to `host`'s agent: its ``agent`` command, else the
        agent this proxy brings (`install`: ``("install",)`` for the call that sends it)."""
        return agent_argv(self.ssh_command, host, self._agent_code(), *install)

    def ready(self, host: HostConfig, timeout: float = 60.0) -> Deferred[None]:
        """Fires once `host` can run its agent: at once for a host with an ``agent``
        command or whose target holds this proxy's agent code, else after installing it;
        fails with AgentError when it cannot be installed."""
        if host.agent or not host.ssh or host.ssh in self._installed:
            return _succeeded()
        return self.install(host, timeout)

    def install(self, host: HostConfig, timeout: float = 60.0) -> Deferred[None]:
        """Send this proxy's agent code to `host` (kept there by its digest)."""
        assert host.ssh is not None
        target = host.ssh

        def installed(answer: dict[str, Any]) -> None:
            error = answer_error(answer)
            if error is not None:
                raise AgentError(f"agent on {host.name}: cannot install the agent: {error}")
            self._installed.add(target)

        d = self._run(host, self.argv(host, "install"), self._agent_code().data, timeout,
                      "install")
        return d.addCallback(installed)

    def forget(self, host: HostConfig) -> None:
        """`host` said it has no agent code for this proxy (a cache cleaned): the next
        `ready` installs it again."""
        self._installed.discard(host.ssh or "")

    def env(self) -> dict[str, str]:
        """The child's environment: only what ssh needs."""
        return {k: self._environ[k] for k in PASSED_ENV if k in self._environ}

    def call(self, host: HostConfig, order: dict[str, Any],
             timeout: float) -> Deferred[dict[str, Any]]:
        """See IAgentTransport.call."""
        if not host.ssh:
            return _failed(AgentError(f"agent on {host.name}: the host has no ssh target"))
        line = json.dumps(self.stamp(order, host)).encode() + b"\n"
        first = self._run(host, self.argv(host), line, timeout, order.get("op"))
        if host.agent:
            return first
        target = host.ssh

        def answered(answer: dict[str, Any]) -> Any:
            if not answer.get("bundle_missing"):
                self._installed.add(target)
                return answer
            self.forget(host)
            again = self.install(host, timeout)
            again.addCallback(lambda _: self._run(host, self.argv(host), line, timeout,
                                                  order.get("op")))
            return again

        return first.addCallback(answered)

    def _run(self, host: HostConfig, argv: list[str], stdin: bytes, timeout: float,
             op: object) -> Deferred[dict[str, Any]]:
        """One ssh call: `stdin` in, the parsed answer out, within `timeout`."""
        pid: list[int] = []
        timer: list[IDelayedCall] = []

        def kill() -> None:
            if pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    self._killpg(pid[0], signal.SIGKILL)

        def cancel(d: Deferred[dict[str, Any]]) -> None:
            kill()

        done: Deferred[dict[str, Any]] = Deferred(cancel)

        def timed_out() -> None:
            if done.called:
                return
            self.log.warn("agent on {host}: no answer within {timeout:g}s to {op}: killing "
                          "process group {pgid}", host=host.name, timeout=timeout,
                          op=op, pgid=pid[0] if pid else None)
            kill()
            done.errback(AgentError(f"agent on {host.name}: no answer within {timeout:g}s"))

        def stop_timer(result: object) -> object:
            if timer and timer[0].active():
                timer[0].cancel()
            return result

        protocol = _AgentProcess(host.name, stdin, done)
        try:
            process = self._reactor.spawnProcess(protocol, argv[0], argv, env=self.env())
        except OSError as e:
            return _failed(AgentError(f"agent on {host.name}: cannot run {argv[0]}: {e}"))
        if process.pid is not None:
            pid.append(process.pid)
            self._running.add(process.pid)
        if not done.called:
            timer.append(self._reactor.callLater(timeout, timed_out))
        done.addBoth(stop_timer)
        done.addBoth(self._ended, process.pid)
        return done

    def _ended(self, result: object, pgid: int | None) -> object:
        self._running.discard(pgid or 0)
        return result

    def kill_all(self) -> int:
        """SIGKILL the process group of every call in flight (they run in sessions
        of their own, so a signal to the proxy does not reach them). For a process
        that exits at once: nothing of it may outlive it."""
        killed = 0
        for pgid in list(self._running):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                self._killpg(pgid, signal.SIGKILL)
                killed += 1
        self._running.clear()
        return killed


def _succeeded() -> Deferred[None]:
    d: Deferred[None] = Deferred()
    d.callback(None)
    return d


def _failed(error: AgentError) -> Deferred[dict[str, Any]]:
    d: Deferred[dict[str, Any]] = Deferred()
    d.errback(error)
    return d
