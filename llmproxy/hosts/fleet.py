"""The hosts together (the fleet): every host (hosts/host.py: its scheduler, its
placement policy and, managed, its engine controller), the idle stopper, the
per-host locks, the cordons, the leases and the agent transport, as the root
service uses them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from twisted.internet.defer import Deferred, DeferredList
from twisted.logger import Logger

from llmproxy.agent.protocol import AgentEvent, Exit, Health, Hello, LeaseState, Memory
from llmproxy.config import Config
from llmproxy.core.capacity import EngineCommand
from llmproxy.core.hub import Publish
from llmproxy.core.reactors import IProcessClock
from llmproxy.hosts.agentclient import IAgentTransport, SSHAgentTransport
from llmproxy.hosts.agentstream import AgentStream
from llmproxy.hosts.catalog import Route
from llmproxy.hosts.choose import Chooser
from llmproxy.hosts.cordons import Cordons
from llmproxy.hosts.enginelogs import EngineLog, log_engine, open_engine_log
from llmproxy.hosts.host import Host
from llmproxy.hosts.idle import IdleStopper
from llmproxy.hosts.lease import HostLeases, holder_identity
from llmproxy.hosts.locks import HostLocks, managed_targets, runtime_dir
from llmproxy.hosts.measured import MeasuredMemory
from llmproxy.hosts.naps import Naps
from llmproxy.hosts.queueerrors import ProxyStopping, StopFailed, SwitchFailed
from llmproxy.hosts.watch import HostWatch

# (host, engine) -> the bytes each response in flight on that engine has sent, by request id.
Sending = Callable[[str, str], Mapping[str, int]]


class Fleet:
    """Every managed host's engine, its lock and its idle stop."""

    log = Logger()

    def __init__(self, config: Config, reactor: IProcessClock, environ: Mapping[str, str],
                 publish: Publish, transport: IAgentTransport | None = None,
                 locks: HostLocks | None = None, sending: Sending | None = None,
                 standby: bool = False,
                 on_hello: Callable[[str], object] = lambda host: None) -> None:
        self._config = config
        self._environ = environ
        transport = transport or SSHAgentTransport(reactor, config.ssh_command, environ=environ)
        self._transport = transport
        self._protected: dict[str, frozenset[str]] = {}
        # Each managed host watched over a long-lived agent session (real ssh only).
        self.watches: dict[str, HostWatch] = {}
        if isinstance(transport, SSHAgentTransport):
            ssh = transport
            self.watches = {h.name: HostWatch(
                h, reactor, lambda h, order, on: AgentStream(reactor, ssh, h, order, on),
                self._watched) for h in config.hosts if h.managed}
        # The engines' measured GPU memory: placement counts it (runtime_dir/memory.json).
        self.measured = MeasuredMemory(config, lambda create: runtime_dir(
            config.runtime_dir, environ, create=create), reactor, publish)
        self.naps = Naps(config, reactor, transport, publish, self.watches)   # sleep, wake
        # One per host, managed or not: its slots and its waiting requests.
        self.gates: dict[str, Host] = {h.name: Host(
            h, reactor, transport=transport if h.managed else None, publish=publish,
            # During an upgrade the predecessor's streams may still use an engine.
            protected=self._protector(h.name),
            # The hung-engine rule samples what the engines' responses in flight sent.
            sending=self._sender(sending, h.name) if sending is not None else None,
            watching=self.watches[h.name].is_connected if h.name in self.watches else None,
            measured=self.measured.of_host(h.name), sleepwake=self.naps.of(h.name))
            for h in config.hosts}
        self.naps.attach(self.gates)
        self.managers: dict[str, Host] = {h.name: self.gates[h.name]
                                          for h in config.hosts if h.managed}
        self.chooser = Chooser(self.gates, reactor, publish)
        self.leases = HostLeases(self.managers, reactor, publish, standby)
        self._started = False
        # Checked often enough that an engine stops within a quarter of its idle
        # time (the shortest of the top-level one and every engine's own).
        shortest = min([config.idle_stop_seconds] + [
            e.idle_stop_seconds for m in self.managers.values() for e in m.host.engines.values()
            if e.idle_stop_seconds is not None])
        self.idle = IdleStopper(list(self.managers.values()), reactor, config.idle_stop_seconds,
                                check_every=min(5.0, max(0.25, shortest / 4)))
        self._locks = locks
        self._publish = publish
        self._clock = reactor
        self.cordons = Cordons(self.gates, lambda create: runtime_dir(
            config.runtime_dir, environ, create=create), reactor, publish)
        # What a watch's hello makes stale: the host's roster (the runtime's read).
        self.on_hello = on_hello

    @staticmethod
    def _sender(sending: Sending, host: str) -> Callable[[str], Mapping[str, int]]:
        return lambda engine: sending(host, engine)

    def _watched(self, host: str, event: AgentEvent) -> None:
        """An event of a host's watch for its supervisor: an engine's exit, its
        health, the hello of a (re)opened session."""
        manager = self.managers.get(host)
        if manager is None:
            return
        if isinstance(event, LeaseState):
            self.leases.event(host, event)
        elif isinstance(event, Exit):
            manager.supervisor.exited(event.engine, event)
        elif isinstance(event, Health):
            manager.supervisor.health(event.engine, event.healthy)
        elif isinstance(event, Hello):
            manager.supervisor.hello(e.engine for e in event.engines)
            self.naps.heard(host)      # a host that slept answers again
            self.on_hello(host)
        elif isinstance(event, Memory) and \
                self.measured.measured(host, event.engine, event.memory_bytes):
            manager.scheduler.pump()     # a start that waited for room may fit now

    def _protector(self, host: str) -> Callable[[str], bool]:
        return lambda engine: engine in self._protected.get(host, ())

    def lock(self, inherited: Mapping[str, int] | None = None) -> None:
        """Lock every managed ssh target (each once), or adopt the locks a
        predecessor handed over. Raises LockHeld naming target, file and pid."""
        targets = managed_targets(self._config)
        if not targets:
            return
        if self._locks is None:
            self._locks = HostLocks(runtime_dir(self._config.runtime_dir, self._environ))
        if isinstance(self._transport, SSHAgentTransport) and self._transport.holder is None:
            # Who this proxy is to the agents: the lease's holder (hosts/lease.py).
            self._transport.identify(holder_identity(self._locks.directory))
        if inherited:
            self._locks.adopt(inherited)
        self._locks.acquire(t for t in targets if t not in (inherited or {}))

    def load_cordons(self) -> None:
        """Read the cordons on file (hosts/cordons.py); CordonFileError if unreadable."""
        self.cordons.load()

    def cordon(self, host: str, cordoned: bool = True) -> None:
        """Cordon `host` or lift its cordon, on file first (hosts/cordons.py)."""
        self.cordons.cordon(host, cordoned)

    async def command(self, host: str, op: str, engine: str | None = None) -> str | None:
        """An operator's `start` of `engine` (or the start-up's `preload`) or `stop` of
        `engine` (None: every engine) on a managed host, through its queue (a stop waits for the
        requests on the engine, never cuts them); None once done, else why it
        failed. Published as EngineCommand."""
        manager = self.managers.get(host)
        if manager is None:
            return f"host {host} is not managed (it has no engines)" if host in self.gates \
                else f"no host named {host!r}"
        if manager.held_by is not None:
            return manager.held_by
        started = self._clock.seconds()
        self._publish(EngineCommand(started, host, op, "begun", engine))
        reason = None
        try:
            if op == "stop" and engine is not None:
                if engine not in manager.host.engines:
                    raise StopFailed(host, engine, "the host has no such engine")
                if manager.host.budgeted:
                    await manager.stop_one(engine)
                elif manager.runs(engine) or manager.switching_to == engine:
                    await manager.stop_now()     # one engine at a time: it is the one
            elif op == "stop":
                await manager.stop_now()
            else:               # start, preload
                if op == "start" and engine is not None:
                    manager.supervisor.clear(engine)    # an operator's start tries again
                lease = await manager.acquire(engine, bounded=False)
                lease.release()
        except (SwitchFailed, StopFailed, ProxyStopping) as e:
            reason = str(e)
        self._publish(EngineCommand(self._clock.seconds(), host, op,
                                    "done" if reason is None else "failed", engine, reason,
                                    elapsed=self._clock.seconds() - started))
        return reason

    def model_state(self, route: Route) -> str:
        """`loaded`, `loading`, `unloaded` or `failed`: the best of its hosts' (in
        that order). A managed host says whether the route's engine runs there (or
        failed there); an unmanaged host's models are loaded while its roster
        lists them."""
        states = set()
        for host in route.hosts:
            manager = self.managers.get(host.name)
            if manager is None or route.engine is None:
                states.add("loaded" if host.name in route.available_on else "unloaded")
            else:
                states.add(manager.state_of(route.engine))
        for best in ("loaded", "loading", "waking", "unloaded", "asleep", "failed"):
            if best in states:
                return best
        return "unloaded"

    def lock_fds(self) -> dict[str, int]:
        """The open lock fds, for a successor to inherit."""
        return self._locks.fds() if self._locks is not None else {}

    def adopt(self) -> Deferred[Any]:
        """Ask every managed host's agent what runs there, and adopt it."""
        return DeferredList([Deferred.fromCoroutine(m.adopt()) for m in self.managers.values()],
                            consumeErrors=True)

    def preload(self) -> list[Deferred[str | None]]:
        """After adoption: start each managed host's `preload` engines through its
        queue, in the order listed (requests that come meanwhile wait behind them):
        on a host that runs one engine at a time, where nothing runs; on a budgeted
        host, each one not running already. One Deferred per preload, firing with
        None or why it failed."""
        return [Deferred.fromCoroutine(self.command(name, "preload", engine))
                for name, m in self.managers.items()
                for engine in self._to_preload(m)]

    @staticmethod
    def _to_preload(manager: Host) -> tuple[str, ...]:
        if manager.host.budgeted:
            return tuple(e for e in manager.host.preload if not manager.runs(e))
        return manager.host.preload if manager.running is None else ()

    def start(self) -> None:
        """Idle stops and watches begin (once)."""
        if self._started:
            return
        self._started = True
        if self.managers:
            self.idle.start()
            self.naps.start()
        for watch in self.watches.values():
            watch.start()

    def close(self, handing_over: bool = False) -> None:
        """The proxy stops: no switch or idle stop starts from now on. Requests
        waiting for a switch are failed (ProxyStopping); those waiting for a slot
        too when `handing_over` (an upgrade's successor serves them), else they
        are served as slots free during the drain."""
        self.idle.close()
        self.idle.stop()
        self.naps.stop()
        for name, watch in self.watches.items():
            watch.stop()
            self.managers[name].supervisor.stop()
        for gate in self.gates.values():
            gate.close(handing_over)

    def operations(self) -> list[Deferred[Any]]:
        """Switches and idle stops in progress (the graceful stop waits for them)."""
        ops = [d for m in self.managers.values() for d in m.operations()]
        return ops + self.idle.operations()

    def protect(self, engines: Mapping[str, AbstractSet[str]]) -> None:
        """The predecessor's streams use these engines (host -> engines; a host
        with memory_gb may have several): none of them is switched or stopped
        until it says otherwise."""
        self._protected = {host: frozenset(names) for host, names in engines.items()}
        for manager in self.managers.values():
            manager.reconsider()   # a switch may have waited for this

    def snapshot(self, now: float) -> dict[str, dict[str, Any]]:
        """Per managed host, for /status: engine state and idle deadline."""
        out = {}
        for name, manager in self.managers.items():
            doc = manager.snapshot(now)
            deadline = self.idle.deadline(manager)
            doc["idle_stop_in_seconds"] = None if deadline is None else round(deadline - now, 1)
            doc["supervision"] = manager.supervisor.snapshot()
            doc["held_by"] = manager.held_by
            doc["sleep"] = self.naps.snapshot(name, now)
            if name in self.watches:
                doc["watch"] = self.watches[name].snapshot(now)
            out[name] = doc
        return out

    def capacity(self, now: float) -> dict[str, dict[str, Any]]:
        """Per host, for /status: its slots, queue and cordon."""
        return {name: gate.capacity(now) for name, gate in self.gates.items()}

    def kill_agent_calls(self) -> int:
        """End every ssh call in flight now, watches included (the process exits at
        once)."""
        for watch in self.watches.values():
            watch.kill()
        return self._transport.kill_all()

    def release(self) -> None:
        if self._locks is not None:
            self._locks.release()

    def open_log(self, host: str, engine: str | None, lines: int, follow: bool,
                 on_line: Callable[[str, str], None]) -> EngineLog:
        """Read an engine's log on a managed host over ssh (hosts/enginelogs.py): its last
        `lines` lines, then with `follow` each new one, to `on_line(engine, line)`; `engine`
        None means the host's running engine, else its only one. LogRefused says why not."""
        name = log_engine(host, host in self.gates, self.managers.get(host), engine)
        return open_engine_log(self._clock, self._transport, self.managers[host].host, name,
                               lines, follow, on_line)
