"""The root's children, in memory: Twisted's service machinery starts them with
the root, each begins its work when the proxy is ready for it, the stop chain
stops the fleet and the listener at its own steps and the rest at its end."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from zope.interface import implementer

from llmproxy.config import HostConfig, parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.components import Process
from llmproxy.lifecycle.notify import INotifier, NullNotifier
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.lifecycle.upgrade import Launcher, Upgrade
from llmproxy.testing.fakes import FakeHTTPClient
from llmproxy.testing.upgradefakes import ReadyCandidates, hand_over_to


class FakeReactor(Clock):
    def stop(self) -> None:
        pass

    def callWhenRunning(self, f: Any, *args: Any) -> None:
        pass


@implementer(INotifier)
class Recorded(NullNotifier):
    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, *lines: str) -> None:
        self.sent += lines


def make(**inputs: Any) -> tuple[LLMProxyService, FakeReactor, list[float], Recorded]:
    reactor = FakeReactor()
    reads: list[float] = []

    def fetch(host: HostConfig) -> Deferred[tuple[RosterEntry, ...]]:
        reads.append(reactor.seconds())
        return succeed((RosterEntry("m"),))

    notifier = Recorded()
    process = Process(environ={"WATCHDOG_USEC": "10000000"}, raise_open_files=lambda: None)
    config = parse_config({"listen": "127.0.0.1:0", "refresh_seconds": 30, "drain_seconds": 5,
                           "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}]})
    svc = build_service(ServiceInputs(config, reactor, http=FakeHTTPClient(), fetch=fetch,
                                      notifier=notifier, process=process, **inputs))
    svc.listener.start_accepting = lambda: None  # type: ignore[method-assign]
    return svc, reactor, reads, notifier


def stop(svc: LLMProxyService, reactor: FakeReactor) -> None:
    stopped = svc.stopService()
    for _ in range(200):
        if stopped.called:
            return
        reactor.advance(0.5)
    raise AssertionError("the stop did not end")


def test_children_start_with_the_root_and_begin_as_the_proxy_serves() -> None:
    """The listener child binds in the privileged start; every child runs once the
    root started; the watchdog pings from the start; the roster refresher's first
    read comes one period after start-up's own; after the stop no child runs and
    neither the refresher nor the watchdog fires again."""
    svc, reactor, reads, notifier = make()
    svc.privilegedStartService()
    assert svc.listener.address() is not None
    svc.startService()
    assert [c.name for c in svc if not c.running] == []
    assert svc.startup is not None and svc.startup.called and svc.ready
    assert notifier.sent.count("WATCHDOG=1") == 1 and "READY=1" in notifier.sent
    assert reads == [0]
    for _ in range(6):
        reactor.advance(5)
    assert reads == [0, 30] and notifier.sent.count("WATCHDOG=1") == 7
    stop(svc, reactor)
    assert [c.name for c in svc if c.running] == []
    assert svc.listener.address() is None
    before = (len(reads), notifier.sent.count("WATCHDOG=1"))
    for _ in range(24):
        reactor.advance(5)
    assert (len(reads), notifier.sent.count("WATCHDOG=1")) == before


def test_the_stop_chain_stops_the_fleet_with_readiness_and_the_listener_with_admission(
) -> None:
    """Readiness stops the fleet child (no switch or idle stop begins during the
    drain) while the host locks, the refresher and the watchdog run on; admission
    stops the listener; the chain's end stops the rest."""
    svc, reactor, _, _ = make()
    svc.privilegedStartService()
    svc.startService()
    running = lambda: [c.name for c in svc if c.running]  # noqa: E731
    svc.stop_readiness()
    assert running() == ["host-locks", "listener", "roster-refresher", "watchdog"]
    assert svc.stop_admission().called
    assert running() == ["host-locks", "roster-refresher", "watchdog"]
    stop(svc, reactor)
    assert running() == []


def test_a_stop_before_the_proxy_serves_never_begins_the_gated_children() -> None:
    """Stopped while start-up still reads the rosters, the refresher never reads
    and the fleet never starts its watches or idle stopper."""
    reactor = FakeReactor()
    pending: Deferred[tuple[RosterEntry, ...]] = Deferred()
    config = parse_config({"listen": "127.0.0.1:0", "refresh_seconds": 30,
                           "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}]})
    svc = build_service(ServiceInputs(config, reactor, http=FakeHTTPClient(),
                                      fetch=lambda host: pending,
                                      process=Process(raise_open_files=lambda: None)))
    started: list[bool] = []
    svc.fleet.start = lambda: started.append(True)  # type: ignore[method-assign]
    svc.privilegedStartService()
    svc.startService()
    stop(svc, reactor)
    reactor.advance(100)
    assert started == [] and not svc.ready


def test_the_upgrade_names_its_successor_once_the_hand_over_begins() -> None:
    """`successor_url` is None until the candidate is ready, then the URL the
    upgrade was started with; nothing outside the upgrade can set it."""
    svc, _, _, _ = make(launcher=Launcher(ReadyCandidates()))
    assert svc.upgrade.successor_url is None
    done = hand_over_to(svc.upgrade, "http://127.0.0.1:4711")
    assert done.called and svc.upgrade.successor_url == "http://127.0.0.1:4711"
    assert isinstance(Upgrade.successor_url, property) and Upgrade.successor_url.fset is None
