"""Open files, in memory: the soft limit raised to the hard one (and said so),
and the listening port that pauses accepting when accept() finds no
descriptor, logging once per burst rather than once per failure."""

from __future__ import annotations

import errno
import resource
import socket
from typing import Any

import pytest
from twisted.internet.protocol import ServerFactory
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from llmproxy.compat.acceptguard import WatchedSocket
from llmproxy.lifecycle.openfiles import GuardedPort, raise_open_files


def lines(events: list[Any]) -> list[str]:
    return [formatEvent(e) for e in events
            if e.get("log_namespace") == "llmproxy.lifecycle.openfiles"]


def test_soft_limit_is_raised_to_the_hard_limit() -> None:
    """1024 of 524288: raised to 524288, and the log gives both figures."""
    calls: list[tuple[int, tuple[int, int]]] = []
    with capturedLogs() as events:
        limits = raise_open_files(lambda _: (1024, 524288),
                                  lambda which, new: calls.append((which, new)))
    assert calls == [(resource.RLIMIT_NOFILE, (524288, 524288))]
    assert limits == (524288, 524288)
    assert lines(events) == ["open files: soft limit raised from 1024 to 524288"]


def test_soft_limit_already_at_the_hard_limit_is_left() -> None:
    calls: list[Any] = []
    with capturedLogs() as events:
        assert raise_open_files(lambda _: (4096, 4096), lambda *a: calls.append(a)) == (
            4096, 4096)
    assert calls == [] and lines(events) == ["open files: soft limit 4096 (the hard limit)"]


def test_a_limit_that_cannot_be_raised_is_said_and_kept() -> None:
    def refuse(which: int, new: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    with capturedLogs() as events:
        assert raise_open_files(lambda _: (1024, 2048), refuse) == (1024, 2048)
    assert lines(events) == ["open files: soft limit 1024, could not raise it to 2048: "
                             "not allowed"]


class FakeReactor(Clock):
    """A clock that also records which descriptors are read."""

    def __init__(self) -> None:
        super().__init__()
        self.readers: set[Any] = set()

    def addReader(self, reader: Any) -> None:
        self.readers.add(reader)

    def removeReader(self, reader: Any) -> None:
        self.readers.discard(reader)


def port() -> tuple[GuardedPort, FakeReactor]:
    reactor = FakeReactor()
    p = GuardedPort(0, ServerFactory(), reactor=reactor)
    p.connected = True
    p.startReading()
    return p, reactor


def test_a_burst_of_failures_is_one_line_and_one_more_when_it_is_over() -> None:
    """accept() fails again at each retry for 2 s: accepting pauses at each
    failure and resumes 0.5 s later (no busy loop); one warning names EMFILE and
    the soft limit, and one line says when accepting ran 0.5 s without a
    failure; a later burst is a second pair of lines."""
    p, reactor = port()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    with capturedLogs() as events:
        for _ in range(5):
            p.short_of_descriptors(errno.EMFILE)
            p.short_of_descriptors(errno.EMFILE)      # the same round, once more
            assert p not in reactor.readers
            reactor.advance(0.5)
            assert p in reactor.readers
        reactor.advance(0.5)                          # a whole tick without a failure
        assert p in reactor.readers
        reactor.advance(10)
        p.short_of_descriptors(errno.ENFILE)
        reactor.advance(0.5)
        reactor.advance(0.5)
    logged = lines(events)
    assert len(logged) == 4, logged
    assert logged[0].startswith(f"open files: accept() failed with EMFILE (this process's open "
                                f"files are at its limit; soft limit {soft}): new connections "
                                "wait in the listen queue")
    assert logged[1] == "open files: accepting again; 10 accept() failure(s) over 3.0s"
    assert logged[2].startswith("open files: accept() failed with ENFILE (the system's")
    assert logged[3] == "open files: accepting again; 1 accept() failure(s) over 1.0s"
    assert reactor.getDelayedCalls() == []


def test_a_port_that_stops_listening_is_not_resumed() -> None:
    """A port that stopped listening meanwhile does not read again."""
    p, reactor = port()
    p.short_of_descriptors(errno.EMFILE)
    p.disconnecting = True
    reactor.advance(1)
    assert p not in reactor.readers


def test_the_listening_socket_reports_exhaustion_as_an_empty_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """accept() failing with EMFILE ends Twisted's accept round the quiet way
    (EAGAIN) and tells the port; other errors pass through."""
    heard: list[Any] = []

    class Port:
        def short_of_descriptors(self, code: int) -> None:
            heard.append(code)

    failure: list[OSError] = [OSError(errno.EMFILE, "Too many open files")]

    def accept(self: socket.socket) -> Any:
        raise failure[0]

    monkeypatch.setattr(socket.socket, "accept", accept)
    with WatchedSocket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.port = Port()  # type: ignore[assignment]
        with pytest.raises(BlockingIOError) as raised:
            sock.accept()
        assert raised.value.errno == errno.EAGAIN
        failure[0] = BlockingIOError(errno.EAGAIN, "nothing")
        with pytest.raises(BlockingIOError):
            sock.accept()
        failure[0] = OSError(errno.EBADF, "bad")
        with pytest.raises(OSError) as other:
            sock.accept()
        assert other.value.errno == errno.EBADF
    assert heard == [errno.EMFILE]
