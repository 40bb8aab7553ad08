"""The hosts' leases as this proxy sees them: who it is (`holder_identity`), which managed
hosts it holds, which another proxy holds, and the standby's wait for all of them.

The lease itself lives on each GPU host (llmproxy/agent/lease.py), held by this proxy's
watch session (`watch`); the agent refuses a start or stop from anyone else. Here:

- a host held by another proxy is refused before any agent call: every request for its
  engines fails at once naming the holder (`Host.hold`), and what this proxy
  adopted there is dropped (it manages nothing of that host);
- a host whose lease this proxy takes after having waited for it (a standby, or a proxy
  that was refused) has its engines adopted as they run, never restarted;
- `taken()` fires once every managed host's lease is held and its engines adopted: a
  standby reports ready then.

The identity: the machine (hostname), the pid and the runtime directory. The same machine
and runtime directory are the same proxy, so an upgrade's successor shares its
predecessor's lease.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from llmproxy.agent.protocol import LeaseState
from llmproxy.core.events import HostLease
from llmproxy.core.hub import Publish
from llmproxy.hosts.host import Host


def holder_identity(runtime_dir: str, *, pid: int | None = None,
                    machine: str | None = None) -> dict[str, Any]:
    """This proxy as orders name it: ``machine``, ``pid`` and ``runtime_dir`` (resolved)."""
    return {"machine": machine or socket.gethostname(), "pid": os.getpid() if pid is None
            else pid, "runtime_dir": os.path.realpath(runtime_dir)}


def held_text(holder: Mapping[str, Any]) -> str:
    """``held by MACHINE pid P since T`` (T in UTC)."""
    since = holder.get("since")
    when = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
            if isinstance(since, int | float) else "an unknown time")
    return f"held by {holder.get('machine')} pid {holder.get('pid')} since {when}"


class HostLeases:
    """The leases of the managed hosts, fed the watches' ``lease`` events (`event`).

    `standby`: this proxy adopted nothing at start and waits for every lease; otherwise
    only a host whose lease came after a refusal is adopted again."""


    def __init__(self, managers: Mapping[str, Host], clock: IReactorTime,
                 publish: Publish, standby: bool = False) -> None:
        self._managers = managers
        self._clock = clock
        self._publish = publish
        self._standby = standby
        self.holders: dict[str, dict[str, Any]] = {}     # host -> its other holder
        self._ours: set[str] = set()          # held and adopted
        self._adopt: set[str] = set(managers) if standby else set()
        self._waiters: list[Deferred[None]] = []

    def event(self, host: str, event: LeaseState) -> None:
        """A lease event of `host`'s watch."""
        manager = self._managers.get(host)
        holder = event.holder
        if manager is None:
            return
        if event.held:
            self._taken(host, manager)
            return
        self._ours.discard(host)
        self._adopt.add(host)
        text = held_text(holder)
        if self.holders.get(host) != holder:
            self._publish(HostLease(self._clock.seconds(), host, False, text))
        self.holders[host] = dict(holder)
        manager.hold(f"{text}: another llmproxy manages this host")
        for engine in manager.running_engines():
            manager.forget(engine)

    def _taken(self, host: str, manager: Host) -> None:
        was = self.holders.pop(host, None)
        manager.hold(None)
        if host not in self._adopt:
            self._mark(host)
            return
        self._publish(HostLease(self._clock.seconds(), host, True, held_text(was) if was else None))
        self._adopt.discard(host)
        d = Deferred.fromCoroutine(manager.adopt())
        d.addCallback(lambda _: self._mark(host))

    def _mark(self, host: str) -> None:
        self._ours.add(host)
        if self.all_held():
            waiters, self._waiters = self._waiters, []
            for d in waiters:
                d.callback(None)

    @property
    def standby(self) -> bool:
        """Whether this proxy still waits, as a standby, for every lease (`took_over`)."""
        return self._standby

    def took_over(self) -> None:
        """The standby holds every lease: it is a proxy like any other from now on."""
        self._standby = False

    def all_held(self) -> bool:
        """Whether this proxy holds every managed host's lease, their engines adopted."""
        return self._ours >= set(self._managers)

    def taken(self) -> Deferred[None]:
        """Fires once `all_held`."""
        if self.all_held():
            d: Deferred[None] = Deferred()
            d.callback(None)
            return d
        d = Deferred()
        self._waiters.append(d)
        return d

    def waiting_for(self) -> dict[str, str]:
        """Per managed host not held yet: whom this proxy waits for."""
        return {host: held_text(self.holders[host]) if host in self.holders
                else "no answer from its agent yet"
                for host in sorted(set(self._managers) - self._ours)}
