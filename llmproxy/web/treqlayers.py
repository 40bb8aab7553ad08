"""The layer the reference engine client puts between treq and its Agent: no
content coding is asked for, and none is undone.

treq wraps every request in Twisted's ContentDecoderAgent, which adds
`Accept-Encoding: gzip` to the request and inflates a gzip answer with no bound
on what one read inflates to (64 KiB in, 64 MiB out at once: a gzip bomb
from an engine), and no public API leaves it out. `IdentityAgent` sits under
it, on the proxy's side of every engine request:

- the request asks for `Accept-Encoding: identity` alone (treq's `gzip` is
  replaced), as the fast client's does (web.relay's request headers set it):
  the proxy reads an engine's body (its `usage`), it does not inflate it;
- an answer with a `Content-Encoding` anyway has it renamed to `HIDDEN`, in
  its place among the headers, so the decoder above finds nothing to undo;
  `restore_coding`, called on the response treq hands back, names it
  `Content-Encoding` again (and drops the empty one the decoder sets where it
  finds none). The body passes as the engine sent it, with its
  coding and length, as on the fast client. An engine's own `HIDDEN` header
  is dropped first: the name is this layer's alone.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer
from zope.interface import implementer

HIDDEN = b"X-LLMProxy-Content-Encoding"   # a Content-Encoding on its way past treq's decoder


def _renamed(headers: Headers, old: bytes, new: bytes | None) -> None:
    """`headers` with every `old` header named `new` (None: dropped), in place
    and in order."""
    items = list(headers.getAllRawHeaders())
    for name, _ in items:
        headers.removeHeader(name)
    for name, values in items:
        if name.lower() != old.lower():
            headers.setRawHeaders(name, list(values))
        elif new is not None:
            headers.setRawHeaders(new, list(values))


def hide_coding(response: Any) -> Any:
    """An engine's answer with its Content-Encoding renamed HIDDEN."""
    headers: Headers = response.headers
    if headers.hasHeader(HIDDEN):
        _renamed(headers, HIDDEN, None)
    if headers.hasHeader(b"Content-Encoding"):
        _renamed(headers, b"Content-Encoding", HIDDEN)
    return response


def restore_coding(response: Any) -> Any:
    """The response treq handed back, with its engine's Content-Encoding again.
    (Any Content-Encoding it has is the decoder's: an empty one, which it sets
    where it found none.)"""
    headers: Headers = response.headers
    headers.removeHeader(b"Content-Encoding")
    if headers.hasHeader(HIDDEN):
        _renamed(headers, HIDDEN, b"Content-Encoding")
    return response


@implementer(IAgent)
class IdentityAgent:
    """An IAgent under treq's ContentDecoderAgent (see the module docstring)."""

    def __init__(self, agent: IAgent) -> None:
        self._agent = agent

    def request(self, method: bytes, uri: bytes, headers: Headers | None = None,
                bodyProducer: IBodyProducer | None = None) -> Deferred[Any]:
        sent = headers.copy() if headers is not None else Headers()
        sent.setRawHeaders(b"Accept-Encoding", [b"identity"])
        d: Deferred[Any] = self._agent.request(method, uri, sent, bodyProducer)
        return d.addCallback(hide_coding)
