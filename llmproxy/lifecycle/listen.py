"""The listening socket, owned by llmproxy itself.

The socket is created, bound and put in listening state early, before the
rosters are read, so connections that arrive during start-up wait in the
kernel's accept queue. Accepting starts later, through
`reactor.adoptStreamPort`: unlike a `listenTCP` port, an adopted port never
`shutdown()`s the socket when it stops, which would break every other process
holding the same socket (a successor during an upgrade, or systemd).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IListeningPort, IReactorSocket
from twisted.internet.protocol import ServerFactory
from twisted.logger import Logger

from llmproxy.config import ListenAddress
from llmproxy.lifecycle.openfiles import adopt


class ListenError(Exception):
    """The address cannot be listened on; the message says why."""


SD_LISTEN_FDS_START = 3
LISTEN_VARIABLES = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


@dataclass(frozen=True)
class Inherited:
    """A listening socket passed to this process (systemd's protocol, also
    used by a predecessor llmproxy handing its socket over in an upgrade)."""

    fd: int
    name: str | None


def inherited_socket(environ: Mapping[str, str], pid: int) -> Inherited | None:
    """The socket systemd passed, if `LISTEN_PID` names this process.

    Read this before anything imports twisted.internet.endpoints (treq does):
    that import deletes the variables. Exactly one socket is accepted.
    """
    listen_pid, listen_fds = environ.get("LISTEN_PID"), environ.get("LISTEN_FDS")
    if listen_pid is None or listen_fds is None:
        return None
    if listen_pid.strip() != str(pid):
        Logger().info("LISTEN_PID={listen_pid} is not this process ({pid}): ignoring LISTEN_FDS",
                      listen_pid=listen_pid, pid=pid)
        return None
    try:
        count = int(listen_fds)
    except ValueError:
        raise ListenError(f"LISTEN_FDS={listen_fds!r}: not a number") from None
    if count != 1:
        raise ListenError(f"LISTEN_FDS={count}: llmproxy takes exactly one listening socket "
                          "(give its socket unit a single ListenStream=)")
    names = environ.get("LISTEN_FDNAMES")
    return Inherited(SD_LISTEN_FDS_START, names.split(":")[0] if names else None)


def forget_inherited(environ: MutableMapping[str, str]) -> None:
    """Drop the LISTEN_* variables so no child process mistakes them for its own."""
    for name in LISTEN_VARIABLES:
        environ.pop(name, None)


class Listener:
    """One listening socket: bound early, accepting on demand."""

    log = Logger()
    backlog = 1024

    def __init__(self, reactor: IReactorSocket, address: ListenAddress,
                 factory: ServerFactory[Any], inherited: Inherited | None = None,
                 scheme: str = "http", guarded: bool = True) -> None:
        self._reactor = reactor
        # Whether the port pauses accepting when out of descriptors (the compat
        # entry accept_guard, see accept.py), or is Twisted's own.
        self._guarded = guarded
        self.scheme = scheme
        self._address = address
        self._factory = factory
        self._inherited = inherited
        self._sock: socket.socket | None = None
        self.port: IListeningPort | None = None
        self.origin = "bound"   # or "inherited fd 3 (name)"

    @property
    def family(self) -> socket.AddressFamily:
        if self._sock is not None:
            return self._sock.family
        return socket.AF_INET6 if ":" in self._address.host else socket.AF_INET

    def open(self) -> None:
        """Adopt the inherited socket if there is one, else bind `listen`."""
        if self._inherited is None:
            self.bind()
        else:
            self.adopt(self._inherited)

    def adopt(self, inherited: Inherited) -> None:
        """Take an inherited listening socket (already bound and listening)."""
        try:
            sock = socket.socket(fileno=inherited.fd)
        except OSError as e:
            raise ListenError(f"inherited fd {inherited.fd}: not a socket: {e.strerror}") from None
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET,
                                                                  socket.SO_ACCEPTCONN):
            sock.detach()
            raise ListenError(f"inherited fd {inherited.fd}: not a listening stream socket")
        os.set_inheritable(sock.fileno(), False)
        sock.setblocking(False)
        self._sock = sock
        label = f" ({inherited.name})" if inherited.name else ""
        self.origin = f"inherited fd {inherited.fd}{label}"

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

    def bound_address(self) -> tuple[str, int] | None:
        """The host and port really bound (port 0 in the config picks one);
        None before the socket is open or after it is closed."""
        if self.port is not None:
            host = self.port.getHost()
            return host.host, host.port  # type: ignore[attr-defined]
        if self._sock is None:
            return None
        name: Any = self._sock.getsockname()
        return name[0], name[1]

    def address(self) -> str | None:
        """`host:port` (`[v6]:port`) really bound, for logs and /status."""
        bound = self.bound_address()
        if bound is None:
            return None
        host, port = bound
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def loopback_url(self) -> str | None:
        """`http://host:port` this process can connect to itself (a wildcard
        address becomes loopback)."""
        bound = self.bound_address()
        if bound is None:
            return None
        host, port = bound
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        return f"{self.scheme}://[{host}]:{port}" if ":" in host else \
            f"{self.scheme}://{host}:{port}"

    def start_accepting(self) -> None:
        """Hand the socket to the reactor; it accepts from now on."""
        assert self._sock is not None, "bind() first"
        # As adoptStreamPort, the port duplicates the fd; this process then holds
        # exactly one copy, the port's own, which stopListening closes. The port
        # pauses accepting when the process is out of descriptors (accept.py).
        self.port = adopt(self._reactor, self._sock.fileno(), self.family, self._factory,
                          self._guarded)
        self._sock.close()
        self._sock = None

    def fileno(self) -> int:
        """The live listening fd (the port's own duplicate), to hand to a successor."""
        assert self.port is not None, "not accepting"
        fd: int = self.port.fileno()  # type: ignore[attr-defined]
        return fd

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
