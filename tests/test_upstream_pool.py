"""The upstream pool's check before reuse, on real socket pairs."""

from __future__ import annotations

import socket
from typing import Any

from llmproxy.web.upstream import closed_by_peer


class Transport:
    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock

    def getHandle(self) -> socket.socket:
        if self.sock is None:
            raise AttributeError("socket")      # as Twisted's once the connection is lost
        return self.sock


class Pooled:
    def __init__(self, sock: socket.socket | None, state: str = "QUIESCENT") -> None:
        self.transport: Any = Transport(sock)
        self.state = state


def test_an_open_idle_connection_is_reused_and_a_closed_one_is_not() -> None:
    """Open and idle: usable. The engine closed it (EOF waiting), sent bytes nobody
    asked for, or the socket is gone: not usable. The check consumes nothing."""
    ours, engine = socket.socketpair()
    ours.setblocking(False)
    try:
        assert not closed_by_peer(Pooled(ours))
        engine.sendall(b"x")
        assert closed_by_peer(Pooled(ours))
        assert ours.recv(1) == b"x"                 # peeked, not consumed
        engine.close()
        assert closed_by_peer(Pooled(ours))
    finally:
        ours.close()
    assert closed_by_peer(Pooled(None))
    assert not closed_by_peer(Pooled(None, state="CONNECTION_LOST"))   # the pool skips it
