"""The Twisted floor: the least a proxy on Twisted's reactor costs on this machine.

A reference target for the benchmark, not a proxy anyone should run: bare
protocols on Twisted's epoll reactor, no twisted.web, no routing, no records, no
log. It reads a request's head and its Content-Length body, sends them to the
engine on a kept-alive connection, and relays the engine's answer byte for byte
(its head and its chunk framing as they come), each read sent on at once
(llmproxy's `send_now`), until the answer ends: its Content-Length is reached, or
the bench engine's last chunk (`0\\r\\n\\r\\n`, which it writes at the end of a
write) has passed. Side by side with llmproxy it shows how much of llmproxy's
cost is the reactor, the system calls and Python, and how much is llmproxy.

Run as `python -m bench.floor --engine-port N --port 0`; it prints `bench floor
listening on 127.0.0.1:PORT`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from twisted.internet import protocol, reactor

from llmproxy.speedups.socketwrites import send_now

HOST = "127.0.0.1"


class Upstream(protocol.Protocol):
    """One kept-alive connection to the engine, one answer at a time."""

    def __init__(self, pool: list[Upstream], first: tuple[Client, bytes]) -> None:
        self._pool = pool
        self._first: tuple[Client, bytes] | None = first   # sent once connected
        self._client: Client | None = None
        self._head = b""
        self._left: int | None = None     # Content-Length still to come; None: chunked

    def connectionMade(self) -> None:
        if self._first is not None:
            (client, request), self._first = self._first, None
            self.send(client, request)

    def send(self, client: Client, request: bytes) -> None:
        self._client, self._head, self._left = client, b"", -1
        self.transport.write(request)

    def dataReceived(self, data: bytes) -> None:
        client = self._client
        if client is None:
            return
        if self._left == -1:           # the head is not through yet
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            self._left = None
            for line in self._head[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    self._left = int(value) - (len(self._head) - end - 4)
            data, self._head = self._head, b""
        elif self._left is not None:
            self._left -= len(data)
        send_now(client.transport, data)
        if self._left == 0 or (self._left is None and data.endswith(b"0\r\n\r\n")):
            self._client = None
            self._pool.append(self)
            client.answered()

    def connectionLost(self, reason: Any = None) -> None:
        if self in self._pool:
            self._pool.remove(self)
        if self._client is not None:
            self._client.transport.abortConnection()


class Client(protocol.Protocol):
    """A client connection: one request at a time, kept alive."""

    def __init__(self, factory: Floor) -> None:
        self._factory = factory
        self._buf = b""
        self._busy = False

    def dataReceived(self, data: bytes) -> None:
        self._buf += data
        if not self._busy:
            self._next()

    def _next(self) -> None:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = self._buf[:end].split(b"\r\n")
        length, kept = 0, []
        for line in lines[1:]:
            name = line.partition(b":")[0].strip().lower()
            if name == b"content-length":
                length = int(line.partition(b":")[2])
            elif name not in (b"host", b"connection"):
                kept.append(line)
        if len(self._buf) < end + 4 + length:
            return
        body, self._buf = self._buf[end + 4:end + 4 + length], self._buf[end + 4 + length:]
        request = b"\r\n".join([lines[0], b"Host: engine", *kept,
                                b"Content-Length: %d" % len(body), b"", body])
        self._busy = True
        self._factory.forward(self, request)

    def answered(self) -> None:
        self._busy = False
        if self._buf:
            self._next()


class _Connect(protocol.ClientFactory):
    noisy = False

    def __init__(self, upstream: Upstream, client: Client) -> None:
        self._upstream, self._client = upstream, client

    def buildProtocol(self, addr: Any) -> Upstream:
        return self._upstream

    def clientConnectionFailed(self, connector: Any, reason: Any) -> None:
        self._client.transport.abortConnection()


class Floor(protocol.Factory):
    noisy = False

    def __init__(self, engine_port: int) -> None:
        self._engine_port = engine_port
        self._pool: list[Upstream] = []

    def buildProtocol(self, addr: Any) -> Client:
        return Client(self)

    def forward(self, client: Client, request: bytes) -> None:
        if self._pool:
            self._pool.pop().send(client, request)
            return
        reactor.connectTCP(HOST, self._engine_port,  # type: ignore[attr-defined]
                           _Connect(Upstream(self._pool, (client, request)), client))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-port", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    port = reactor.listenTCP(args.port, Floor(args.engine_port),  # type: ignore[attr-defined]
                             interface=HOST, backlog=4096)
    print(f"bench floor listening on {HOST}:{port.getHost().port}", flush=True)
    reactor.run()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
