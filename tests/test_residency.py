"""The eviction rule of a host with a memory budget (hosts/residency.py), as
pure functions: what fits, which idle engines go first (least recently used),
and what never goes (busy, wanted, protected, resident, already stopping)."""

from __future__ import annotations

from llmproxy.hosts.residency import Plan, Resident, plan_start, used_gb


def r(engine: str, gb: float, last_used: float = 0.0, **kw: object) -> Resident:
    return Resident(engine, gb, last_used, **kw)  # type: ignore[arg-type]


def test_an_engine_that_fits_starts_beside_the_others() -> None:
    """40 + 4 GB run on an 80 GB host: a 30 GB engine starts, nothing stops."""
    assert plan_start(30, 80, [r("chat", 40), r("embed", 4)], now=100) == Plan(True)


def test_idle_engines_go_least_recently_used_first_and_only_as_many_as_needed() -> None:
    """70 GB on a host holding 40 (used at 50) + 4 (used at 10) + 20 (used at 30):
    the embed (LRU) and then the 20 GB one go; chat stays, there is room then."""
    residents = [r("chat", 40, 50), r("embed", 4, 10), r("rerank", 20, 30)]
    assert plan_start(36, 80, residents, now=100) == Plan(True, ("embed", "rerank"))
    assert plan_start(20, 80, residents, now=100) == Plan(True, ("embed",))


def test_a_busy_or_wanted_engine_is_never_evicted_and_the_start_waits() -> None:
    """A request in flight or one queued for it keeps an engine: when the idle ones
    are not enough, nothing is stopped and the plan names what it waits for."""
    residents = [r("chat", 40, 0, in_flight=1), r("embed", 4, 0), r("code", 30, 0, queued=2)]
    plan = plan_start(70, 80, residents, now=100)
    assert plan == Plan(False, busy=("chat", "code"),
                        reason="waiting for chat, code to fall idle")
    assert plan_start(10, 80, residents, now=100) == Plan(True, ("embed",))


def test_residency_and_protection_keep_an_engine() -> None:
    """An engine within `min_engine_seconds` of its start, or protected during an
    upgrade, is not evictable; once residency is over it is."""
    residents = [r("chat", 60, 0, resident_until=120.0), r("old", 20, 0, protected=True)]
    assert not plan_start(60, 80, residents, now=100).ready
    assert plan_start(60, 80, residents, now=120) == Plan(True, ("chat",))


def test_an_engine_being_stopped_holds_its_memory_until_it_is_gone() -> None:
    """A stop under way frees nothing yet: the start waits for it, and it is not
    stopped twice."""
    residents = [r("chat", 60, 0, stopping=True)]
    assert plan_start(40, 80, residents, now=5) == Plan(
        False, reason="waiting for a stop to finish")
    assert used_gb(residents) == 60


def test_an_engine_larger_than_the_budget_never_starts() -> None:
    assert plan_start(90, 80, [], now=0) == Plan(
        False, reason="needs 90 GB, the host's budget is 80 GB")
