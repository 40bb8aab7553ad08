"""Building the whole proxy from a config: every part, made once and handed to
the root. The one place that picks the real HTTP client and agent transport."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred

from llmproxy.compat import CompatSelection
from llmproxy.compat import select as select_compat
from llmproxy.config import Config
from llmproxy.core.hub import Hub
from llmproxy.core.reactors import IServiceReactor
from llmproxy.hosts.agentclient import IAgentTransport
from llmproxy.hosts.fleet import Fleet
from llmproxy.hosts.locks import HostLocks
from llmproxy.hosts.roster import RosterFetcher, http_fetcher
from llmproxy.lifecycle.accessfiles import AccessFiles, load_access_files
from llmproxy.lifecycle.components import Parts, Process
from llmproxy.lifecycle.handover import Handover
from llmproxy.lifecycle.listen import Inherited
from llmproxy.lifecycle.notify import INotifier, NullNotifier
from llmproxy.lifecycle.pidfile import PidFile
from llmproxy.lifecycle.runtime import Runtime
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.lifecycle.upgrade import Launcher, Upgrade
from llmproxy.observe.capmetrics import CapacityMetrics
from llmproxy.observe.capture import CaptureRing
from llmproxy.observe.capturefiles import CaptureFiles
from llmproxy.observe.energy import Energy
from llmproxy.observe.energymetrics import EnergyMetrics
from llmproxy.observe.eventstream import EventLog
from llmproxy.observe.fastpaths import FastPathMetrics
from llmproxy.observe.hostmetrics import HostMetrics
from llmproxy.observe.inflight import InFlight
from llmproxy.observe.keyusage import KeyUsage
from llmproxy.observe.metrics import Metrics
from llmproxy.observe.queueview import QueueView
from llmproxy.observe.sleepmetrics import SleepMetrics
from llmproxy.observe.tokenmetrics import TokenMetrics
from llmproxy.speedups import Selection, select
from llmproxy.speedups.relaychunks import relay_class
from llmproxy.web.access import Access
from llmproxy.web.cors import Cors
from llmproxy.web.credentials import UpstreamCredentials
from llmproxy.web.energybudget import EnergyBudgets
from llmproxy.web.forward import Forwarder, HTTPClient
from llmproxy.web.ratelimit import RateLimits
from llmproxy.web.turns import Turns

if TYPE_CHECKING:
    from llmproxy.observe.tracing import Tracing  # needs the [otel] extra


@dataclass(frozen=True)
class ServiceInputs:
    """What `build_service` builds the proxy from. Everything but the config, the
    reactor and the HTTP client has a default fit for tests; `makeService` passes
    the real ones. `access_files` are loaded from the config and
    `process.environ` when not given (ConfigError if any is bad)."""

    config: Config
    reactor: IServiceReactor
    http: HTTPClient
    fetch: RosterFetcher | None = None           # default: GET /v1/models through `http`
    pool: Any = None                             # the upstream pool, closed last
    notifier: INotifier = field(default_factory=NullNotifier)
    process: Process = field(default_factory=Process)
    hub: Hub = field(default_factory=Hub.logging)
    config_path: str | None = None               # None: no file to reload
    inherited: Inherited | None = None
    handover: Handover | None = None
    pidfile: PidFile = field(default_factory=lambda: PidFile(None))
    launcher: Launcher | None = None             # default: this code, re-executed
    agent: IAgentTransport | None = None         # default: ssh
    locks: HostLocks | None = None
    access_files: AccessFiles | None = None
    speedups: Selection | None = None            # default: as the environment says
    compat: CompatSelection | None = None        # default: every entry its guard allows
    standby: bool = False                        # --standby: wait for every host's lease


def build_service(inputs: ServiceInputs) -> LLMProxyService:
    """The proxy as one service, every part made once from `inputs`."""
    config, reactor, hub, process = inputs.config, inputs.reactor, inputs.hub, inputs.process
    # Unless told, the fast paths the environment's switch and their guards allow
    # (so the suite's two runs, LLMPROXY_SPEEDUPS=0 and 1, reach every test).
    speedups = inputs.speedups if inputs.speedups is not None else select(os.environ)
    compat = inputs.compat if inputs.compat is not None else select_compat()
    files = inputs.access_files or load_access_files(config, process.environ)
    energy, inflight, budgets = energy_meter(reactor, hub, lambda: fleet)
    turns = Turns(reactor)    # set-ups and packings, a slice per turn of the loop
    access = Access(files.keys, config.public_status, RateLimits(reactor, hub.publish),
                    Cors(config.cors), config.server_names, config.trusted_peers, budgets)
    http = inputs.http
    if files.upstream_keys:
        http = UpstreamCredentials(http, config.hosts, files.upstream_keys)
    runtime = Runtime(config, reactor, inputs.fetch or http_fetcher(http), hub.publish,
                      path=inputs.config_path, hangup=process.hangup)
    fleet = Fleet(config, reactor, process.environ, hub.publish, transport=inputs.agent,
                  locks=inputs.locks, sending=partial(sending, inflight),
                  standby=inputs.standby,
                  on_hello=runtime.read_roster)   # rosters follow the engines (lifecycle/runtime)
    upgrade = Upgrade(reactor, hub, inputs.pidfile,
                      inputs.launcher or Launcher(reactor, environ=process.environ,
                                                  timeout=config.upgrade_timeout_seconds),
                      handover=inputs.handover)
    fleet.naps.hold_during(lambda: upgrade.in_progress or upgrade.predecessor_exit() is not None)
    queues = QueueView(reactor, lambda: fleet.gates, hub.publish)
    tracing = traced(config, reactor, hub)
    forwarder = Forwarder(reactor, http, lambda: runtime.config.header_timeout_seconds,
                          fleet.chooser, lambda: upgrade.successor_url,
                          relay=relay_class(speedups), queues=queues, energy=energy.so_far,
                          read_timeout=lambda: runtime.config.engine_read_timeout_seconds,
                          tracing=tracing)
    events = EventLog(reactor)
    metrics = Metrics(lambda name: runtime.catalog.resolve(name) is not None,
                      inflight.by_host, lambda: upgrade.generation)
    key_usage = KeyUsage(metrics.registry)
    hub.subscribe(runtime.follow)
    hub.subscribe(events)
    hub.subscribe(metrics)
    hub.subscribe(key_usage)
    metered(energy, fleet, metrics)
    hub.subscribe(queues)
    if access.limits is not None:
        hub.subscribe(access.limits)
    metrics.registry.register(FastPathMetrics(speedups.as_json(), compat.as_json()))
    hub.subscribe(CapacityMetrics(metrics.registry, lambda: fleet.gates, reactor.seconds))
    hub.subscribe(TokenMetrics(metrics.registry, lambda name: runtime.catalog.resolve(name)
                               is not None))
    metrics.registry.register(HostMetrics(lambda: fleet.snapshot(reactor.seconds())))
    hub.subscribe(SleepMetrics(metrics.registry, lambda: fleet.snapshot(reactor.seconds())))
    parts = Parts(runtime=runtime, fleet=fleet, forwarder=forwarder, inflight=inflight,
                  upgrade=upgrade, notifier=inputs.notifier, hub=hub, events=events,
                  metrics=metrics, process=process, inherited=inputs.inherited, pool=inputs.pool,
                  access=access, key_usage=key_usage, certificate=files.certificate,
                  speedups=speedups, compat=compat, upstream_tls=files.tls_policy, queues=queues,
                  tracing=tracing, energy=energy, turns=turns,
                  captures=capture_ring(config, reactor, files, turns))
    return LLMProxyService(reactor, parts)


def traced(config: Config, reactor: IServiceReactor, hub: Hub) -> Tracing | None:
    """The requests' spans, exported to the collector of the config's `tracing`
    (subscribed to `hub`); None without the block."""
    if config.tracing is None:
        return None
    from llmproxy.observe.tracing import Tracing  # the [otel] extra: only when asked for

    tracing = Tracing.exporting(config.tracing, reactor, reactor, hub.publish)
    hub.subscribe(tracing)
    return tracing


def capture_ring(config: Config, reactor: IServiceReactor, files: AccessFiles,
                 turns: Turns) -> CaptureRing | None:
    """The capture's ring (None: capture off); the engine keys never enter it."""
    capture = config.capture
    if capture is None:
        return None
    keys = tuple(files.upstream_keys.values())
    disk = CaptureFiles(capture.dir, capture.dir_max_bytes) if capture.dir else None

    def offload(work: Callable[[], bytes]) -> Deferred[bytes]:
        """A large capture packed when its turn comes (web/turns.py): at most a slice
        of each turn of the loop, after the streams' I/O. Never in a thread: one that
        holds the GIL (the redaction's regular expressions do) holds back every send
        of the reactor's, up to the interpreter's switch interval each."""
        return turns.take().addCallback(lambda _: work())

    return CaptureRing(capture, reactor, lambda: keys, disk, offload)


def energy_meter(reactor: IServiceReactor, hub: Hub,
                 fleet: Callable[[], Fleet]) -> tuple[Energy, InFlight, EnergyBudgets]:
    """The energy meter, the requests in flight (whose ends ask it for their joules) and the
    keys' energy budgets, hearing the hub's events; the meter paces the fleet's watches (the
    fleet is made after it)."""
    energy = Energy(reactor, hub.publish, progress=lambda rid: streamed(inflight, rid),
                    pace=lambda host, busy: pace(fleet(), host, busy))
    inflight = InFlight(reactor, hub, energy=energy.finish)
    budgets = EnergyBudgets(reactor, hub.publish)
    hub.subscribe(energy)
    hub.subscribe(budgets)
    return energy, inflight, budgets


def metered(energy: Energy, fleet: Fleet, metrics: Metrics) -> None:
    """The energy meter hears each watch's power samples; /metrics shows its figures."""
    for name, watch in fleet.watches.items():
        watch.on_power(energy.listener(name))
    metrics.registry.register(EnergyMetrics(energy))


def streamed(inflight: InFlight, request_id: str) -> int:
    """The server-sent events a request in flight relayed so far (observe/energy.py's
    progress: one a token); 0 once it ended."""
    exchange = inflight.active.get(request_id)
    return 0 if exchange is None else exchange.events


def pace(fleet: Fleet, host: str, busy: bool) -> None:
    """Tell a managed host's watch whether requests are in flight on it."""
    watch = fleet.watches.get(host)
    if watch is not None:
        watch.pace(busy)


def sending(inflight: InFlight, host: str, engine: str) -> dict[str, int]:
    """The bytes each request in flight on `engine` of `host` has sent, by id: what
    the hung-engine rule samples (hosts/supervise.py), read only when it asks."""
    return {e.id: e.bytes_sent for e in inflight.active.values()
            if e.engine == engine and e.host == host}


def upstream_client(config: Config, reactor: IServiceReactor, files: AccessFiles,
                    speedups: Selection | None = None) -> tuple[HTTPClient, Any]:
    """The streaming HTTP client for upstreams, and its connection pool: the
    engine_client speedup's when `speedups` has it on, else the reference one
    (treq, web/engineclient.py). https upstreams are verified by the policy in
    `files`, the same value the service is then built with."""
    tls = files.tls_policy
    tls.warn()
    if speedups is not None and speedups.on("engine_client"):
        from llmproxy.speedups.engineclient import UpstreamClient, UpstreamPool

        pool = UpstreamPool(reactor, persistent=True)
        _size(pool)
        return UpstreamClient(reactor, pool, config.connect_timeout_seconds, tls), pool
    from llmproxy.web.engineclient import EngineClient, EnginePool

    reference = EnginePool(reactor, persistent=True)
    _size(reference)
    return EngineClient(reactor, reference, config.connect_timeout_seconds, tls), reference


def _size(pool: Any) -> None:
    """Idle connections kept per engine, and for how long: below llama-server's
    5 s keep-alive (and each cached connection is checked before reuse)."""
    pool.maxPersistentPerHost = 16
    pool.cachedConnectionTimeout = 3
