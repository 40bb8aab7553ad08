"""What the proxy knows of one request beyond what Twisted's Request holds: one
typed record (`RequestState`), the `state` of every ProxyRequest (web/site.py),
on HTTP/1.1 and HTTP/2 alike (Twisted's H2Stream makes its requests through the
site's requestFactory too). The door (web/routes.Root) takes ProxyRequests only,
so every module past it reads `request.state` and never guesses.

Who writes what: the body limit (web/bodylimit.py) `body_too_large`; an HTTP/2
stream's rules (web/streams.py) `stream_body` and `body_timeout`; the request
itself (web/site.py) `dispatched` and `client_gone`; the door (web/routes.py)
`exchange` and `credentials`; its queue wait (web/queuewait.py) `queue_wait`;
the capture (web/captures.py) `capture`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from twisted.internet.address import IPv4Address, IPv6Address

if TYPE_CHECKING:
    from llmproxy.observe.capture import Recording
    from llmproxy.observe.inflight import Exchange
    from llmproxy.web.streams import StreamBody

# What a request let in keeps of the client's credentials (web/access.Admitted):
# header names and their values, for a successor's door, never upstream.
Credentials = tuple[tuple[bytes, tuple[bytes, ...]], ...]


@dataclass(eq=False)
class RequestState:
    """One request's record, from its headers to its end."""

    # Its body is over max_body_bytes: answered 413 at once, the rest never read.
    body_too_large: bool = False
    # An HTTP/2 stream's body stalled this long: answered 408.
    body_timeout: float | None = None
    # An HTTP/2 stream's request while its body arrives (None on HTTP/1.1).
    stream_body: StreamBody | None = None
    # Handed to the resource (its whole body in, or refused).
    dispatched: bool = False
    # Its connection (or stream) was lost before it finished.
    client_gone: bool = False
    # In flight (observe/inflight.py): what it writes is counted there. None for
    # the event stream and the engines' logs, which are not requests in flight.
    exchange: Exchange | None = None
    # What the door took off it: for the successor only, never upstream.
    credentials: Credentials = ()
    # Seconds it waited in host queues (web/queuewait.py), summed over the hosts it tried.
    queue_wait: float = 0.0
    # With capture on, an API request's recording (web/captures.py), fed by its relay.
    capture: Recording | None = None


class WithState:
    """Mixed into the request: its `state`, made on first use (the request's
    constructor stays Twisted's)."""

    @cached_property
    def state(self) -> RequestState:
        return RequestState()


def client_host(request: Any, unknown: str = "unknown") -> str:
    """The client's IP address as text; `unknown` for a peer without one (a
    UNIX socket, a test's fake transport)."""
    address = request.getClientAddress()
    return address.host if isinstance(address, IPv4Address | IPv6Address) else unknown
