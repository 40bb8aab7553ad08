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
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from zope.interface import Interface, implementer

from llmproxy.agent.protocol import HOST_FIELD, OP_FIELD, PROTOCOL
from llmproxy.config import HostConfig
from llmproxy.core.reactors import IProcessClock
from llmproxy.hosts.agentbundle import Bundle, bundle
from llmproxy.hosts.agentprocess import (
    AgentError,
    AgentProcess,
    answer_error,
    ended_text,
    protocol_error,
)

__all__ = ["AgentError", "IAgentTransport", "SSHAgentTransport", "agent_argv",
           "answer_error", "ended_text", "protocol_error"]

# What an ssh client needs from the proxy's environment (spawnProcess passes none by default).
PASSED_ENV = ("PATH", "HOME", "SSH_AUTH_SOCK", "LANG")


def agent_argv(ssh_command: Sequence[str], host: HostConfig, code: Bundle | None = None,
               *install: str) -> list[str]:
    """The command line of a call to `host`'s agent (`llmproxy doctor` runs it too): its
    ``agent`` command, else the agent this proxy brings (`code`, by default this proxy's;
    `install`: ``("install",)`` for the call that sends it)."""
    assert host.ssh is not None
    agent = host.agent or (code or bundle()).remote(PROTOCOL, *install)
    return ["setsid", "--wait", *ssh_command, host.ssh, *agent]


class IAgentTransport(Interface):
    """How orders reach a host's agent: ssh in production, a fake in tests."""

    def call(host: HostConfig, order: dict[str, Any], timeout: float) -> Deferred[dict[str, Any]]:
        """Run the host's agent with `order` (stamped ``"protocol": PROTOCOL``) as JSON on
        stdin; fires with the parsed JSON answer (``"ok": false`` answers are returned, not
        raised); fails with AgentError when no answer could be had within `timeout` seconds,
        or the answer is of another protocol (`protocol_error`)."""

    def kill_all() -> int:
        """End every call in flight now (the process exits at once); how many."""


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

    def identify(self, holder: dict[str, Any]) -> None:
        """Name this proxy (hosts/lease.py's `holder_identity`) in every order from now on."""
        self.holder = dict(holder)

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
        first = self._run(host, self.argv(host), line, timeout, order.get(OP_FIELD))
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
                                                  order.get(OP_FIELD)))
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

        protocol = AgentProcess(host.name, stdin, done)
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
