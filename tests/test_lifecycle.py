"""Signal routing and the hard deadline, with fakes (no real signals, no waits)."""

from __future__ import annotations

import signal
from typing import Any

from llmproxy.lifecycle.signals import EXIT_OVERRAN, HardDeadline, install_stop_signals


class FakeReactor:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def callFromThread(self, f: Any, *args: Any) -> None:
        self.calls.append((f, args))


def test_stop_signals_are_routed_to_the_reactor_thread() -> None:
    """SIGTERM and SIGINT handlers only hand the signal number to the reactor thread."""
    reactor = FakeReactor()
    handlers: dict[int, Any] = {}
    seen: list[int] = []
    install_stop_signals(reactor, seen.append, handlers.__setitem__)
    assert set(handlers) == {signal.SIGTERM, signal.SIGINT}
    handlers[signal.SIGTERM](signal.SIGTERM, None)
    assert seen == []                                    # nothing ran in the handler itself
    assert reactor.calls == [(seen.append, (signal.SIGTERM,))]


def test_hard_deadline_exits_with_124_and_arms_once() -> None:
    """The last-resort timer exits with 124 when it fires; arming twice keeps
    the first timer; disarm cancels it."""
    exits: list[int] = []
    deadline = HardDeadline(exits.append)
    deadline.arm(3600)
    first = deadline._timer
    deadline.arm(1)
    assert deadline._timer is first
    deadline.disarm()
    assert first is not None and first.finished.is_set()
    deadline._fire(3600)
    assert exits == [EXIT_OVERRAN]
