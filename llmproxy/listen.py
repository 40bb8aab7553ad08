"""The listening socket, owned by llmproxy itself.

The socket is created, bound and put in listening state early, before the
rosters are read, so connections that arrive during start-up wait in the
kernel's accept queue. Accepting starts later, through
`reactor.adoptStreamPort`: unlike a `listenTCP` port, an adopted port never
`shutdown()`s the socket when it stops, which would break every other process
holding the same socket (a successor during an upgrade, or systemd).
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IListeningPort, IReactorSocket
from twisted.internet.protocol import ServerFactory
from twisted.logger import Logger

from llmproxy.config import ListenAddress


class ListenError(Exception):
    """The address cannot be listened on; the message says why."""


class Listener:
    """One listening socket: bound early, accepting on demand."""

    log = Logger()
    backlog = 1024

    def __init__(self, reactor: IReactorSocket, address: ListenAddress,
                 factory: ServerFactory[Any]) -> None:
        self._reactor = reactor
        self._address = address
        self._factory = factory
        self._sock: socket.socket | None = None
        self.port: IListeningPort | None = None

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if ":" in self._address.host else socket.AF_INET

    def bind(self) -> None:
        """Create, bind and listen; connections queue in the kernel from now on."""
        sock = socket.socket(self.family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._address.host, self._address.port))
            sock.listen(self.backlog)
        except OSError as e:
            sock.close()
            raise ListenError(f"cannot listen on {self._address}: {e.strerror or e}") from None
        sock.setblocking(False)
        self._sock = sock

    def bound_address(self) -> tuple[str, int]:
        """The host and port really bound (port 0 in the config picks one)."""
        sock = self._sock
        if self.port is not None:
            host = self.port.getHost()
            return host.host, host.port  # type: ignore[attr-defined]
        assert sock is not None, "bind() first"
        name: Any = sock.getsockname()
        return name[0], name[1]

    def start_accepting(self) -> None:
        """Hand the socket to the reactor; it accepts from now on."""
        assert self._sock is not None, "bind() first"
        # adoptStreamPort duplicates the fd; this process then holds exactly one
        # copy, the port's own, which stopListening closes.
        self.port = self._reactor.adoptStreamPort(self._sock.fileno(), self.family, self._factory)
        self._sock.close()
        self._sock = None

    def stop_accepting(self) -> Deferred[None]:
        """Close this process's copy of the socket; fires once it is closed."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        port, self.port = self.port, None
        if port is None:
            return succeed(None)
        d = port.stopListening()
        return d if isinstance(d, Deferred) else succeed(None)
