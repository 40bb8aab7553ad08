"""Signals and exit statuses of the process.

| status | when |
| --- | --- |
| 0 | a clean stop: every request finished |
| 3 | a stop that had to cut requests at the drain deadline (the unit lists it
|   | in SuccessExitStatus: the stop did what was asked, and said what it cut) |
| 143 / 130 | a second SIGTERM / SIGINT during the stop: exit at once |
| 124 | the stop overran its whole budget (something blocked the reactor) |
| 78 | it could not start for a reason a restart will not fix (EX_CONFIG): an
|    | invalid config, a host lock another llmproxy holds, a bad LISTEN_FDS |
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from twisted.internet.interfaces import IReactorFromThreads

EXIT_CLEAN = 0
EXIT_CUT = 3
EXIT_OVERRAN = 124
EXIT_CONFIG = 78       # sysexits.h EX_CONFIG: the unit lists it in RestartPreventExitStatus


def refuse_to_start(message: str) -> SystemExit:
    """Say why the proxy cannot start, on stderr; the SystemExit(78) to raise."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os.write(2, f"llmproxy: {message}\n".encode())
    return SystemExit(EXIT_CONFIG)
HARD_DEADLINE_MARGIN = 5.0


def exit_now(status: int) -> None:
    """Leave the process at once with `status`, after flushing what was logged."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


class HardDeadline:
    """A last resort that no blocked reactor or stuck thread can hold up: a
    timer thread that exits the process once the stop budget is long over."""

    def __init__(self, exit: Callable[[int], None] = exit_now) -> None:
        self._exit = exit
        self._timer: threading.Timer | None = None

    def arm(self, seconds: float) -> None:
        if self._timer is None:
            self._timer = threading.Timer(seconds, self._fire, args=(seconds,))
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self, seconds: float) -> None:
        os.write(2, f"llmproxy: the stop took over {seconds:.0f}s, beyond its budget: "
                    f"exiting now (status {EXIT_OVERRAN})\n".encode())
        self._exit(EXIT_OVERRAN)


def install_stop_signals(reactor: IReactorFromThreads, on_signal: Callable[[int], None],
                         set_handler: Callable[..., Any] = signal.signal) -> None:
    """Route SIGTERM and SIGINT to `on_signal(signum)` on the reactor thread.

    Call once the reactor runs: at start-up it installs its own handlers for
    both, which would replace ours.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        reactor.callFromThread(on_signal, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        set_handler(sig, handler)


class SignalLatch:
    """A signal caught from early in start-up until the process ends.

    Installed before the config is first read (SIGHUP: an early one never
    kills the process, and one that arrived before that read is satisfied by
    it); one that arrives before the reactor runs is delivered once it does.
    """

    def __init__(self, signum: int = signal.SIGHUP) -> None:
        self.signum = signum
        self.received = 0
        self._satisfied = 0
        self._deliver: Callable[[], None] | None = None

    def install(self, set_handler: Callable[..., Any] = signal.signal) -> None:
        set_handler(self.signum, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self._deliver is not None:
            self._deliver()

    def config_read(self) -> None:
        """The config was (re)read now: every signal so far is satisfied."""
        self._satisfied = self.received

    def connect(self, reactor: IReactorFromThreads, on_hangup: Callable[[], object]) -> None:
        """Deliver the signal to `on_hangup` on the reactor thread from now on,
        including one that arrived since the config was read."""
        self._deliver = lambda: reactor.callFromThread(on_hangup)
        if self.received > self._satisfied:
            self._deliver()
