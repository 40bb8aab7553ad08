"""The harness of the differential tests (test_differential_requests.py,
test_differential_responses.py): two proxies in this process, on the real
reactor and real sockets on 127.0.0.1, one with every speedup this Twisted
allows (`select({})`), one on the reference path (`REFERENCE`); a raw engine
that records the bytes it receives and answers with scripted bytes; and a raw
client that sends bytes in pieces and keeps everything it gets until the proxy
closes the connection.

Every wait ends on an event (a connection closes, a request is whole at the
engine, a few reactor turns pass between two pieces), bounded by WAIT seconds
so a proxy that hangs fails the test instead of stalling it.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure

from llmproxy.config import parse_config
from llmproxy.core.events import Event, RequestEnded
from llmproxy.core.hub import Hub
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.accessfiles import load_access_files
from llmproxy.lifecycle.assemble import ServiceInputs, build_service, upstream_client
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.speedups import REFERENCE, Selection, select
from tests.selections import compat_entries

WAIT = 10.0          # seconds: the longest any one exchange may take
MAX_BODY = 4096      # the proxies' max_body_bytes
TURNS = 3            # reactor turns between two pieces: the proxy reads each apart
MODEL = "m"


def selections() -> dict[str, Selection]:
    """The two paths compared, chosen here whatever LLMPROXY_SPEEDUPS says:
    every speedup whose guard passes on this Twisted, and none."""
    fast = select({})
    assert fast.active, f"no speedup is on here: {fast.off}"
    return {"speedups": fast, "reference": REFERENCE}


def reactor() -> Any:
    from twisted.internet import reactor as global_reactor
    return global_reactor


def turns(n: int) -> Deferred[None]:
    """Fires after `n` turns of the reactor (each a poll of every socket)."""
    d: Deferred[None] = Deferred()

    def step(left: int) -> None:
        if left:
            reactor().callLater(0, step, left - 1)
        else:
            d.callback(None)

    step(n)
    return d


# -- the engine ------------------------------------------------------------------
def request_end(data: bytes) -> int:
    """Where the first whole HTTP/1.1 request in `data` ends (Content-Length,
    chunked or no body); -1 while it is not whole."""
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return -1
    head = data[:head_end].lower()
    start = head_end + 4
    found = re.search(rb"\r\ncontent-length: *(\d+)", head)
    if found:
        end = start + int(found.group(1))
        return end if len(data) >= end else -1
    if re.search(rb"\r\ntransfer-encoding: *chunked", head):
        at = start
        while True:
            eol = data.find(b"\r\n", at)
            if eol < 0:
                return -1
            size = int(data[at:eol].split(b";")[0], 16)
            if size == 0:
                trailer_end = data.find(b"\r\n\r\n", eol)
                return -1 if trailer_end < 0 else trailer_end + 4
            at = eol + 2 + size + 2
            if at > len(data):
                return -1
    return start


OK_BODY = b'{"id": "x", "object": "chat.completion", "choices": []}'
OK = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
      b"Content-Length: %d\r\n\r\n%s" % (len(OK_BODY), OK_BODY))


@dataclass
class Script:
    """What the engine answers each request with: `pieces`, each written a few
    reactor turns after the one before (so the proxy reads them apart), then
    the connection closed when `close`."""

    pieces: list[bytes] = field(default_factory=lambda: [OK])
    close: bool = False


class EngineConnection(Protocol):
    """One engine connection: each whole request is recorded, then answered."""

    factory: EngineFactory

    def __init__(self) -> None:
        self.buffer = b""

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = request_end(self.buffer)
            if end < 0:
                return
            request, self.buffer = self.buffer[:end], self.buffer[end:]
            self.factory.requests.append(request)
            self._answer(list(self.factory.script.pieces))

    def _answer(self, pieces: list[bytes]) -> None:
        if self.transport is None or not pieces:
            if self.transport is not None and self.factory.script.close:
                self.transport.loseConnection()
            return
        self.transport.write(pieces[0])
        turns(TURNS).addCallback(lambda _: self._answer(pieces[1:]))

    def connectionMade(self) -> None:
        self.factory.connections.add(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.factory.connections.discard(self)


class EngineFactory(Factory):
    """The engine: the requests it received whole (raw bytes, in order), and
    the script it answers with."""

    protocol = EngineConnection  # type: ignore[assignment]
    noisy = False

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.script = Script()
        self.connections: set[EngineConnection] = set()


# -- the proxies -----------------------------------------------------------------
@dataclass
class Proxy:
    """One proxy in front of the engine, on its own port, and its access events."""

    name: str
    service: LLMProxyService
    pool: Any
    port: Any
    ended: list[RequestEnded] = field(default_factory=list)

    @property
    def number(self) -> int:
        return int(self.port.getHost().port)


def make_proxy(name: str, selection: Selection, engine_port: int,
               extra: dict[str, Any] | None = None) -> Proxy:
    """A proxy with `selection`'s speedups (its site and its engine client),
    its model on the engine, listening on 127.0.0.1 (`extra`: more config keys)."""
    config = parse_config({
        "listen": "127.0.0.1:0", "max_body_bytes": MAX_BODY,
        "hosts": [{"name": "gpu1", "url": f"http://127.0.0.1:{engine_port}"}], **(extra or {})})
    files = load_access_files(config, {})
    http, pool = upstream_client(config, reactor(), files, selection)
    hub = Hub()
    service = build_service(ServiceInputs(config, reactor(), http=http, pool=pool, hub=hub,
                                          access_files=files, speedups=selection,
                                          compat=compat_entries()))
    service.runtime.rosters.record_success("gpu1", 1, (RosterEntry(MODEL, 4096),))
    port = reactor().listenTCP(0, service.site, interface="127.0.0.1")
    proxy = Proxy(name, service, pool, port)

    def heard(event: Event) -> None:
        if isinstance(event, RequestEnded):
            proxy.ended.append(event)

    hub.subscribe(heard)
    return proxy


class Rig:
    """The engine and the two proxies in front of it (a plain class: hypothesis
    prints a failing example's arguments, and this short)."""

    def __init__(self, engine: EngineFactory, engine_port: Any,
                 proxies: dict[str, Proxy]) -> None:
        self.engine, self.engine_port, self.proxies = engine, engine_port, proxies

    def __repr__(self) -> str:
        return f"Rig(engine on {self.engine_port.getHost().port})"

    async def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.service.forwarder.stop()        # its header-timeout timer
            for channel in list(proxy.service.site.channels):
                channel.transport.abortConnection()
            await proxy.pool.closeCachedConnections()
            await proxy.port.stopListening()
        for connection in list(self.engine.connections):
            if connection.transport is not None:
                connection.transport.abortConnection()  # type: ignore[attr-defined]
        await self.engine_port.stopListening()


def make_rig(extra: dict[str, Any] | None = None) -> Rig:
    """The engine on 127.0.0.1, and a proxy for each path in front of it (`extra`:
    more config keys for both)."""
    engine = EngineFactory()
    engine_port = reactor().listenTCP(0, engine, interface="127.0.0.1")
    number = engine_port.getHost().port
    proxies = {name: make_proxy(name, selection, number, extra)
               for name, selection in selections().items()}
    return Rig(engine, engine_port, proxies)


# -- the client ------------------------------------------------------------------
class Client(Protocol):
    """Sends `pieces`, a few reactor turns apart (none after the proxy closed);
    `done` fires with every byte received once the connection is closed."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.received = bytearray()
        self.done: Deferred[bytes] = Deferred()
        self.open = False

    def connectionMade(self) -> None:
        self.open = True
        self._send(0)

    def _send(self, i: int) -> None:
        if not self.open or i >= len(self.pieces) or self.transport is None:
            return
        self.transport.write(self.pieces[i])
        if i + 1 < len(self.pieces):
            turns(TURNS).addCallback(lambda _: self._send(i + 1))

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.open = False
        self.done.callback(bytes(self.received))


@dataclass
class Outcome:
    """What one exchange gave on one path."""

    received: bytes                   # everything the client got, as it came
    engine: list[bytes]               # every whole request the engine received
    ended: list[RequestEnded]         # the proxy's access events


async def exchange(rig: Rig, name: str, pieces: list[bytes],
                   script: Script | None = None) -> Outcome:
    """`pieces` sent to proxy `name` on a fresh connection, the engine
    answering by `script`; once the proxy closed the connection and every
    request it started has ended."""
    proxy = rig.proxies[name]
    rig.engine.requests = []
    rig.engine.script = script or Script()
    proxy.ended.clear()
    client = Client(pieces)
    endpoint = TCP4ClientEndpoint(reactor(), "127.0.0.1", proxy.number)
    await connectProtocol(endpoint, client)
    received = await client.done.addTimeout(WAIT, reactor())
    await proxy.service.inflight.idle().addTimeout(WAIT, reactor())
    return Outcome(received, list(rig.engine.requests), list(proxy.ended))


async def both(rig: Rig, pieces: list[bytes], script: Script | None = None
               ) -> tuple[Outcome, Outcome]:
    """The same exchange on the reference path, then with the speedups (one
    after the other: they share the engine's records)."""
    reference = await exchange(rig, "reference", pieces, script)
    fast = await exchange(rig, "speedups", pieces, script)
    return reference, fast


def cut(data: bytes, cuts: list[float]) -> list[bytes]:
    """`data` in pieces, cut at `cuts` (fractions of its length)."""
    bounds = [0, *sorted({int(c * len(data)) for c in cuts} - {0}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]
