"""The built-in demo: its config, and simulated engines to put behind it."""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

from twisted.application.service import IService, MultiService, Service
from twisted.internet.interfaces import IListeningPort

from llmproxy.config import Config
from llmproxy.core.reactors import IServiceReactor

CONFIG_PATH = os.path.join(os.path.dirname(__file__), "demo.json")

# Each demo host also serves one model the catalog does not name, to show that
# such models are listed and routed under their own names.
EXTRA_MODELS = {"sim1": ("tiny-sim",), "sim2": ("embed-sim",)}


def engine_socket(host: str, port: int) -> socket.socket:
    """A listening socket for a simulated engine, with SO_REUSEPORT: an upgrade's
    successor binds the same port while its predecessor (which holds it) drains,
    the kernel spreads new connections over both, and the successor's alone
    remain once the predecessor exits. OSError when the port is taken otherwise."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class _EngineService(Service):
    """One simulated engine listening on its host's URL."""

    def __init__(self, reactor: IServiceReactor, host: str, port: int,
                 models: tuple[str, ...]) -> None:
        self._reactor = reactor
        self._host = host
        self._port_number = port
        self._models = models
        self._port: IListeningPort | None = None

    def privilegedStartService(self) -> None:
        # Listening before the proxy reads the rosters (its startService).
        from llmproxy.testing.simengine import SimEngine, make_site

        engine = SimEngine(models=self._models, clock=self._reactor)
        try:
            sock = engine_socket(self._host, self._port_number)
        except OSError as e:
            raise SystemExit(f"llmproxy --demo: cannot listen on {self._host}:"
                             f"{self._port_number} for a simulated engine: "
                             f"{e.strerror or e}") from None
        # (Twisted's stubs type the factory narrower than a Site.)
        site: Any = make_site(engine)
        with sock:      # the adopted port holds its own duplicate
            self._port = self._reactor.adoptStreamPort(sock.fileno(), sock.family, site)
        super().privilegedStartService()

    def stopService(self) -> Any:
        super().stopService()
        if self._port is not None:
            return self._port.stopListening()
        return None


def demo_engines(config: Config, reactor: IServiceReactor) -> IService:
    """A service running one simulated engine per host of the demo config."""
    engines = MultiService()
    for host in config.hosts:
        url = urlsplit(host.url)
        models = tuple(m.upstream for m in config.models.values() if host.name in m.hosts)
        models += EXTRA_MODELS.get(host.name, ())
        _EngineService(reactor, url.hostname or "127.0.0.1", url.port or 80,
                       models).setServiceParent(engines)
    return engines
