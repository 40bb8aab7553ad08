"""The connection pool to the engines: persistent connections, checked before
reuse so a request never goes out on one the engine has already closed.

An engine closes an idle keep-alive connection after its own timeout. If that
close and the proxy's next request cross, the request is written to a dead
connection and fails; Twisted retries only idempotent requests, and a POST may
not be retried once a byte of it was sent. So a cached connection is checked
first (a non-blocking peek at its socket): one the engine has closed (EOF) or
that has unexpected bytes waiting is dropped and the next one, or a fresh
connection, is used. Nothing was written on the dropped one.
"""

from __future__ import annotations

import socket
from collections.abc import Hashable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.web.client import HTTPConnectionPool, _HTTP11ClientFactory


class _QuietFactory(_HTTP11ClientFactory):
    noisy = False  # no "Starting factory" line per upstream connection


def closed_by_peer(connection: Any) -> bool:
    """Whether an idle pooled connection can no longer carry a request: the peer
    closed it (a peek reads EOF), it failed, or bytes nobody asked for wait on it."""
    if getattr(connection, "state", None) != "QUIESCENT":
        return False          # the pool skips it itself (its connection was lost)
    try:
        sock = connection.transport.getHandle()
    except AttributeError:    # a lost connection has no socket any more
        return True
    if not isinstance(sock, socket.socket):
        return False          # not a socket (a test double): nothing to check
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False          # nothing to read: open and idle, as it should be
    except OSError:
        return True
    return True               # b"" is EOF; data from an idle server is no better


class UpstreamPool(HTTPConnectionPool):
    """An HTTPConnectionPool that never hands out a connection the engine closed."""

    _factory = _QuietFactory

    def getConnection(self, key: Hashable, endpoint: IStreamClientEndpoint) -> Deferred[Any]:
        connections = self._connections.get(key)
        while connections and closed_by_peer(connections[0]):
            dead = connections[0]
            self._timeouts[dead].cancel()
            self._removeConnection(key, dead)
        return super().getConnection(key, endpoint)
