"""One request's way through its model's hosts (replicas): what it carries from
one host to the next, its session key for `affinity`, and which failures prove
that nothing of it reached an engine (only those may move it to the next host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twisted.internet.error import ConnectError, DNSLookupError
from twisted.web.client import RequestNotSent  # type: ignore[attr-defined]  # not in its __all__
from twisted.web.server import Request

from llmproxy.hosts.catalog import Route
from llmproxy.observe.inflight import Exchange


class NotSent(Exception):
    """Nothing of the request reached the host's engine; str() says why."""


def nothing_sent(error: BaseException) -> bool:
    """The failure happened before a byte of the request was written: the
    connection was refused or timed out (or the name did not resolve), or the
    request was never written (Twisted's RequestNotSent)."""
    return isinstance(error, ConnectError | DNSLookupError | RequestNotSent)


def session_of(route: Route, request: Request, body: dict[str, Any]) -> str | None:
    """The session key `route.affinity` names (``header:NAME`` or ``body:FIELD``),
    None when the model has none or the request does not carry it."""
    if route.affinity is None:
        return None
    kind, _, name = route.affinity.partition(":")
    if kind == "header":
        value = request.getHeader(name)
        return value or None
    field = body.get(name)
    if isinstance(field, bool) or not isinstance(field, str | int):
        return None
    return str(field)


@dataclass
class Attempt:
    """A request on its way: the bodies to send, its session, and whether its
    answer is already a started event stream (pings while it waited)."""

    request: Request
    exchange: Exchange
    route: Route
    raw: Any              # with the upstream model name (JSON bytes, or a multipart Form)
    original: Any         # as the client sent it (for a successor process)
    session: str | None
    committed: bool = False
