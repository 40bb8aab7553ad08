"""The upstream pool's check before reuse, on real socket pairs."""

from __future__ import annotations

import socket
import struct
from typing import Any

from llmproxy.web.engineclient import closed_by_peer


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
    assert closed_by_peer(Pooled(ours))                # closed on this side
    assert closed_by_peer(Pooled(None))
    assert not closed_by_peer(Pooled(None, state="CONNECTION_LOST"))   # the pool skips it


def test_a_connection_the_engine_reset_is_not_reused() -> None:
    """A TCP connection on 127.0.0.1 that the engine's side aborted (RST)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        ours = socket.create_connection(listener.getsockname())
        engine, _ = listener.accept()
    ours.setblocking(False)
    try:
        assert not closed_by_peer(Pooled(ours))
        engine.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        engine.close()
        assert closed_by_peer(Pooled(ours))
    finally:
        ours.close()
