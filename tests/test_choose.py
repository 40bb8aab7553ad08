"""Choosing among a model's hosts (replicas), on a task.Clock with fake rosters:
cordoned hosts never, hosts that are down last, a running engine first, then
the least loaded, ties in turn; affinity keeps a session on its host while it
is up; a failed connection marks a host down for a while; every choice and
failover is an event."""

from __future__ import annotations

import tracemalloc
from typing import Any

from twisted.internet.task import Clock

from llmproxy.config import parse_config
from llmproxy.core.capacity import Failover, ReplicaChosen
from llmproxy.core.events import Event
from llmproxy.hosts.catalog import Catalog
from llmproxy.hosts.choose import (
    UNREACHABLE_SECONDS,
    Candidate,
    Chooser,
    rank,
    session_digest,
)
from llmproxy.hosts.host import Host
from llmproxy.hosts.roster import HostRoster, RosterEntry
from llmproxy.testing.agentfakes import FakeAgentTransport


def test_rank_never_chooses_a_cordoned_host_and_tries_down_hosts_last() -> None:
    """Cordoned: left out (all cordoned: nothing); down: after every host that is up."""
    assert rank([Candidate("a", True, cordoned=True), Candidate("b", False),
                 Candidate("c", True)]) == (["c", "b"], "only host up")
    assert rank([Candidate("a", True, cordoned=True)]) == ([], "cordoned")
    assert rank([Candidate("a", False), Candidate("b", False)]) == (["a", "b"],
                                                                    "no host is up")


def test_rank_prefers_a_running_engine_then_the_least_loaded() -> None:
    """A host whose engine runs beats a less loaded one that needs a switch; among
    equals in that, the lower load wins."""
    assert rank([Candidate("a", True, ready=False, load=0.0),
                 Candidate("b", True, ready=True, load=3.0)]) == (["b", "a"], "engine running")
    assert rank([Candidate("a", True, load=1.5), Candidate("b", True, load=0.5),
                 Candidate("c", True, load=1.0)]) == (["b", "c", "a"], "least loaded")


def test_rank_breaks_ties_in_turn() -> None:
    """Equal hosts: turn 0, 1, 2 start with a, b, c."""
    hosts = [Candidate(n, True) for n in "abc"]
    assert [rank(hosts, turn)[0][0] for turn in range(4)] == ["a", "b", "c", "a"]
    assert rank(hosts, 1) == (["b", "c", "a"], "round robin")


def test_rank_puts_the_sessions_host_first_while_it_is_up() -> None:
    """Affinity beats load and engine; a session whose host is down is placed anew."""
    hosts = [Candidate("a", True, load=0.0), Candidate("b", True, load=5.0)]
    assert rank(hosts, sticky="b") == (["b", "a"], "affinity")
    down = [Candidate("a", True), Candidate("b", False)]
    assert rank(down, sticky="b") == (["a", "b"], "only host up")


CONFIG: dict[str, Any] = {
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081", "max_concurrent": 2},
              {"name": "gpu2", "url": "http://10.0.0.6:8081", "max_concurrent": 2},
              {"name": "gpu3", "url": "http://10.0.0.7:8081", "ssh": "llm@gpu3",
               "engines": {"big": {"command": ["llama-server"]},
                           "small": {"command": ["llama-server"]}}}],
    "models": {"qwen": {"hosts": ["gpu1", "gpu2"], "affinity": "header:X-Session-Id"},
               "big": {"hosts": ["gpu1", "gpu3"], "engine": "big"}},
}


def setup() -> tuple[Chooser, dict[str, Host], Catalog, Clock, list[Event]]:
    clock = Clock()
    clock.advance(100)
    config = parse_config(CONFIG)
    events: list[Event] = []
    gates: dict[str, Host] = {
        h.name: Host(h, clock, transport=FakeAgentTransport()) if h.managed else Host(h, clock)
        for h in config.hosts}
    rosters = {h: HostRoster(1, (RosterEntry("qwen"), RosterEntry("big")), 50.0)
               for h in ("gpu1", "gpu2")}
    return (Chooser(gates, clock, events.append), gates, Catalog(config, rosters), clock,
            events)


def order(chooser: Chooser, catalog: Catalog, model: str, session: str | None = None
          ) -> list[str]:
    route = catalog.resolve(model)
    assert route is not None
    return [g.host.name for g in chooser.choose(route, catalog, session, "r1")]


def test_requests_spread_over_equal_hosts_and_follow_the_load() -> None:
    """Two idle hosts take turns; a busier host goes second; the choice is an event."""
    chooser, gates, catalog, _, events = setup()
    assert [order(chooser, catalog, "qwen")[0] for _ in range(4)] == ["gpu1", "gpu2"] * 2
    gates["gpu1"].acquire()
    assert order(chooser, catalog, "qwen") == ["gpu2", "gpu1"]
    last = events[-1]
    assert isinstance(last, ReplicaChosen)
    assert (last.request_id, last.model, last.host, last.order, last.reason) == (
        "r1", "qwen", "gpu2", ("gpu2", "gpu1"), "least loaded")


def test_a_managed_host_whose_engine_runs_comes_first() -> None:
    """`big` on gpu1 (unmanaged: always ready) and gpu3 (managed, running small):
    gpu1 first; once gpu3 runs big and gpu1 is busier, gpu3 first."""
    chooser, gates, catalog, _, _ = setup()
    gates["gpu3"].controller.assume("small")
    gates["gpu1"].acquire()
    assert order(chooser, catalog, "big") == ["gpu1", "gpu3"]
    gates["gpu3"].controller.assume("big")
    assert order(chooser, catalog, "big") == ["gpu3", "gpu1"]


def test_a_host_whose_roster_failed_or_that_refused_a_connection_is_tried_last() -> None:
    """A failed roster read: down. A failover marks a host down for
    UNREACHABLE_SECONDS (or until a newer good roster read), published as an event."""
    chooser, gates, catalog, clock, events = setup()
    failing = dict(catalog.rosters)
    failing["gpu1"] = HostRoster(1, (RosterEntry("qwen"),), 50.0, "refused", 60.0)
    broken = Catalog(catalog.config, failing)
    assert [order(chooser, broken, "qwen") for _ in range(2)] == [["gpu2", "gpu1"]] * 2
    route = catalog.resolve("qwen")
    assert route is not None
    chooser.unreachable(gates["gpu2"], route, gates["gpu1"], "Connection refused", "r7")
    assert isinstance(events[-1], Failover) and events[-1].line()[1] == (
        "r7 for qwen: gpu2 unreachable (Connection refused), nothing was sent: trying gpu1")
    assert [order(chooser, catalog, "qwen") for _ in range(2)] == [["gpu1", "gpu2"]] * 2
    clock.advance(UNREACHABLE_SECONDS)
    assert {order(chooser, catalog, "qwen")[0] for _ in range(2)} == {"gpu1", "gpu2"}
    chooser.unreachable(gates["gpu2"], route, gates["gpu1"], "Connection refused")
    fresh = dict(catalog.rosters)
    fresh["gpu2"] = HostRoster(2, (RosterEntry("qwen"),), clock.seconds() + 1)
    clock.advance(1)
    assert {order(chooser, Catalog(catalog.config, fresh), "qwen")[0]
            for _ in range(2)} == {"gpu1", "gpu2"}


def test_affinity_keeps_a_session_on_its_host_while_it_is_usable() -> None:
    """A session served by gpu2 goes there again though gpu2 is busier; cordoned,
    it moves, and then stays where it went."""
    chooser, gates, catalog, _, events = setup()
    route = catalog.resolve("qwen")
    assert route is not None
    chooser.served(route, "s1", "gpu2")
    gates["gpu2"].acquire()
    assert order(chooser, catalog, "qwen", "s1")[0] == "gpu2"
    assert isinstance(events[-1], ReplicaChosen) and events[-1].reason == "affinity"
    gates["gpu2"].cordon(True)
    assert order(chooser, catalog, "qwen", "s1") == ["gpu1"]
    chooser.served(route, "s1", "gpu1")
    gates["gpu2"].cordon(False)
    assert order(chooser, catalog, "qwen", "s1")[0] == "gpu1"


def test_sessions_are_bounded() -> None:
    """The oldest session is forgotten once max_sessions are remembered."""
    _, gates, catalog, clock, _ = setup()
    chooser = Chooser(gates, clock, lambda e: None, max_sessions=2)
    route = catalog.resolve("qwen")
    assert route is not None
    for session in ("s1", "s2", "s3"):
        chooser.served(route, session, "gpu2")
    gates["gpu2"].acquire()
    assert order(chooser, catalog, "qwen", "s1")[0] == "gpu1"     # forgotten: least loaded
    assert order(chooser, catalog, "qwen", "s3")[0] == "gpu2"


def test_a_session_costs_the_table_a_digest_not_its_key() -> None:
    """A `body:user` value of 900 KB is remembered as a 16-byte digest: 200
    distinct such sessions grow the table by well under one of them, and each
    still finds its host."""
    chooser, gates, catalog, _, _ = setup()
    route = catalog.resolve("qwen")
    assert route is not None
    value = "u" * 900_000
    chooser.served(route, value + "warm", "gpu1")       # the table's first growth aside
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for n in range(200):
            chooser.served(route, f"{n:03d}" + value, "gpu2")
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    gates["gpu2"].acquire()                  # busier: only the session takes it there
    assert after - before < 200_000          # 200 keys held whole would be 180 MB
    assert order(chooser, catalog, "qwen", "007" + value)[0] == "gpu2"
    assert session_digest("a" * 10) != session_digest("a" * 11)
    assert len(session_digest(value)) == 16


def test_a_single_host_model_is_not_a_choice() -> None:
    """One host: it, unless cordoned; no event."""
    chooser, gates, catalog, _, events = setup()
    pinned = catalog.resolve("gpu2/qwen")
    assert pinned is not None and [h.name for h in pinned.hosts] == ["gpu2"]
    assert [g.host.name for g in chooser.choose(pinned, catalog)] == ["gpu2"]
    gates["gpu2"].cordon(True)
    assert chooser.choose(pinned, catalog) == [] and events == []
