"""Many deadlines on one timed call (core/deadlines.py), on task.Clock: each
expires at its own time unless removed first, one timed call at a time, none
left once nothing waits."""

from __future__ import annotations

from twisted.internet.task import Clock

from llmproxy.core.deadlines import Deadlines


def test_each_deadline_expires_at_its_own_time_on_one_timed_call() -> None:
    clock = Clock()
    deadlines = Deadlines(clock)
    expired: list[str] = []
    deadlines.add("a", 10, lambda: expired.append("a"))
    clock.advance(3)
    deadlines.add("b", 10, lambda: expired.append("b"))
    clock.advance(3)
    deadlines.add("c", 10, lambda: expired.append("c"))
    assert len(clock.getDelayedCalls()) == 1
    clock.advance(4 - 0.001)
    assert expired == []
    clock.advance(0.001)                       # t = 10
    assert expired == ["a"] and len(deadlines) == 2
    clock.advance(3)                           # t = 13
    assert expired == ["a", "b"]
    clock.advance(3)                           # t = 16
    assert expired == ["a", "b", "c"] and len(deadlines) == 0
    assert clock.getDelayedCalls() == []


def test_a_removed_deadline_never_expires_and_nothing_is_left_behind() -> None:
    clock = Clock()
    deadlines = Deadlines(clock)
    expired: list[str] = []
    for key in "abc":
        deadlines.add(key, 5, lambda key=key: expired.append(key))
        deadlines.remove(key)
    deadlines.remove("never added")
    clock.advance(5)
    assert expired == [] and clock.getDelayedCalls() == []


def test_a_sooner_deadline_moves_the_timed_call() -> None:
    """A shorter timeout after a longer one (a reload changed it): on time."""
    clock = Clock()
    deadlines = Deadlines(clock)
    expired: list[tuple[str, float]] = []
    deadlines.add("long", 600, lambda: expired.append(("long", clock.seconds())))
    clock.advance(1)
    deadlines.add("short", 5, lambda: expired.append(("short", clock.seconds())))
    assert [c.getTime() for c in clock.getDelayedCalls()] == [6]
    clock.advance(5)
    assert expired == [("short", 6)]
    assert [c.getTime() for c in clock.getDelayedCalls()] == [600]
    clock.advance(594)
    assert expired == [("short", 6), ("long", 600)]


def test_an_expiry_may_add_and_remove_deadlines() -> None:
    """What an expiry does to the others is seen: a deadline it removes does
    not expire, one it adds expires at its time."""
    clock = Clock()
    deadlines = Deadlines(clock)
    expired: list[str] = []

    def first() -> None:
        expired.append("first")
        deadlines.remove("second")             # due in the same run
        deadlines.add("third", 2, lambda: expired.append("third"))

    deadlines.add("first", 1, first)
    deadlines.add("second", 1, lambda: expired.append("second"))
    deadlines.add("fourth", 5, lambda: expired.append("fourth"))
    clock.advance(1)
    assert expired == ["first"]
    assert [c.getTime() for c in clock.getDelayedCalls()] == [3]
    clock.advance(2)
    assert expired == ["first", "third"]
    clock.advance(2)
    assert expired == ["first", "third", "fourth"] and clock.getDelayedCalls() == []


def test_stop_drops_every_deadline() -> None:
    clock = Clock()
    deadlines = Deadlines(clock)
    expired: list[str] = []
    deadlines.add("a", 1, lambda: expired.append("a"))
    deadlines.stop()
    clock.advance(2)
    assert expired == [] and clock.getDelayedCalls() == [] and len(deadlines) == 0
