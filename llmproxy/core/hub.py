"""The event hub: publish once where a fact is known; every view subscribes.

Modelled on `twisted.logger.LogPublisher`: delivery is synchronous, in the
publisher's reactor turn, to each subscriber in turn. A subscriber that raises
is logged and kept: it never breaks the code that published (a request, a
stop), never keeps the others from their event, and still gets the next one
(one bad event must not turn off a view for good: the rate limits, the
metrics). A subscriber must not block; what it needs to do later, it
schedules itself.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.logger import Logger, LogLevel

from llmproxy.core.events import Event

Subscriber = Callable[[Event], None]
Publish = Callable[[Event], None]


class Hub:
    """Publishes events to subscribers, synchronously and isolated from each other."""

    log = Logger()

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    @classmethod
    def logging(cls) -> Hub:
        """A hub whose first subscriber writes each event's log line."""
        hub = cls()
        hub.subscribe(log_line)
        return hub

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Deliver every event from now on to `subscriber`; returns its unsubscribe."""
        self._subscribers.append(subscriber)
        return lambda: self.unsubscribe(subscriber)

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """Deliver nothing more to `subscriber` (nothing happens if it is gone)."""
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)

    def publish(self, event: Event) -> None:
        """Deliver `event` to every subscriber now; one that raises is logged and
        keeps its subscription."""
        for subscriber in list(self._subscribers):
            try:
                subscriber(event)
            except Exception:
                self.log.failure("event subscriber {subscriber!r} raised on {type}: kept",
                                 subscriber=subscriber, type=event.type)


_loggers: dict[str, Logger] = {}
_LEVELS = {"info": LogLevel.info, "warn": LogLevel.warn}


def log_line(event: Event) -> None:
    """The log as a subscriber: each event's line, in the event's namespace; the
    log event carries the type (`llmproxy_event`) and the record (`event`)."""
    line = event.line()
    if line is None:
        return
    level, text = line
    logger = _loggers.get(event.namespace)
    if logger is None:
        logger = _loggers[event.namespace] = Logger(namespace=event.namespace)
    logger.emit(_LEVELS[level], "{line}", line=text, llmproxy_event=event.type, event=event)
