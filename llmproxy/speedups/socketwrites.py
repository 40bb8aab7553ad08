"""Writing to a TCP connection at once, in the turn the bytes are ready.

Twisted's `transport.write` only buffers: it asks the reactor to watch the socket
for writability (an epoll_ctl) and sends on the next turn of the loop (an
epoll_wait, the send, another epoll_ctl to stop watching). For a relay that
writes one small event per read, that is three system calls and a loop turn per
event on top of the send. When nothing is buffered, `send_now` sends directly;
whatever the socket does not take (it is full, or failing) goes to
`transport.write`, so backpressure, ordering and error handling stay Twisted's.
Transports that are not plain TCP (TLS, test doubles) just get `write`.

`no_delay` turns Nagle's algorithm off on a connection to an engine, as
Twisted's HTTP client and server (so the clients' side) and nginx's
`tcp_nodelay` do: with it on, a small write waits for the peer's
acknowledgement of the previous one (up to a delayed ACK's 40 ms on Linux), and
a streamed request body is a sequence of writes.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet import tcp

from llmproxy.speedups.guards import changed_sources

# write(2) on the socket: send(2) without flags, for about two thirds of what
# Python's socket.send costs in the interpreter (no argument parsing by format
# string, no timeout bookkeeping), which a relay pays once per event.
_write = os.write

# What h1client's _read (Twisted's TCP read, straight to the protocol) stands in
# for, as it is in Twisted 26.10 (else Twisted's own stays).
READ_AS_KNOWN = tcp.Client.doRead is tcp.Connection.doRead and \
    tcp.Client._dataReceived is tcp.Connection._dataReceived and \
    tcp.Connection.doRead.__code__.co_names == (
        "socket", "recv", "bufferSize", "OSError", "args", "EWOULDBLOCK", "main",
        "CONNECTION_LOST", "_dataReceived") and \
    tcp.Connection._dataReceived.__code__.co_names == (
        "main", "CONNECTION_DONE", "protocol", "dataReceived")


# The Twisted code send_now rests on (a transport's buffers are empty exactly
# when write() would only buffer and ask to be told of writability), and the
# read h1client's _read stands in for, as of Twisted 26.10.
SOURCES = {
    "twisted.internet.abstract.FileDescriptor.write": "3e46c97fc173bc7e",
    "twisted.internet.abstract.FileDescriptor.doWrite": "a986d7b1b1054e43",
    "twisted.internet.tcp.Connection.writeSomeData": "2dd0d4209260b94e",
    "twisted.internet.tcp.Connection.doRead": "20ac74ffecd6b7f2",
    "twisted.internet.tcp.Connection._dataReceived": "7ed147aeca0c7f8a",
}


def guard() -> str | None:
    """None when the installed Twisted's TCP transport is the one send_now
    and h1client's read were written against (Twisted 26.10)."""
    return changed_sources(SOURCES)


def no_delay(transport: Any) -> None:
    """TCP_NODELAY on `transport`'s socket, when it is TCP (a TLS transport
    passes it to the TCP one below; a UNIX socket or a test double has none).
    Twisted's setTcpNoDelay ignores a socket that refuses it."""
    set_no_delay = getattr(transport, "setTcpNoDelay", None)
    if set_no_delay is not None:
        set_no_delay(True)


def send_now(transport: Any, data: bytes) -> None:
    """Write `data` to `transport`: sent now when its buffer is empty."""
    if (type(transport) is tcp.Server or type(transport) is tcp.Client) and \
            not transport._tempDataLen and transport.offset >= len(transport.dataBuffer) \
            and transport.connected and not transport.disconnecting and \
            not transport._writeDisconnected:
        try:
            sent = _write(transport.fileno(), data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = 0     # the write below meets the same error and Twisted handles it
        if sent == len(data):
            return
        data = data[sent:]
    transport.write(data)
