"""Waits on an injected clock: bounded, and never cancelling what they watch."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime


def within(clock: IReactorTime, d: Deferred[Any], seconds: float) -> Deferred[bool]:
    """True once `d` fires, False if `seconds` pass first. `d` is left alone:
    its result is passed on untouched and it is never cancelled."""
    result: Deferred[bool] = Deferred()

    def fired(value: object) -> object:
        if not result.called:
            timer.cancel()
            result.callback(True)
        return value

    def timed_out() -> None:
        if not result.called:
            result.callback(False)

    timer = clock.callLater(max(0.0, seconds), timed_out)
    d.addBoth(fired)
    return result


def sleep(clock: IReactorTime, seconds: float) -> Deferred[None]:
    """A Deferred that fires after `seconds` on `clock`."""
    d: Deferred[None] = Deferred()
    clock.callLater(max(0.0, seconds), d.callback, None)
    return d
