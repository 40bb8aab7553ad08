"""Writing to a TCP connection at once, in the turn the bytes are ready.

Twisted's `transport.write` only buffers: it asks the reactor to watch the socket
for writability (an epoll_ctl) and sends on the next turn of the loop (an
epoll_wait, the send, another epoll_ctl to stop watching). For a relay that
writes one small event per read, that is three system calls and a loop turn per
event on top of the send. When nothing is buffered, `send_now` sends directly;
whatever the socket does not take (it is full, or failing) goes to
`transport.write`, so backpressure, ordering and error handling stay Twisted's.
Transports that are not plain TCP (TLS, test doubles) just get `write`.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import tcp


def send_now(transport: Any, data: bytes) -> None:
    """Write `data` to `transport`: sent now when its buffer is empty."""
    if (type(transport) is tcp.Server or type(transport) is tcp.Client) and \
            not transport._tempDataLen and transport.offset >= len(transport.dataBuffer) \
            and transport.connected and not transport.disconnecting and \
            not transport._writeDisconnected:
        try:
            sent = transport.socket.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = 0     # the write below meets the same error and Twisted handles it
        if sent == len(data):
            return
        data = data[sent:]
    transport.write(data)
