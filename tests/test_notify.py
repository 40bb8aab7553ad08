"""sd_notify without libsystemd: the exact datagrams, the silence after a
hand-over, swallowed send errors, watchdog pings on task.Clock; and, marked
integration, delivery over real path and abstract sockets, from this process,
a child process and systemd's own systemd-notify."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.logger import LogEvent, LogLevel, capturedLogs, formatEvent
from zope.interface.verify import verifyObject

from llmproxy.lifecycle.notify import (
    INotifier,
    NullNotifier,
    SystemdNotifier,
    Watchdog,
    notifier_from_environ,
)
from tests.notifysock import NotifyReceiver, parse

ROOT = Path(__file__).resolve().parent.parent


class FakeSocket:
    """Records what would have gone on the wire; raises `error` on sendto when set."""

    def __init__(self, factory: FakeSockets) -> None:
        self.factory = factory
        self.closed = False

    def sendto(self, data: bytes, flags: int, address: bytes) -> int:
        if self.factory.error is not None:
            raise self.factory.error
        self.factory.sent.append((data, flags, address))
        return len(data)

    def close(self) -> None:
        self.closed = True


class FakeSockets:
    """A socket_factory for SystemdNotifier: no real sockets."""

    def __init__(self, error: OSError | None = None) -> None:
        self.error = error
        self.sent: list[tuple[bytes, int, bytes]] = []
        self.made: list[FakeSocket] = []

    def __call__(self) -> Any:
        sock = FakeSocket(self)
        self.made.append(sock)
        return sock

    @property
    def datagrams(self) -> list[bytes]:
        return [data for data, _, _ in self.sent]


def make(address: str = "/run/systemd/notify", usec: int = 123456789,
         error: OSError | None = None) -> tuple[SystemdNotifier, FakeSockets]:
    sockets = FakeSockets(error)
    return SystemdNotifier(address, monotonic_usec=lambda: usec, socket_factory=sockets), sockets


def texts(events: Sequence[LogEvent], level: LogLevel) -> list[str]:
    return [formatEvent(e) for e in events if e["log_level"] == level]


# --- the datagrams -------------------------------------------------------------------------


def test_each_call_sends_its_exact_datagram() -> None:
    """Every life-cycle call sends one datagram with exactly the documented
    KEY=VALUE lines, newline-separated, to the NOTIFY_SOCKET path."""
    notifier, sockets = make()
    notifier.ready()
    notifier.ready("serving 3 models")
    notifier.reloading()
    notifier.stopping()
    notifier.stopping("draining 2 requests")
    notifier.status("idle")
    notifier.send("WATCHDOG=1", "EXTEND_TIMEOUT_USEC=5000000")
    assert sockets.datagrams == [
        b"READY=1",
        b"READY=1\nSTATUS=serving 3 models",
        b"RELOADING=1\nMONOTONIC_USEC=123456789",
        b"STOPPING=1",
        b"STOPPING=1\nSTATUS=draining 2 requests",
        b"STATUS=idle",
        b"WATCHDOG=1\nEXTEND_TIMEOUT_USEC=5000000",
    ]
    assert {address for _, _, address in sockets.sent} == {b"/run/systemd/notify"}


def test_sends_never_block_and_close_their_socket() -> None:
    """Each send uses MSG_DONTWAIT (a stuck manager cannot block the reactor) and
    closes its socket (no fd is held, or leaked into re-exec'd children)."""
    notifier, sockets = make()
    notifier.ready()
    notifier.status("x")
    assert [flags for _, flags, _ in sockets.sent] == [socket.MSG_DONTWAIT] * 2
    assert len(sockets.made) == 2
    assert all(sock.closed for sock in sockets.made)


def test_abstract_address_gets_a_leading_nul() -> None:
    """'@name' in NOTIFY_SOCKET names an abstract socket: the '@' becomes a NUL byte."""
    notifier, sockets = make("@/org/freedesktop/systemd1/notify/1234")
    notifier.ready()
    assert sockets.sent == [(b"READY=1", socket.MSG_DONTWAIT,
                             b"\0/org/freedesktop/systemd1/notify/1234")]


def test_status_text_is_one_line() -> None:
    """Newlines in status text become spaces, so they cannot start bogus keys."""
    notifier, sockets = make()
    notifier.status("a\nb\r\nc")
    notifier.ready("x\nREADY=0")
    assert sockets.datagrams == [b"STATUS=a b  c", b"READY=1\nSTATUS=x READY=0"]


@given(st.text())
def test_any_status_text_parses_back_to_itself_on_one_line(text: str) -> None:
    """Whatever the status text, the datagram holds exactly READY and STATUS,
    and STATUS is the text with its newlines (and only those) made spaces."""
    notifier, sockets = make()
    notifier.ready(text)
    (datagram,) = sockets.datagrams
    assert parse(datagram) == {
        "READY": "1", "STATUS": text.replace("\r", " ").replace("\n", " ")}
    assert datagram.count(b"\n") == 1


def test_reloading_carries_the_monotonic_clock() -> None:
    """RELOADING=1 comes with MONOTONIC_USEC from the injected clock, read at the call."""
    now = [1000]
    sockets = FakeSockets()
    notifier = SystemdNotifier("/n", monotonic_usec=lambda: now[0], socket_factory=sockets)
    notifier.reloading()
    now[0] = 2500
    notifier.reloading()
    assert sockets.datagrams == [b"RELOADING=1\nMONOTONIC_USEC=1000",
                                 b"RELOADING=1\nMONOTONIC_USEC=2500"]


def test_default_clock_is_clock_monotonic_in_microseconds() -> None:
    """Without an injected clock, MONOTONIC_USEC is CLOCK_MONOTONIC in microseconds
    (the clock systemd compares it with)."""
    sockets = FakeSockets()
    notifier = SystemdNotifier("/n", socket_factory=sockets)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    usec = int(parse(sockets.datagrams[0])["MONOTONIC_USEC"])
    assert before <= usec <= after


def test_malformed_lines_are_a_programming_error() -> None:
    """send() refuses a line without '=' or with a newline instead of sending garbage."""
    notifier, sockets = make()
    with pytest.raises(ValueError):
        notifier.send("READY")
    with pytest.raises(ValueError):
        notifier.send("STATUS=a\nMAINPID=1")
    assert sockets.sent == []


# --- hand-over and silence -----------------------------------------------------------------


def everything(notifier: INotifier) -> None:
    notifier.ready("r")
    notifier.reloading()
    notifier.stopping("s")
    notifier.status("t")
    notifier.send("WATCHDOG=1")
    notifier.hand_over(99)


def test_hand_over_sends_mainpid_and_ready_then_nothing_more() -> None:
    """hand_over sends MAINPID + READY (+ STATUS) in one datagram; afterwards no
    method sends anything, and each suppressed message is logged at debug."""
    notifier, sockets = make()
    silent = [notifier.silent]
    notifier.hand_over(4242, "handed over\nto 4242")
    silent.append(notifier.silent)
    assert sockets.datagrams == [b"MAINPID=4242\nREADY=1\nSTATUS=handed over to 4242"]
    assert silent == [False, True]
    with capturedLogs() as events:
        everything(notifier)
    assert len(sockets.sent) == 1
    debug = texts(events, LogLevel.debug)
    assert len(debug) == 6
    assert all("suppressed" in line for line in debug)
    assert "WATCHDOG=1" in debug[4]


def test_hand_over_without_status() -> None:
    """Without a status, the hand-over datagram is just MAINPID and READY."""
    notifier, sockets = make()
    notifier.hand_over(17)
    assert sockets.datagrams == [b"MAINPID=17\nREADY=1"]



# --- no NOTIFY_SOCKET ----------------------------------------------------------------------


def test_null_notifier_does_nothing() -> None:
    """NullNotifier provides INotifier, accepts every call and sends nothing;
    hand_over still makes it silent."""
    notifier = NullNotifier()
    assert verifyObject(INotifier, notifier)
    silent = [notifier.silent]
    with capturedLogs() as events:
        notifier.ready("r")
        notifier.reloading()
        notifier.stopping("s")
        notifier.status("t")
        notifier.send("WATCHDOG=1")
    assert events == []
    notifier.hand_over(5)
    silent.append(notifier.silent)
    assert silent == [False, True]


@pytest.mark.parametrize("environ", [{}, {"NOTIFY_SOCKET": ""}, {"PATH": "/bin"}])
def test_no_notify_socket_gives_a_null_notifier(environ: dict[str, str]) -> None:
    """NOTIFY_SOCKET unset or empty: a NullNotifier, and the environment is left alone."""
    before = dict(environ)
    assert isinstance(notifier_from_environ(environ), NullNotifier)
    assert environ == before


@pytest.mark.parametrize("address", ["/run/systemd/notify", "@abstract/name"])
def test_notify_socket_gives_a_systemd_notifier(address: str) -> None:
    """NOTIFY_SOCKET set: a SystemdNotifier for that address, which provides
    INotifier; NOTIFY_SOCKET stays in the environment (children may need it)."""
    environ = {"NOTIFY_SOCKET": address}
    notifier = notifier_from_environ(environ)
    assert isinstance(notifier, SystemdNotifier)
    assert verifyObject(INotifier, notifier)
    assert notifier.address == address
    assert environ == {"NOTIFY_SOCKET": address}


# --- send errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN])
def test_send_errors_are_swallowed_and_warned_once(code: int) -> None:
    """A failing send never raises: the first failure is a warning naming the
    address and error, later ones are only debug lines."""
    notifier, _ = make("/gone/notify", error=OSError(code, os.strerror(code)))
    with capturedLogs() as events:
        notifier.ready()
        notifier.status("still failing")
        notifier.stopping()
    (warning,) = texts(events, LogLevel.warn)
    assert "/gone/notify" in warning
    assert os.strerror(code) in warning
    assert len(texts(events, LogLevel.debug)) == 2


def test_socket_creation_errors_are_swallowed() -> None:
    """Failing to even make a socket (out of fds) is logged, not raised."""
    def no_socket() -> Any:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    notifier = SystemdNotifier("/n", socket_factory=no_socket)
    with capturedLogs() as events:
        notifier.ready()
    assert len(texts(events, LogLevel.warn)) == 1


# --- watchdog ------------------------------------------------------------------------------


def watchdog(environ: dict[str, str], pid: int = 100) -> tuple[Watchdog, SystemdNotifier,
                                                                 FakeSockets, Clock]:
    notifier, sockets = make()
    clock = Clock()
    return Watchdog(notifier, clock, environ, lambda: pid), notifier, sockets, clock


def test_watchdog_pings_at_half_the_interval() -> None:
    """With WATCHDOG_USEC=2s, WATCHDOG=1 goes out at once and then every second,
    and stops going out after stop()."""
    dog, _, sockets, clock = watchdog({"WATCHDOG_USEC": "2000000"})
    assert dog.start()
    assert sockets.datagrams == [b"WATCHDOG=1"]
    clock.advance(0.999)
    assert len(sockets.sent) == 1
    clock.advance(0.001)
    assert len(sockets.sent) == 2
    clock.advance(1)
    assert sockets.datagrams == [b"WATCHDOG=1"] * 3
    dog.stop()
    clock.advance(10)
    assert len(sockets.sent) == 3
    assert clock.getDelayedCalls() == []
    dog.stop()  # a second stop is harmless


def test_watchdog_starts_for_this_pid() -> None:
    """WATCHDOG_PID equal to our pid: the watchdog starts; starting twice does not
    double the pings."""
    dog, _, sockets, clock = watchdog({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "100"})
    assert dog.start()
    assert dog.start()
    clock.advance(0.25)
    assert len(sockets.sent) == 2


@pytest.mark.parametrize("environ", [
    {},
    {"WATCHDOG_USEC": ""},
    {"WATCHDOG_PID": "100"},
    {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "101"},
    {"WATCHDOG_USEC": "0"},
    {"WATCHDOG_USEC": "soon"},
    {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "me"},
])
def test_watchdog_not_started(environ: dict[str, str]) -> None:
    """No (usable) WATCHDOG_USEC, or a WATCHDOG_PID naming another process: start()
    says False, nothing is sent and nothing is scheduled."""
    dog, _, sockets, clock = watchdog(environ)
    assert not dog.start()
    clock.advance(100)
    assert sockets.sent == []
    assert clock.getDelayedCalls() == []
    dog.stop()


def test_watchdog_stops_after_hand_over() -> None:
    """Once the notifier has handed over, the next tick stops the pings instead of
    sending them: the new main process owns the watchdog."""
    dog, notifier, sockets, clock = watchdog({"WATCHDOG_USEC": "2000000"})
    dog.start()
    notifier.hand_over(200)
    clock.advance(1)
    assert sockets.datagrams == [b"WATCHDOG=1", b"MAINPID=200\nREADY=1"]
    assert clock.getDelayedCalls() == []


# --- integration: real sockets -------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_real_socket_delivers_in_order(tmp_path: Path, abstract: bool) -> None:
    """Over a real path socket and a real abstract socket, the datagrams arrive
    whole and in the order sent, with a MONOTONIC_USEC from the real clock."""
    with NotifyReceiver(tmp_path, abstract=abstract) as receiver:
        assert receiver.address.startswith("@") == abstract
        notifier = notifier_from_environ({"NOTIFY_SOCKET": receiver.address})
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        notifier.ready()
        notifier.reloading()
        notifier.ready("reloaded: 3 models")
        notifier.stopping()
        receiver.wait_for(lambda m: "STOPPING" in m)
        first, reloading, ready, stopping = receiver.messages
        assert first == {"READY": "1"}
        assert reloading["RELOADING"] == "1"
        assert before <= int(reloading["MONOTONIC_USEC"]) <= (
            time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)
        assert ready == {"READY": "1", "STATUS": "reloaded: 3 models"}
        assert stopping == {"STOPPING": "1"}
        assert receiver.senders == [os.getpid()] * 4


@pytest.mark.integration
@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_real_socket_gone_is_warned_not_raised(tmp_path: Path, abstract: bool) -> None:
    """When the manager's socket has gone (ENOENT for a path, ECONNREFUSED for an
    abstract name), sends warn once and never raise."""
    receiver = NotifyReceiver(tmp_path, abstract=abstract)
    receiver.close()
    notifier = SystemdNotifier(receiver.address)
    with capturedLogs() as events:
        notifier.ready()
        notifier.stopping()
    (warning,) = texts(events, LogLevel.warn)
    code = errno.ECONNREFUSED if abstract else errno.ENOENT
    assert os.strerror(code) in warning


@pytest.mark.integration
@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_child_process_notifies_and_goes_silent(tmp_path: Path, abstract: bool) -> None:
    """A child process using the module with NOTIFY_SOCKET from its environment
    delivers READY+STATUS and the hand-over, then nothing: its later calls are
    suppressed (a datagram we send after it exits is the next one in the queue)."""
    code = (
        "import os\n"
        "from llmproxy.lifecycle.notify import notifier_from_environ\n"
        "n = notifier_from_environ(os.environ)\n"
        "n.ready('child up')\n"
        "n.hand_over(12345, 'handing over')\n"
        "n.stopping('too late')\n"
        "n.status('too late')\n"
    )
    with NotifyReceiver(tmp_path, abstract=abstract) as receiver:
        env = {**os.environ, "NOTIFY_SOCKET": receiver.address, "PYTHONPATH": str(ROOT)}
        child = subprocess.Popen([sys.executable, "-c", code], env=env)
        assert child.wait(30) == 0
        SystemdNotifier(receiver.address).send("SENTINEL=1")
        receiver.wait_for(lambda m: "SENTINEL" in m)
        assert receiver.messages == [
            {"READY": "1", "STATUS": "child up"},
            {"MAINPID": "12345", "READY": "1", "STATUS": "handing over"},
            {"SENTINEL": "1"},
        ]
        assert receiver.senders == [child.pid, child.pid, os.getpid()]


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("systemd-notify") is None, reason="no systemd-notify")
def test_same_bytes_as_systemd_notify(tmp_path: Path) -> None:
    """systemd's own systemd-notify is received too, and its READY+STATUS datagram
    is byte for byte what ready(status) sends."""
    with NotifyReceiver(tmp_path) as receiver:
        env = {**os.environ, "NOTIFY_SOCKET": receiver.address}
        subprocess.run(["systemd-notify", "--ready", "--status=serving 2 models"],
                       env=env, check=True, timeout=30)
        theirs = receiver.wait_for(lambda m: "READY" in m)
        assert theirs == {"READY": "1", "STATUS": "serving 2 models"}
        SystemdNotifier(receiver.address).ready("serving 2 models")
        receiver.wait_for(lambda m: m is not theirs and "READY" in m)
        ready = [raw for raw in receiver.raw if raw.startswith(b"READY=1")]
        assert ready == [b"READY=1\nSTATUS=serving 2 models"] * 2


@pytest.mark.integration
def test_wait_for_times_out_with_all_messages(tmp_path: Path) -> None:
    """The receiver's wait_for fails with an AssertionError listing what did arrive."""
    with NotifyReceiver(tmp_path) as receiver:
        SystemdNotifier(receiver.address).status("only this")
        receiver.wait_for(lambda m: "STATUS" in m)
        with pytest.raises(AssertionError, match="only this"):
            receiver.wait_for(lambda m: "READY" in m, timeout=0.2)


def test_watchdog_asks_for_the_pid_when_it_starts() -> None:
    """Built before twistd daemonizes, started in the daemon: WATCHDOG_PID names the
    daemon, and the watchdog pings for it (the pid is read as it starts)."""
    notifier, sockets = make()
    pids = [100]
    dog = Watchdog(notifier, Clock(), {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "200"},
                   lambda: pids[-1])
    pids.append(200)                        # forked
    assert dog.start()
    assert sockets.datagrams == [b"WATCHDOG=1"]
    dog.stop()
