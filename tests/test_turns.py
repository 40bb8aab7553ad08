"""New requests' set-ups take turns with the running streams (web/turns.py): at
most a slice of them per turn of the loop once it is busy, the rest in later
turns in their order of arrival, a lone one at once."""

from __future__ import annotations

from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock

from llmproxy.web.turns import Turns


def work(clock: Clock, seconds: float) -> None:
    """Set-up work that takes `seconds` of this turn (time passes, no turn ends)."""
    clock.rightNow += seconds


def next_turn(clock: Clock) -> None:
    """One turn of a reactor's loop: the calls due when it begins, not those they
    make (task.Clock.advance would run those too, in the same turn)."""
    due = [c for c in clock.getDelayedCalls() if c.getTime() <= clock.seconds()]
    for call in due:
        func, args, kw = call.func, call.args, call.kw
        call.cancel()
        func(*args, **kw)


def test_a_lone_set_up_runs_at_once_and_every_turn_starts_a_fresh_slice() -> None:
    clock = Clock()
    turns = Turns(clock, 0.002)
    assert turns.take().called
    work(clock, 0.003)          # a long one: it used more than the slice
    next_turn(clock)            # the next turn of the loop
    assert turns.take().called and turns.waiting == 0
    next_turn(clock)
    assert clock.getDelayedCalls() == []     # an idle loop keeps no timer


def test_set_ups_past_the_slice_wait_for_the_next_turns_in_order() -> None:
    """Two set-ups run in this turn (2.5 ms with the second); the next three wait. The
    next turn runs the first of them (3 ms: past the slice), the one after that the
    last two (1 ms each: the slice), and one more arriving in that turn waits for
    the next; after an idle turn one runs at once again."""
    clock = Clock()
    turns = Turns(clock, 0.002)
    ran: list[str] = []

    def set_up(name: str, seconds: float) -> None:
        d = turns.take()
        d.addCallback(lambda _: (ran.append(name), work(clock, seconds)))

    set_up("a", 0.001)
    set_up("b", 0.0015)
    assert ran == ["a", "b"]
    set_up("c", 0.003)
    set_up("d", 0.001)
    set_up("e", 0.001)
    assert ran == ["a", "b"] and turns.waiting == 3
    next_turn(clock)
    assert ran == ["a", "b", "c"] and turns.waiting == 2
    next_turn(clock)
    assert ran == ["a", "b", "c", "d", "e"] and turns.waiting == 0
    set_up("f", 0.001)          # this turn's slice is used: the next one
    assert ran[-1] == "e"
    next_turn(clock)
    next_turn(clock)            # an idle turn
    set_up("g", 0.001)          # a turn with room: it runs at once
    assert ran[-2:] == ["f", "g"]


def test_waiting_set_ups_run_in_their_order_of_arrival() -> None:
    clock = Clock()
    turns = Turns(clock, 0.002)
    assert turns.take().called
    work(clock, 0.0025)
    order: list[int] = []
    for i in range(3):
        turns.take().addCallback(lambda _, i=i: order.append(i))
    assert order == []
    next_turn(clock)
    assert order == [0, 1, 2]


def test_a_cancelled_wait_leaves_the_line() -> None:
    """A set-up whose client left while it waited is cancelled: it never runs, and the
    one behind it moves up."""
    clock = Clock()
    turns = Turns(clock, 0.002)
    turns.take()
    work(clock, 0.003)
    gone, next_one = turns.take(), turns.take()
    errors: list[type[BaseException]] = []
    gone.addErrback(lambda f: errors.append(f.type))
    gone.cancel()
    assert errors == [CancelledError] and turns.waiting == 1
    next_turn(clock)
    assert next_one.called and turns.waiting == 0
