"""A listening port told when accept() fails for want of file descriptors.

Twisted has no public hook for a failed accept (twisted/twisted#3958 asks for
one). On EMFILE its accept loop closes a reserved descriptor, accepts the
waiting connections and closes them: clients are refused. The proxy instead
stops accepting for a while and leaves them in the kernel's queue
(lifecycle/openfiles.py's `AcceptBackoff` decides when). To hear of the failure,
the port wraps the adopted socket (Twisted's `_preexistingSocket`) and is made
by Twisted's own constructor for an adopted descriptor
(`_fromListeningDescriptor`), as Twisted 26.10 has them. Off, the listener
adopts its socket with the public `reactor.adoptStreamPort`.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from twisted.internet import tcp
from twisted.internet.protocol import ServerFactory

from llmproxy.compat import Compat
from llmproxy.core.sourcedigest import changed_sources

SHORT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
SOURCES = {
    "twisted.internet.tcp.Port.__init__": "a4a8a270c5059a01",
    "twisted.internet.tcp.Port._fromListeningDescriptor": "d0e4e58fff8da03b",
    "twisted.internet.tcp.Port.startListening": "2220f5d240f3df6b",
    "twisted.internet.tcp.Port.doRead": "d240fc123090ee23",
}


class WatchedSocket(socket.socket):
    """The listening socket: an accept() that fails for want of descriptors
    goes to the port's `short_of_descriptors(errno)` and ends Twisted's accept
    round quietly, as if the queue were empty."""

    port: Any

    def accept(self) -> tuple[socket.socket, Any]:
        try:
            return super().accept()
        except BlockingIOError:
            raise
        except OSError as e:
            if e.errno not in SHORT_OF_DESCRIPTORS:
                raise
            self.port.short_of_descriptors(e.errno)
            raise BlockingIOError(errno.EAGAIN, "accepting paused") from None


class WatchedPort(tcp.Port):
    """A TCP port on an adopted socket, which it watches (see WatchedSocket);
    a subclass says what `short_of_descriptors(code)` does."""

    def startListening(self) -> None:
        adopted = self._preexistingSocket
        if adopted is not None:
            watched = WatchedSocket(adopted.family, adopted.type, adopted.proto,
                                    fileno=adopted.detach())
            watched.setblocking(False)
            watched.port = self
            self._preexistingSocket = watched
        super().startListening()

    def short_of_descriptors(self, code: int) -> None:
        raise NotImplementedError


def adopt_watched(port_class: type[WatchedPort], reactor: Any, fd: int,
                  family: socket.AddressFamily, factory: ServerFactory[Any]) -> WatchedPort:
    """What `reactor.adoptStreamPort` does, with a `port_class` (a WatchedPort
    subclass) made by Twisted's own constructor for an adopted socket (the fd
    is duplicated, as there)."""
    port: WatchedPort = port_class._fromListeningDescriptor(reactor, fd, family, factory)
    port.startListening()
    return port


COMPAT = Compat("accept_guard", "a failed accept() (out of descriptors) pauses accepting "
                "instead of refusing the waiting connections",
                "a public hook for a failed accept() (twisted/twisted#3958)",
                lambda: changed_sources(SOURCES), None)
