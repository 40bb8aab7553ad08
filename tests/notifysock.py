"""A stand-in for systemd's notify socket in integration tests: binds an
AF_UNIX datagram socket and collects what any process sends to it."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def parse(datagram: bytes) -> dict[str, str]:
    """One notify datagram as systemd reads it: KEY=VALUE lines, the last one wins."""
    fields: dict[str, str] = {}
    for line in datagram.decode("utf-8", "replace").split("\n"):
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields


class NotifyReceiver:
    """Binds an AF_UNIX SOCK_DGRAM socket at a path in a given directory (or an
    abstract name when abstract=True), collects datagrams in a background thread."""

    def __init__(self, directory: str | Path, abstract: bool = False) -> None:
        name = f"notify-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if abstract:
            self.address = "@llmproxy-test-" + name
            sockaddr: str | bytes = b"\0" + self.address[1:].encode()
            self._path: Path | None = None
        else:
            self._path = Path(directory) / (name + ".sock")
            self.address = sockaddr = str(self._path)
            if len(os.fsencode(sockaddr)) > 107:
                raise ValueError(f"socket path too long for AF_UNIX: {sockaddr}")
        self.messages: list[dict[str, str]] = []
        self.raw: list[bytes] = []
        self.senders: list[int] = []  # the sending pid of each datagram (SCM_CREDENTIALS)
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(sockaddr)
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._receive, daemon=True,
                                        name=f"NotifyReceiver {self.address}")
        self._thread.start()

    def _receive(self) -> None:
        while True:
            readable, _, _ = select.select([self._sock.fileno(), self._wake_r], [], [])
            if self._wake_r in readable:
                return
            data, ancdata, _, _ = self._sock.recvmsg(65536, socket.CMSG_SPACE(_UCRED.size))
            pid = 0
            for level, kind, cmsg in ancdata:
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS):
                    pid = _UCRED.unpack(cmsg[:_UCRED.size])[0]
            with self._cond:
                self.raw.append(data)
                self.messages.append(parse(data))
                self.senders.append(pid)
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[dict[str, str]], bool],
                 timeout: float = 10.0) -> dict[str, str]:
        """The first message matching predicate, waiting for it if needed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = 0
            while True:
                for message in self.messages[seen:]:
                    if predicate(message):
                        return message
                seen = len(self.messages)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"no matching notify message in {timeout}s on {self.address}; "
                        f"got {self.messages!r}")
                self._cond.wait(remaining)

    def close(self) -> None:
        """Stop receiving, close the socket and remove its path."""
        if self._thread.is_alive():
            os.write(self._wake_w, b"x")
            self._thread.join(5)
        self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._path is not None:
            self._path.unlink(missing_ok=True)

    def __enter__(self) -> NotifyReceiver:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
