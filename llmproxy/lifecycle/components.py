"""The parts the root service wires together, and the process's OS seams."""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmproxy.compat import CompatSelection
from llmproxy.core.hub import Hub
from llmproxy.hosts.fleet import Fleet
from llmproxy.lifecycle.listen import Inherited
from llmproxy.lifecycle.notify import INotifier
from llmproxy.lifecycle.openfiles import raise_open_files
from llmproxy.lifecycle.runtime import Runtime
from llmproxy.lifecycle.signals import HardDeadline, SignalLatch, exit_now, install_stop_signals
from llmproxy.lifecycle.tlslistener import ServerCertificate
from llmproxy.lifecycle.upgrade import Upgrade
from llmproxy.observe.capture import CaptureRing
from llmproxy.observe.energy import Energy
from llmproxy.observe.eventstream import EventLog
from llmproxy.observe.inflight import InFlight
from llmproxy.observe.keyusage import KeyUsage
from llmproxy.observe.metrics import Metrics
from llmproxy.observe.queueview import QueueView
from llmproxy.speedups import REFERENCE, Selection
from llmproxy.web.access import Access
from llmproxy.web.forward import Forwarder
from llmproxy.web.turns import Turns

if TYPE_CHECKING:
    from llmproxy.observe.tracing import Tracing  # needs the [otel] extra


def _keep_heap() -> None:
    pass


@dataclass(frozen=True)
class Process:
    """The process's seams: how it exits, its last-resort timer, its signals,
    its limit of open files, what becomes of start-up's heap (twistd's freezes
    it, see gcfreeze.py; by default, as in tests, nothing)."""

    exit: Callable[[int], None] = exit_now
    hard_deadline: HardDeadline = field(default_factory=HardDeadline)
    install_signals: Callable[..., None] = install_stop_signals
    hangup: SignalLatch = field(default_factory=SignalLatch)
    upgrade_signal: SignalLatch = field(default_factory=lambda: SignalLatch(signal.SIGUSR1))
    environ: Mapping[str, str] = field(default_factory=dict)
    raise_open_files: Callable[[], object] = raise_open_files
    settle_heap: Callable[[], object] = _keep_heap


@dataclass(frozen=True)
class Parts:
    """What the root wires together (built by `assemble.build_service`)."""

    runtime: Runtime
    fleet: Fleet
    forwarder: Forwarder
    inflight: InFlight
    upgrade: Upgrade
    notifier: INotifier
    hub: Hub
    events: EventLog
    metrics: Metrics
    process: Process = field(default_factory=Process)
    inherited: Inherited | None = None
    pool: Any = None            # the upstream connection pool, closed last
    access: Access = field(default_factory=Access)       # the inbound keys in force
    key_usage: KeyUsage = field(default_factory=KeyUsage)
    certificate: ServerCertificate | None = None           # the listener's, with `tls`
    upstream_tls: Any = None      # the engine client's HostTLSPolicy (upstreamtls)
    speedups: Selection = REFERENCE       # which fast paths run (llmproxy.speedups)
    compat: CompatSelection = field(default_factory=CompatSelection)   # llmproxy.compat
    queues: QueueView | None = None       # each host's queue with positions and ETAs
    tracing: Tracing | None = None        # the requests' spans (config `tracing`)
    captures: CaptureRing | None = None   # requests and answers kept (capture on)
    energy: Energy | None = None          # the GPUs' energy by request, engine and host
    turns: Turns | None = None            # set-ups and captures' packings, a slice per turn
