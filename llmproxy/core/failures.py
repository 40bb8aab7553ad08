"""Short, readable reasons for failures, for log lines, events and error bodies.

No twisted.web here: every layer may import it."""

from __future__ import annotations

from twisted.internet.defer import CancelledError


def describe(exc: BaseException) -> str:
    """A short reason for an exception, looking inside Twisted's wrapped ones
    (ResponseFailed / ResponseNeverReceived hold a list of failures)."""
    value: object = exc
    while reasons := getattr(value, "reasons", None):
        value = reasons[0].value
    if isinstance(value, CancelledError):
        return "cancelled"
    return (str(value) or type(value).__name__).rstrip(".")
