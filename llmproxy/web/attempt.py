"""One request's way through its model's hosts (replicas) and its fallback
models: what it carries from one host (or model) to the next, the body each
model is sent, its session key for `affinity`, and which failures prove that
nothing of it reached an engine (only those may move it to the next host, or
model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from twisted.internet.error import ConnectError, DNSLookupError
from twisted.web.client import RequestNotSent  # type: ignore[attr-defined]  # not in its __all__
from twisted.web.server import Request

from llmproxy.hosts.catalog import Route
from llmproxy.hosts.prefixring import prefix_key
from llmproxy.observe.inflight import Exchange
from llmproxy.web.site import ProxyRequest


class NotSent(Exception):
    """Nothing of the request reached the host's engine; str() says why."""


class Unavailable(Exception):
    """No host of the request's model could take it, and nothing of it was sent
    (str() says why): the next model of its fallback chain may."""


def nothing_sent(error: BaseException) -> bool:
    """The failure happened before a byte of the request was written: the
    connection was refused or timed out (or the name did not resolve), or the
    request was never written (Twisted's RequestNotSent)."""
    return isinstance(error, ConnectError | DNSLookupError | RequestNotSent)


def session_of(route: Route, request: Request, body: dict[str, Any]) -> str | None:
    """The session key `route.affinity` names (``header:NAME``, ``body:FIELD``, or
    ``prefix``: a digest of the body's stable prefix, see `hosts.prefixring`),
    None when the model has none or the request does not carry it."""
    if route.affinity is None:
        return None
    if route.affinity == "prefix":
        return prefix_key(body)
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

    request: ProxyRequest
    exchange: Exchange
    route: Route
    raw: Any              # with the upstream model name (JSON bytes, or a multipart Form)
    original: Any         # as the client sent it (for a successor process)
    session: str | None
    committed: bool = False
    more: bool = False    # a fallback model follows: Unavailable here moves the request on


def upstream_body(body: dict[str, Any], raw: Any, asked: str, upstream: str) -> Any:
    """What goes to an engine that knows the model as `upstream`: the client's
    bytes when it asked for that name, else its body with `model` substituted."""
    if upstream == asked:
        return raw
    if not isinstance(raw, bytes):     # a multipart Form
        return raw.renamed(upstream)
    return json.dumps({**body, "model": upstream}).encode("utf-8")


@dataclass(frozen=True)
class Upstream:
    """Where one send of a request goes, and how its failures are answered."""

    base: str                   # the URL the request's path is appended to
    host: str                   # named in errors and the exchange's record
    engine: str | None = None   # the engine it holds a lease on (a managed host)
    # Bound for the host it was routed to: the exchange hears once it is on its way.
    routed: bool = False
    # A 200 event stream was already started (pings while it waited for an
    # engine): a failure becomes an SSE error event, not an error status.
    committed: bool = False
    # Another host (or model) may take it: NotSent when nothing of it was sent.
    failover: bool = False
    # `base` is this proxy's successor, whose door needs the client's
    # credentials as this one's did (never sent to an engine).
    successor: bool = False
