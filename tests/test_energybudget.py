"""Per-key energy budgets (web/energybudget.py) on a clock: a key is refused once its
requests' measured energy today reaches its `wh_per_day`, until the next UTC midnight."""

from __future__ import annotations

import hashlib

import pytest
from twisted.internet.task import Clock

from llmproxy.config.keys import ApiKey, parse_keys
from llmproxy.config.values import ConfigError
from llmproxy.core.capacity import RateLimited
from llmproxy.core.events import Event, RequestEnded
from llmproxy.web.energybudget import DAY, EnergyBudgets

DIGEST = hashlib.sha256(b"s").digest()


def ended(joules: float | None, key: str | None = "alice", rid: str = "r") -> RequestEnded:
    return RequestEnded(0.0, request_id=rid, method="POST", path="/v1/chat/completions",
                        client="127.0.0.1", model="m", host="h", engine="e", status=200,
                        bytes=1, duration=1.0, outcome="completed", key=key,
                        energy_joules=joules)


def test_a_budget_refuses_once_spent_and_renews_at_utc_midnight() -> None:
    """wh_per_day 0.1 (360 J): admitted at 0 J and at 200 J; the request that takes it to
    400 J ran, the next is refused with the seconds to midnight (and a ratelimit.refuse
    event of limit energy); the next day it is admitted again. Other keys, requests without
    a measured energy and keys without a budget are never refused."""
    clock = Clock()
    clock.advance(3 * DAY + 20 * 3600)              # 20:00 UTC
    said: list[Event] = []
    budgets = EnergyBudgets(clock, said.append)
    alice = ApiKey("alice", DIGEST, wh_per_day=0.1)
    assert budgets.refuse(alice, "r1") is None
    budgets(ended(200.0))
    budgets(ended(None))
    budgets(ended(999.0, key="bob"))
    assert budgets.refuse(alice, "r2") is None
    budgets(ended(200.0))
    assert budgets.refuse(alice, "r3") == 4 * 3600
    assert said == [RateLimited(clock.seconds(), "alice", "r3", "energy", 4 * 3600.0)]
    assert said[0].line() == ("warn", "key alice is over its wh_per_day: refused r3 with 429 "
                                      "(retry in 14400.0s)")
    assert budgets.snapshot(alice) == {"wh_per_day": 0.1, "remaining_wh": 0.0,
                                       "used_wh": pytest.approx(0.1111, abs=1e-4)}
    assert budgets.refuse(ApiKey("bob", DIGEST), "r4") is None
    assert budgets.snapshot(ApiKey("bob", DIGEST)) is None
    clock.advance(4 * 3600)
    assert budgets.refuse(alice, "r5") is None
    assert budgets.snapshot(alice) == {"wh_per_day": 0.1, "used_wh": 0.0, "remaining_wh": 0.1}


def test_the_keys_file_takes_wh_per_day_and_names_a_bad_one() -> None:
    """A positive number of watt-hours; anything else names the field."""
    ring = parse_keys({"keys": [{"name": "a", "sha256": "0" * 64, "wh_per_day": 50},
                                {"name": "b", "sha256": "1" * 64, "wh_per_day": 0.5}]}, "k")
    assert [k.wh_per_day for k in ring.keys] == [50.0, 0.5]
    for bad in (0, -1, "5", True, None, 1e13):
        with pytest.raises(ConfigError) as e:
            parse_keys({"keys": [{"name": "a", "sha256": "0" * 64, "wh_per_day": bad}]}, "k")
        assert "k: keys[0].wh_per_day: must be a number above 0" in str(e.value)


def test_an_upgrade_hands_todays_energy_to_the_successor() -> None:
    """forward_to sends today's joules per key, then each request the old process still
    finishes; the successor's take adds them, so a spent budget stays spent. A line of
    another day or of another make adds nothing."""
    clock = Clock()
    clock.advance(5 * DAY + 3600)
    old, new = EnergyBudgets(clock, lambda e: None), EnergyBudgets(clock, lambda e: None)
    alice = ApiKey("alice", DIGEST, wh_per_day=0.1)
    old(ended(300.0))
    lines: list[bytes] = []
    old.forward_to(lines.append)
    old(ended(100.0, rid="late"))
    assert [line.split(b" ", 1)[0] for line in lines] == [b"energybudget"] * 2
    for line in lines:
        new.take(line.split(b" ", 1)[1])
    assert new.refuse(alice) is not None
    for junk in (b"not json", b'{"day": 4, "keys": {"bob": 1e9}}', b'{"day": 5}',
                 b'{"day": 5, "keys": {"bob": "many"}}', b'{"day": 5, "keys": {"bob": NaN}}'):
        new.take(junk)
    assert new.snapshot(ApiKey("bob", DIGEST, wh_per_day=1.0)) == {
        "wh_per_day": 1.0, "used_wh": 0.0, "remaining_wh": 1.0}
