"""core/dispatch.py on a real epoll reactor (made here, never run or installed)
with real sockets: what becomes ready is handed over as Twisted hands it over,
reads, disconnections and errors alike, without the legacy log context."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet import abstract, main
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.error import ConnectionDone
from twisted.internet.selectreactor import SelectReactor
from twisted.internet.task import Clock
from twisted.python import log
from twisted.python.failure import Failure

from llmproxy.core import dispatch


class Reader(abstract.FileDescriptor):
    """Reads one end of a socket pair: what it got, and how it was lost."""

    def __init__(self, sock: socket.socket, reactor: Any, fail: bool = False) -> None:
        super().__init__(reactor)
        self.sock = sock
        self.fail = fail
        self.got: list[bytes] = []
        self.lost: list[Failure] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def doRead(self) -> object:
        data = self.sock.recv(100)
        if self.fail:
            raise RuntimeError("a protocol's bug")
        if not data:
            return main.CONNECTION_DONE
        self.got.append(data)
        return None

    def connectionLost(self, reason: Failure) -> None:
        self.lost.append(reason)
        self.reactor.removeReader(self)

    def logPrefix(self) -> str:
        return "Reader"


@pytest.fixture
def reactor() -> Iterator[EPollReactor]:
    made = EPollReactor()
    yield made
    for reader in list(made.getReaders()):
        made.removeReader(reader)
    made.waker.connectionLost(None)  # type: ignore[arg-type]
    made._poller.close()


@pytest.fixture
def contexts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The log prefixes the legacy log context was asked for."""
    asked: list[str] = []
    stock = log.callWithLogger

    def counted(logger: Any, func: Any, *args: Any, **kw: Any) -> Any:
        asked.append(logger.logPrefix())
        return stock(logger, func, *args, **kw)

    monkeypatch.setattr(log, "callWithLogger", counted)
    return asked


def test_reads_and_a_close_are_dispatched_without_the_log_context(
        reactor: EPollReactor, contexts: list[str]) -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        reader = Reader(ours, reactor)
        reactor.addReader(reader)
        peer.send(b"one")
        reactor.doIteration(0)
        assert reader.got == [b"one"] and contexts == ["Reader"]    # Twisted's own way

        assert dispatch.lean_dispatch(reactor) is True
        peer.send(b"two")
        reactor.doIteration(0)
        assert reader.got == [b"one", b"two"] and contexts == ["Reader"]
        peer.close()
        reactor.doIteration(0)
        assert len(reader.lost) == 1 and reader.lost[0].check(ConnectionDone)
        assert reader not in reactor.getReaders() and contexts == ["Reader"]


def test_an_error_out_of_a_read_is_handled_as_twisted_handles_it(
        reactor: EPollReactor) -> None:
    """Logged as an unhandled error, and the descriptor is disconnected with it."""
    errors: list[dict[str, Any]] = []
    log.addObserver(errors.append)
    ours, peer = socket.socketpair()
    try:
        with ours, peer:
            assert dispatch.lean_dispatch(reactor)
            reader = Reader(ours, reactor, fail=True)
            reactor.addReader(reader)
            peer.send(b"x")
            reactor.doIteration(0)
            assert [r.check(RuntimeError) for r in reader.lost] == [RuntimeError]
            assert any(e.get("isError") and "a protocol's bug" in str(e.get("failure"))
                       for e in errors)
    finally:
        log.removeObserver(errors.append)


def test_a_socket_with_nothing_to_read_is_not_dispatched(reactor: EPollReactor) -> None:
    """A poll that finds nothing ready returns at its timeout (0: at once), and
    touches no descriptor."""
    ours, peer = socket.socketpair()
    with ours, peer:
        assert dispatch.lean_dispatch(reactor)
        reader = Reader(ours, reactor)
        reactor.addReader(reader)
        reactor.doIteration(0)
        assert reader.got == [] and reader.lost == []
        reactor.removeReader(reader)


def test_other_reactors_are_left_alone() -> None:
    clock = Clock()
    assert dispatch.lean_dispatch(clock) is False
    select = SelectReactor()
    try:
        assert dispatch.lean_dispatch(select) is False
        assert "doIteration" not in vars(select)
    finally:
        select.waker.connectionLost(None)  # type: ignore[arg-type]


def test_an_epoll_reactor_without_the_known_internals_is_left_alone(
        reactor: EPollReactor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_INTERNALS", ("_poller", "_no_such_attribute"))
    assert dispatch.lean_dispatch(reactor) is False
    assert "doIteration" not in vars(reactor)


class Raising(Reader):
    """Its connectionLost raises: out of `_doReadOrWrite` itself, not caught there."""

    def connectionLost(self, reason: Failure) -> None:
        super().connectionLost(reason)
        raise RuntimeError("connectionLost's bug")

    def logPrefix(self) -> str:
        return "Raising"


def test_an_error_out_of_the_dispatch_is_logged_and_the_batch_goes_on(
        reactor: EPollReactor) -> None:
    """As Twisted's callWithLogger: logged under the transport's prefix, and the
    other descriptors ready in the same poll are handled too."""
    events: list[dict[str, Any]] = []
    log.addObserver(events.append)
    first, first_peer = socket.socketpair()
    second, second_peer = socket.socketpair()
    try:
        with first, first_peer, second, second_peer:
            assert dispatch.lean_dispatch(reactor)
            raising, reader = Raising(first, reactor), Reader(second, reactor)
            reactor.addReader(raising)
            reactor.addReader(reader)
            first_peer.close()                 # raising: a close, then its bug
            second_peer.send(b"still read")
            reactor.doIteration(0)
            assert len(raising.lost) == 1
            assert reader.got == [b"still read"]
            logged = [e for e in events if e.get("isError")]
            assert len(logged) == 1 and logged[0]["system"] == "Raising"
            assert "connectionLost's bug" in str(logged[0]["failure"])
            reactor.removeReader(reader)
    finally:
        log.removeObserver(events.append)
