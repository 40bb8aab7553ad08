"""Telling systemd how we are doing (sd_notify), without libsystemd: one
AF_UNIX datagram of KEY=VALUE lines to $NOTIFY_SOCKET, and WATCHDOG=1 pings."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Attribute, Interface, implementer


class INotifier(Interface):
    """Where the service manager hears about our life cycle."""

    silent = Attribute("True once this notifier sends nothing more (after hand_over)")

    def send(*lines: str) -> None:
        """Send one datagram made of these KEY=VALUE lines."""

    def ready(status: str | None = None) -> None:
        """READY=1, with STATUS= when given."""

    def reloading() -> None:
        """RELOADING=1 with MONOTONIC_USEC= (systemd ignores RELOADING=1 without it)."""

    def stopping(status: str | None = None) -> None:
        """STOPPING=1, with STATUS= when given."""

    def status(text: str) -> None:
        """STATUS=text."""

    def hand_over(new_pid: int, status: str | None = None) -> None:
        """MAINPID=new_pid and READY=1 (and STATUS=); then go silent for good."""


def _status(text: str | None) -> list[str]:
    # One line per key: a newline in the text would start a bogus key.
    return [] if text is None else ["STATUS=" + text.replace("\r", " ").replace("\n", " ")]


def _monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def _unix_datagram_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)


class _Notifier:
    """The life-cycle messages, spelled once over an abstract send()."""

    silent = False

    def send(self, *lines: str) -> None:
        raise NotImplementedError

    def ready(self, status: str | None = None) -> None:
        self.send("READY=1", *_status(status))

    def reloading(self) -> None:
        self.send("RELOADING=1", f"MONOTONIC_USEC={self._monotonic_usec()}")

    def stopping(self, status: str | None = None) -> None:
        self.send("STOPPING=1", *_status(status))

    def status(self, text: str) -> None:
        self.send(*_status(text))

    def hand_over(self, new_pid: int, status: str | None = None) -> None:
        self.send(f"MAINPID={new_pid}", "READY=1", *_status(status))
        self.silent = True

    def _monotonic_usec(self) -> int:
        return 0  # only a real send needs the time


@implementer(INotifier)
class SystemdNotifier(_Notifier):
    """Sends to the socket systemd named in $NOTIFY_SOCKET ('@name' is abstract)."""

    log = Logger()

    def __init__(self, address: str, *,
                 monotonic_usec: Callable[[], int] = _monotonic_usec,
                 socket_factory: Callable[[], socket.socket] = _unix_datagram_socket) -> None:
        self.address = address
        raw = os.fsencode(address)
        self._sockaddr = b"\0" + raw[1:] if raw.startswith(b"@") else raw
        self._clock = monotonic_usec
        self._socket_factory = socket_factory
        self._warned = False

    def _monotonic_usec(self) -> int:
        return self._clock()

    def send(self, *lines: str) -> None:
        for line in lines:
            if "=" not in line or "\n" in line:
                raise ValueError(f"not a KEY=VALUE line: {line!r}")
        message = "\n".join(lines)
        if self.silent:
            self.log.debug("notify: silent, suppressed {message!r}", message=message)
            return
        try:
            sock = self._socket_factory()
            try:
                # Never block the reactor on a slow or stuck service manager.
                sock.sendto(message.encode("utf-8"), socket.MSG_DONTWAIT, self._sockaddr)
            finally:
                sock.close()
        except OSError as e:
            if not self._warned:
                self._warned = True
                self.log.warn("notify: cannot send to {address}: {error} (warned once)",
                              address=self.address, error=e)
            else:
                self.log.debug("notify: cannot send {message!r}: {error}",
                               message=message, error=e)


@implementer(INotifier)
class NullNotifier(_Notifier):
    """Not run under a service manager that listens: every call is a no-op."""

    def send(self, *lines: str) -> None:
        pass


def notifier_from_environ(environ: Mapping[str, str]) -> INotifier:
    """A SystemdNotifier when NOTIFY_SOCKET is set and non-empty, else a NullNotifier."""
    address = environ.get("NOTIFY_SOCKET", "")
    return SystemdNotifier(address) if address else NullNotifier()


class Watchdog:
    """WATCHDOG=1 every WATCHDOG_USEC/2, when systemd asked for it for this pid (`pid`,
    read as the watchdog starts: twistd daemonizes after the service was built)."""

    log = Logger()

    def __init__(self, notifier: INotifier, clock: IReactorTime,
                 environ: Mapping[str, str], pid: Callable[[], int]) -> None:
        self._notifier = notifier
        self._clock = clock
        self._environ = environ
        self._pid = pid
        self._loop: LoopingCall | None = None

    def start(self) -> bool:
        """Start pinging (the first ping now); whether the watchdog is on."""
        if self._loop is not None:
            return True
        usec_text = self._environ.get("WATCHDOG_USEC", "")
        if not usec_text:
            return False
        pid_text = self._environ.get("WATCHDOG_PID", "")
        try:
            usec = int(usec_text)
            if pid_text and int(pid_text) != self._pid():    # now: a daemon forked
                return False
        except ValueError:
            self.log.warn("watchdog: ignoring WATCHDOG_USEC={usec!r} WATCHDOG_PID={pid!r}",
                          usec=usec_text, pid=pid_text)
            return False
        if usec <= 0:
            return False
        self._loop = LoopingCall(self._ping)
        self._loop.clock = self._clock
        self.log.info("watchdog: pinging every {interval:.3f}s", interval=usec / 2e6)
        self._loop.start(usec / 2e6, now=True).addErrback(self._failed)
        return True

    def stop(self) -> None:
        """Stop pinging; harmless when not started."""
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()

    def _ping(self) -> None:
        if self._notifier.silent:
            # Handed over: the pings are the new main process's job now.
            self.stop()
            return
        self._notifier.send("WATCHDOG=1")

    def _failed(self, failure: Failure) -> None:
        self._loop = None
        self.log.failure("watchdog: pinging stopped", failure)
