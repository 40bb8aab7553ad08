"""Building the whole proxy from a config: every part, made once and handed to
the root. The one place that picks the real HTTP client and agent transport."""

from __future__ import annotations

import os
from typing import Any

from llmproxy.compat import CompatSelection
from llmproxy.compat import select as select_compat
from llmproxy.config import Config, ConfigError
from llmproxy.config.keys import KeyRing, load_keys
from llmproxy.config.security import secrets_of
from llmproxy.core.hub import Hub
from llmproxy.core.reactors import IServiceReactor
from llmproxy.hosts.agentclient import IAgentTransport
from llmproxy.hosts.fleet import Fleet
from llmproxy.hosts.locks import HostLocks
from llmproxy.hosts.roster import RosterFetcher, http_fetcher
from llmproxy.lifecycle.components import Parts, Process
from llmproxy.lifecycle.handover import Handover
from llmproxy.lifecycle.listen import Inherited
from llmproxy.lifecycle.notify import INotifier, NullNotifier
from llmproxy.lifecycle.pidfile import PidFile
from llmproxy.lifecycle.runtime import Runtime
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.lifecycle.tlslistener import ServerCertificate
from llmproxy.lifecycle.upgrade import Launcher, Upgrade
from llmproxy.lifecycle.upstreamtls import HostTLSPolicy
from llmproxy.observe.capmetrics import CapacityMetrics
from llmproxy.observe.eventstream import EventLog
from llmproxy.observe.fastpaths import FastPathMetrics
from llmproxy.observe.inflight import InFlight
from llmproxy.observe.keyusage import KeyUsage
from llmproxy.observe.metrics import Metrics
from llmproxy.speedups import Selection, select
from llmproxy.speedups.relaychunks import relay_class
from llmproxy.web.access import Access
from llmproxy.web.credentials import UpstreamCredentials
from llmproxy.web.forward import Forwarder, HTTPClient


def build_service(config: Config, reactor: IServiceReactor, *, http: HTTPClient,
                  fetch: RosterFetcher | None = None, pool: Any = None,
                  notifier: INotifier | None = None, process: Process | None = None,
                  hub: Hub | None = None, config_path: str | None = None,
                  inherited: Inherited | None = None, handover: Handover | None = None,
                  pidfile: PidFile | None = None, launcher: Launcher | None = None,
                  agent: IAgentTransport | None = None,
                  locks: HostLocks | None = None,
                  keys: KeyRing | None = None,
                  certificate: ServerCertificate | None = None,
                  speedups: Selection | None = None,
                  compat: CompatSelection | None = None) -> LLMProxyService:
    """The proxy as one service. Everything but the config, the reactor and the
    HTTP client has a default fit for tests; `makeService` passes the real ones.
    The keys file is read here unless `keys` are given; ConfigError if it, or a
    host's `api_key_env`, is bad."""
    hub = hub or Hub.logging()
    # Unless told, the fast paths the environment's switch and their guards allow
    # (so the suite's two runs, LLMPROXY_SPEEDUPS=0 and 1, reach every test).
    speedups = speedups if speedups is not None else select(os.environ)
    compat = compat if compat is not None else select_compat()
    process = process or Process()
    if keys is None and config.keys_file is not None:
        keys = load_keys(config.keys_file)
    access = Access(keys, config.public_status)
    if certificate is None and config.tls is not None:
        certificate = ServerCertificate(config.tls)
    upstream_keys, missing = secrets_of(config.hosts, process.environ)
    if missing:
        raise ConfigError(missing)
    if upstream_keys:
        http = UpstreamCredentials(http, config.hosts, upstream_keys)
    runtime = Runtime(config, reactor, fetch or http_fetcher(http), hub.publish,
                      path=config_path, hangup=process.hangup)
    fleet = Fleet(config, reactor, process.environ, hub.publish, transport=agent, locks=locks)
    upgrade = Upgrade(reactor, hub, pidfile or PidFile(None),
                      launcher or Launcher(reactor, environ=process.environ,
                                           timeout=config.upgrade_timeout_seconds),
                      handover=handover)
    forwarder = Forwarder(reactor, http, lambda: runtime.config.header_timeout_seconds,
                          fleet.chooser, lambda: upgrade.successor_url,
                          relay=relay_class(speedups))
    inflight = InFlight(reactor, hub)
    events = EventLog(reactor)
    metrics = Metrics(lambda name: runtime.catalog.resolve(name) is not None,
                      inflight.by_host, lambda: upgrade.generation)
    key_usage = KeyUsage(metrics.registry)
    hub.subscribe(events)
    hub.subscribe(metrics)
    hub.subscribe(key_usage)
    metrics.registry.register(FastPathMetrics(speedups.as_json(), compat.as_json()))
    hub.subscribe(CapacityMetrics(metrics.registry, lambda: fleet.gates, reactor.seconds))
    parts = Parts(runtime=runtime, fleet=fleet, forwarder=forwarder, inflight=inflight,
                  upgrade=upgrade, notifier=notifier or NullNotifier(), hub=hub,
                  events=events, metrics=metrics, process=process, inherited=inherited,
                  pool=pool, access=access, key_usage=key_usage, certificate=certificate,
                  speedups=speedups, compat=compat)
    return LLMProxyService(reactor, parts)


def upstream_client(config: Config, reactor: IServiceReactor,
                    tls: HostTLSPolicy | None = None,
                    speedups: Selection | None = None) -> tuple[HTTPClient, Any]:
    """The streaming HTTP client for upstreams, and its connection pool: the
    engine_client speedup's when `speedups` has it on, else the reference one
    (treq, web/engineclient.py). https upstreams are verified by `tls` (built
    from the config when not given: ConfigError if a host's TLS file is bad)."""
    tls = tls or HostTLSPolicy(config.hosts)
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
