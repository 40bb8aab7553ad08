"""Waits on an injected clock: bounded, and never cancelling what they watch;
and values that change once a second, made once a second."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

T = TypeVar("T")


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


class PerSecond(Generic[T]):
    """`make(second)` for the whole second of a time, made once per second (a
    timestamp to the second, for every line or response in that second)."""

    def __init__(self, make: Callable[[int], T]) -> None:
        self._make = make
        self._second: int | None = None
        self._value: T

    def __call__(self, when: float) -> T:
        second = int(when // 1)
        if second != self._second:
            self._second, self._value = second, self._make(second)
        return self._value
