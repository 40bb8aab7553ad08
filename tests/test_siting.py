"""Where an engine that runs nowhere is started (hosts/siting.py): the rule on
its own, and through the Chooser on hosts with memory budgets (task.Clock, a
fake agent): resident first, then room without evicting (most headroom), then
the cheapest eviction, never a host that may not take it; each choice reserves
its room so two placements never share the last of it."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from twisted.internet.task import Clock

from llmproxy.cli import main
from llmproxy.config import ConfigError, parse_config
from llmproxy.core.capacity import EnginePlaced
from llmproxy.core.events import Event
from llmproxy.hosts.catalog import Catalog
from llmproxy.hosts.choose import Chooser
from llmproxy.hosts.host import Host
from llmproxy.hosts.siting import Site, place
from llmproxy.testing.agentfakes import FakeAgentTransport
from llmproxy.testing.fakes import Acquire


def test_a_resident_engine_wins_over_more_room() -> None:
    """The host where the engine runs is first, though another has more room."""
    placed = place([Site("a", free_gb=30, need_gb=8), Site("b", resident=True, free_gb=1)])
    assert (placed.order, placed.why) == (("b", "a"), "engine resident")


def test_a_fit_without_evicting_goes_by_most_headroom() -> None:
    """Of the hosts where it fits, the one with the most free memory first; one
    that would need an eviction after them."""
    placed = place([Site("a", free_gb=10, need_gb=8), Site("b", free_gb=20, need_gb=8),
                    Site("c", free_gb=2, need_gb=8, evict=("x",))])
    assert placed.order == ("b", "a", "c")
    assert placed.why == "fits without evicting: 20 GB free"
    assert placed.headroom == (("a", 10), ("b", 20), ("c", 2))


def test_the_cheapest_eviction_is_fewest_engines_least_recently_used() -> None:
    """No host fits: the one that stops fewest idle engines, then the one whose
    engines were used longest ago; a host that cannot make room (busy) last."""
    placed = place([Site("busy", free_gb=4, need_gb=8),
                    Site("two", free_gb=0, need_gb=8, evict=("x", "y"), evict_last_used=1),
                    Site("recent", free_gb=0, need_gb=8, evict=("z",), evict_last_used=50),
                    Site("old", free_gb=0, need_gb=8, evict=("w",), evict_last_used=10)])
    assert placed.order == ("old", "recent", "two", "busy")
    assert placed.why == "least eviction: stops w"


def test_a_host_where_requests_wait_for_it_comes_before_an_eviction() -> None:
    """A host whose queue already holds requests for the engine (its start is due
    there) is chosen over an eviction elsewhere and over waiting for room, most
    waiters first; a host where it fits without evicting still comes first."""
    placed = place([Site("evict", free_gb=0, need_gb=8, evict=("x",)),
                    Site("one", free_gb=0, need_gb=8, waiting=1),
                    Site("three", free_gb=0, need_gb=8, waiting=3),
                    Site("full", free_gb=4, need_gb=8)])
    assert placed.order == ("three", "one", "evict", "full")
    assert placed.why == "its start is due there: 3 request(s) wait for it"
    placed = place([Site("three", free_gb=0, need_gb=8, waiting=3),
                    Site("room", free_gb=10, need_gb=8)])
    assert (placed.order, placed.why) == (("room", "three"), "fits without evicting: 10 GB free")


def test_a_host_that_may_not_take_it_is_never_first() -> None:
    """Cordoned, held, failed or unreachable hosts (unusable) come after every
    usable one, even with all the room; with none usable, the order says so."""
    placed = place([Site("down", usable=False, free_gb=80, need_gb=8, resident=True),
                    Site("full", free_gb=0, need_gb=8)])
    assert placed.order == ("full", "down")
    assert placed.why == "no room on any host: waits for engines to fall idle"
    assert place([Site("down", usable=False)]).why == "no host may take it"


CONFIG = {
    "hosts": [
        {"name": name, "url": f"http://127.0.0.1:{port}", "ssh": name, "memory_gb": 24,
         "min_engine_seconds": 0,
         "engines": {
             "big": {"command": ["e"], "memory_gb": 16, "url": f"http://127.0.0.1:{port + 1}"},
             "big2": {"command": ["e"], "memory_gb": 16, "url": f"http://127.0.0.1:{port + 2}"},
             "small": {"command": ["e"], "memory_gb": 12, "url": f"http://127.0.0.1:{port + 3}"},
         }}
        for name, port in (("gpu1", 9100), ("gpu2", 9200))
    ],
    "models": {
        "big": {"hosts": ["gpu1", "gpu2"], "engine": "big"},
        "big2": {"hosts": ["gpu1", "gpu2"], "engine": "big2"},
        "small1": {"host": "gpu1", "engine": "small"},
    },
}


TRANSPORTS: dict[str, FakeAgentTransport] = {}   # each host's fake agent, set by setup()


def setup() -> tuple[Chooser, dict[str, Host], Catalog, Clock, list[Event]]:
    clock = Clock()
    clock.advance(100)
    config = parse_config(CONFIG)
    events: list[Event] = []
    TRANSPORTS.clear()
    TRANSPORTS.update({h.name: FakeAgentTransport() for h in config.hosts})
    gates = {h.name: Host(h, clock, transport=TRANSPORTS[h.name]) for h in config.hosts}
    return Chooser(gates, clock, events.append), gates, Catalog(config, {}), clock, events


def resident(gate: Host, engine: str, busy: bool) -> None:
    """`engine` started on `gate` through a request, kept in flight when `busy`."""
    a = Acquire(gate, engine)
    transport = TRANSPORTS[gate.host.name]
    assert transport.last().order["engine"] == engine
    transport.last().answer({"ok": True, "pid": 9, "healthy": True, "stopped": [],
                             "engine": engine})
    assert gate.runs(engine)
    if not busy:
        a.lease.release()


def choose(chooser: Chooser, catalog: Catalog, model: str) -> list[str]:
    route = catalog.resolve(model)
    assert route is not None
    return [g.host.name for g in chooser.choose(route, catalog, None, "r1")]


def placed(events: list[Event]) -> EnginePlaced:
    last = [e for e in events if isinstance(e, EnginePlaced)][-1]
    return last


def test_the_engine_goes_where_it_fits_and_the_reason_is_published() -> None:
    """gpu1 holds a busy 12 GB engine, gpu2 nothing: `big` (16 GB) goes to gpu2,
    and engine.placed says why with both hosts' headroom."""
    chooser, gates, catalog, _, events = setup()
    resident(gates["gpu1"], "small", busy=True)
    assert choose(chooser, catalog, "big") == ["gpu2", "gpu1"]
    event = placed(events)
    assert (event.host, event.engine, event.why, event.headroom) == (
        "gpu2", "big", "fits without evicting: 24 GB free", (("gpu1", 12), ("gpu2", 24)))
    assert event.fields()["type"] == "engine.placed"


def test_a_host_full_of_busy_engines_is_never_chosen_over_one_with_room() -> None:
    """Both hosts hold `small`; gpu1's is busy, gpu2's idle: gpu2 (an eviction)
    is chosen, never gpu1, whichever host is listed first."""
    chooser, gates, catalog, clock, events = setup()
    resident(gates["gpu1"], "small", busy=True)
    resident(gates["gpu2"], "small", busy=False)
    clock.advance(5)
    assert choose(chooser, catalog, "big")[0] == "gpu2"
    assert placed(events).why == "least eviction: stops small"


def test_two_placements_never_share_the_last_room() -> None:
    """`big` is placed on empty gpu1 (room reserved); a second request for `big`
    follows it there (no second copy); `big2`, racing for gpu1's last 8 GB, does
    not get it (it waits on gpu2, and its next request follows it there); once
    big's start fails on gpu1, the room there is free again."""
    chooser, gates, catalog, _, events = setup()
    resident(gates["gpu2"], "small", busy=True)
    assert choose(chooser, catalog, "big")[0] == "gpu1"
    assert choose(chooser, catalog, "big")[0] == "gpu1"
    assert placed(events).why == "engine resident"
    assert choose(chooser, catalog, "big2")[0] == "gpu2"
    assert dict(placed(events).headroom) == {"gpu1": 8, "gpu2": 12}
    route = catalog.resolve("big")
    assert route is not None
    route2 = catalog.resolve("big2")
    assert route2 is not None
    assert choose(chooser, catalog, "big2")[0] == "gpu2"     # it follows its reservation
    chooser.start_failed(gates["gpu1"], route)
    chooser.start_failed(gates["gpu2"], route2)
    assert choose(chooser, catalog, "big2")[0] == "gpu1"
    assert dict(placed(events).headroom)["gpu1"] == 24


def test_held_cordoned_and_failed_hosts_are_never_chosen() -> None:
    """gpu1 has the room but is held by another proxy, then cordoned: gpu2 (busy,
    no room) is chosen over it, or gpu1 is left out."""
    chooser, gates, catalog, _, events = setup()
    resident(gates["gpu2"], "small", busy=True)
    gates["gpu1"].hold("proxy-b")
    assert choose(chooser, catalog, "big") == ["gpu2", "gpu1"]
    gates["gpu1"].hold(None)
    gates["gpu1"].cordon()
    assert choose(chooser, catalog, "big") == ["gpu2"]
    assert placed(events).host == "gpu2"


def test_an_unreachable_host_is_skipped_and_its_room_released() -> None:
    """A placement on gpu1 whose host dies (nothing sent): the failover marks it
    unreachable and frees its reservation; the next placement goes to gpu2."""
    chooser, gates, catalog, _, events = setup()
    route = catalog.resolve("big")
    assert route is not None
    assert choose(chooser, catalog, "big")[0] == "gpu1"
    chooser.unreachable(gates["gpu1"], route, gates["gpu2"], "connection refused")
    assert not chooser.reservations.held("gpu1", "big")
    assert choose(chooser, catalog, "big") == ["gpu2", "gpu1"]
    assert placed(events).host == "gpu2"


def test_inconsistent_overrides_and_an_engine_too_large_are_config_errors(
        tmp_path: Any, capsys: Any) -> None:
    """A model's engine whose hosts check its health on different paths, and an
    engine larger than a host's budget: errors naming the field; `llmproxy
    check` exits 78 (EX_CONFIG)."""
    bad = copy.deepcopy(CONFIG)
    bad["hosts"][1]["engines"]["big"]["health"] = "/v1/models"
    bad["hosts"][0]["engines"]["big2"]["memory_gb"] = 30
    with pytest.raises(ConfigError) as info:
        parse_config(bad)
    assert sorted(info.value.errors) == [
        "hosts[0].engines.big2.memory_gb: 30 is more than the host's memory_gb (24)",
        "models.big.engine: engine 'big' checks health at '/health' on 'gpu1' but "
        "'/v1/models' on 'gpu2': per-host overrides of one engine must agree on health"]
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(bad))
    assert main(["check", "-c", str(path)]) == 78
    assert "models.big.engine" in capsys.readouterr().err


def test_a_placement_whose_request_left_unserved_frees_its_room() -> None:
    """Both hosts hold a busy `small`, and gpu1's queue waits first for big2: `big` is
    placed on gpu1 (room reserved there, the host not counting it: big2 is its next
    start). Its client leaves the queue: while another request for `big` still waits
    there the room stays reserved; once none does, it is free at once (not after
    RESERVE_SECONDS)."""
    chooser, gates, catalog, _, events = setup()
    resident(gates["gpu1"], "small", busy=True)
    resident(gates["gpu2"], "small", busy=True)
    first = Acquire(gates["gpu1"], "big2", "b2")
    assert first.waiting and gates["gpu1"].switching_to == "big2"
    route = catalog.resolve("big")
    assert route is not None
    assert choose(chooser, catalog, "big")[0] == "gpu1"
    assert placed(events).why == "no room on any host: waits for engines to fall idle"
    waits = [gates["gpu1"].acquire("big", f"r{i}") for i in range(2)]
    waits[0].cancel()
    chooser.left(gates["gpu1"], route)
    assert chooser.reservations.held("gpu1", "big")        # r1 still waits for it there
    waits[1].cancel()
    chooser.left(gates["gpu1"], route)
    assert not chooser.reservations.held("gpu1", "big")


def test_requests_queued_for_an_engine_draw_the_next_one_to_their_host() -> None:
    """gpu1 runs a busy `small` and its queue starts big2 next, with two requests
    for `big` behind it; gpu2's `small` is idle (an eviction would make room).
    The next request for `big` joins those on gpu1, where big's start is due, and
    does not load a second copy on gpu2."""
    chooser, gates, catalog, clock, events = setup()
    resident(gates["gpu1"], "small", busy=True)
    resident(gates["gpu2"], "small", busy=False)
    clock.advance(5)
    assert choose(chooser, catalog, "big")[0] == "gpu2"       # nothing waits for it yet
    assert placed(events).why == "least eviction: stops small"
    route = catalog.resolve("big")
    assert route is not None
    chooser.start_failed(gates["gpu2"], route)                # (that placement let go)
    assert Acquire(gates["gpu1"], "big2", "b2").waiting
    waits = [Acquire(gates["gpu1"], "big", f"r{i}") for i in range(2)]
    assert all(w.waiting for w in waits) and gates["gpu1"].switching_to == "big2"
    assert choose(chooser, catalog, "big") == ["gpu1", "gpu2"]
    event = placed(events)
    assert (event.host, event.why) == ("gpu1", "its start is due there: 2 request(s) wait for it")
