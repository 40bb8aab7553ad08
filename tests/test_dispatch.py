"""core/dispatch.py on a real epoll reactor (made here, never installed) with
real sockets: what becomes ready is handed over as Twisted hands it over,
reads, disconnections and errors alike, without the legacy log context; and
its main loop, run on such a reactor, runs what Twisted's runs, in the same
order, without the timed-call work of turns that have none. The loop is what
is tested, so those tests run it on real time (a task.Clock has no loop): about
0.1 s in all, waiting on the reactor's own timed calls, never on a sleep."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet import abstract, main
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.error import ConnectionDone, ConnectionFdescWentAway, ConnectionLost
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


# -- a read event, inline ---------------------------------------------------------

class Recording(Reader):
    """A Reader whose fileno can be made -1 and whose doRead can say CONNECTION_LOST."""

    def __init__(self, sock: socket.socket, reactor: Any, fail: bool = False,
                 lost: bool = False) -> None:
        super().__init__(sock, reactor, fail)
        self.closed, self.lose = False, lost

    def fileno(self) -> int:
        return -1 if self.closed else self.sock.fileno()

    def doRead(self) -> object:
        if self.lose:
            self.sock.recv(100)
            return main.CONNECTION_LOST
        return super().doRead()


@pytest.mark.parametrize("case", ["data", "close", "lost", "raises", "no-descriptor"])
def test_a_read_event_is_handled_as_twisteds_doReadOrWrite_handles_it(case: str) -> None:
    """The same descriptor, the same event: Twisted's way and the inline way call
    doRead, disconnect with the same reason and the same read flag, and log the
    same errors."""

    def run(lean: bool) -> tuple[list[bytes], list[tuple[type, bool]], int]:
        made = EPollReactor()
        disconnects: list[tuple[type, bool]] = []
        stock = made._disconnectSelectable

        def spy(selectable: Any, why: Any, is_read: bool) -> None:
            disconnects.append((type(why), is_read))
            stock(selectable, why, is_read)

        made._disconnectSelectable = spy  # type: ignore[method-assign]
        errors: list[dict[str, Any]] = []
        log.addObserver(errors.append)
        ours, peer = socket.socketpair()
        try:
            if lean:
                assert dispatch.lean_dispatch(made)
            reader = Recording(ours, made, fail=case == "raises", lost=case == "lost")
            made.addReader(reader)
            # Registered, then its fileno() says -1 (a descriptor gone under it).
            reader.closed = case == "no-descriptor"
            if case == "close":
                peer.close()
            else:
                peer.send(b"x")
            made.doIteration(0)
            return reader.got, disconnects, sum(bool(e.get("isError")) for e in errors)
        finally:
            log.removeObserver(errors.append)
            for each in list(made.getReaders()):
                made.removeReader(each)
            made.waker.connectionLost(None)  # type: ignore[arg-type]
            made._poller.close()
            ours.close()
            peer.close()

    assert run(lean=True) == run(lean=False)
    got, disconnects, errors = run(lean=True)
    expected = {
        "data": ([b"x"], [], 0),
        "close": ([], [(ConnectionDone, True)], 0),
        "lost": ([], [(ConnectionLost, True)], 0),
        "raises": ([], [(RuntimeError, False)], 1),
        "no-descriptor": ([], [(ConnectionFdescWentAway, False)], 0),
    }[case]
    assert (got, disconnects, errors) == expected


# -- the main loop ------------------------------------------------------------------

class OneByte(Reader):
    """Reads one byte per turn; stops the reactor after `until` bytes."""

    def __init__(self, sock: socket.socket, reactor: Any, until: int) -> None:
        super().__init__(sock, reactor)
        self.until = until
        self.turns: list[int] = []       # runUntilCurrent calls so far, at each read

    def doRead(self) -> object:
        data = self.sock.recv(1)
        self.got.append(data)
        self.turns.append(self.reactor.runs)
        if len(self.got) == self.until:
            self.reactor.stop()
        return None


def _timed(made: EPollReactor, timeouts: list[float | None]) -> Any:
    """made.doIteration, recording each poll's timeout."""
    stock = made.doIteration

    def iterate(timeout: float | None) -> None:
        timeouts.append(timeout)
        stock(timeout)
    return iterate


def _counting(made: EPollReactor) -> list[float | None]:
    """Count runUntilCurrent calls (made.runs) and record each poll's timeout."""
    made.runs = 0  # type: ignore[attr-defined]
    stock_run = made.runUntilCurrent
    timeouts: list[float | None] = []

    def run() -> None:
        made.runs += 1  # type: ignore[attr-defined]
        stock_run()

    made.runUntilCurrent = run  # type: ignore[method-assign]
    made.doIteration = _timed(made, timeouts)  # type: ignore[method-assign]
    return timeouts


def test_turns_with_only_io_skip_the_timed_call_work(reactor: EPollReactor) -> None:
    assert dispatch.lean_dispatch(reactor)
    timeouts = _counting(reactor)
    ours, peer = socket.socketpair()
    with ours, peer:
        reader = OneByte(ours, reactor, until=5)
        reactor.addReader(reader)
        peer.send(b"12345")
        fired: list[bool] = []
        # Only if the stop were not heard: after 5 s, it is repeated.
        reactor.callLater(5, lambda: (fired.append(True), reactor.stop()))
        reactor.run(installSignalHandlers=False)
        assert reader.got == [b"1", b"2", b"3", b"4", b"5"] and not fired
        # Between the first read and the last, nothing was due: no runUntilCurrent.
        assert len(set(reader.turns)) == 1
        # The 5 s call bounds each wait for the reads (the last poll, after the
        # stop, does not wait).
        assert len(timeouts) == 6 and all(4 < t <= 5 for t in timeouts[:5])  # type: ignore
        # The stop was heard: runUntilCurrent ran once more (the shutdown).
        assert reactor.runs > reader.turns[-1]  # type: ignore[attr-defined]


def test_with_nothing_timed_the_poll_waits_for_io(reactor: EPollReactor) -> None:
    assert dispatch.lean_dispatch(reactor)
    timeouts: list[float | None] = []
    reactor.doIteration = _timed(reactor, timeouts)  # type: ignore[method-assign]
    ours, peer = socket.socketpair()
    with ours, peer:
        reader = Reader(ours, reactor)
        reactor.addReader(reader)
        reactor.callLater(0, peer.send, b"x")
        # What stops the reactor is a thread's call; until it comes the loop
        # has no timed call, and polls without a timeout.
        import threading
        reader.doRead = lambda: (ours.recv(1), threading.Thread(  # type: ignore
            target=reactor.callFromThread, args=(reactor.stop,)).start())
        reactor.run(installSignalHandlers=False)
        assert None in timeouts


def test_a_pending_timed_call_bounds_the_wait_as_timeout_computes_it(
        reactor: EPollReactor) -> None:
    assert dispatch.lean_dispatch(reactor)
    ours, peer = socket.socketpair()
    with ours, peer:
        reader = OneByte(ours, reactor, until=3)
        reactor.addReader(reader)
        later = reactor.callLater(30, lambda: None)
        timeouts = _counting(reactor)
        peer.send(b"abc")
        reactor.run(installSignalHandlers=False)
        waits = [t for t in timeouts if t]
        assert waits and all(29 < t <= 30 for t in waits)
        assert len(set(reader.turns)) == 1
        later.cancel()


def _script(made: EPollReactor) -> list[str]:
    """Timed calls, I/O that schedules a call, which cancels 60 calls and has
    another thread call in, which stops the reactor; an error in a turn; what
    ran, in order. Each step must wake the loop by itself: the fallback stop
    comes only after 5 s."""
    import threading

    seen: list[str] = []
    ours, peer = socket.socketpair()
    reader = Reader(ours, made)

    def read() -> None:
        seen.append("read " + ours.recv(10).decode())
        made.callLater(0, called_from_a_read)

    def called_from_a_read() -> None:
        seen.append("called from a read")
        for call in doomed:
            call.cancel()
        threading.Thread(target=made.callFromThread, args=(from_thread,)).start()

    reader.doRead = read  # type: ignore[method-assign]
    made.addReader(reader)
    made.addSystemEventTrigger("before", "shutdown", seen.append, "shutdown")
    stock_iterate = made.doIteration
    raised: list[bool] = []

    def iterate(timeout: float | None) -> None:
        if len(seen) == 2 and not raised:
            raised.append(True)
            raise RuntimeError("a bug in a turn")
        stock_iterate(timeout)

    def from_thread() -> None:
        seen.append(f"pending {len(made._pendingTimedCalls)}")
        made.stop()

    made.doIteration = iterate  # type: ignore[method-assign]
    made.callLater(0, seen.append, "at once")
    made.callLater(0.01, seen.append, "10 ms")
    made.callLater(0.02, peer.send, b"ping")
    doomed = [made.callLater(60, seen.append, "never") for _ in range(60)]
    fallback = made.callLater(5, lambda: (seen.append("fallback"), made.stop()))
    try:
        made.run(installSignalHandlers=False)
    finally:
        if fallback.active():
            fallback.cancel()
        made.removeReader(reader)
        ours.close()
        peer.close()
    return seen


def test_the_lean_loop_runs_what_twisteds_runs_in_the_same_order() -> None:
    """One script on Twisted's loop and on the lean one: the same calls in the
    same order, an error in a turn logged as Twisted logs it (and the loop goes
    on), 60 cancelled calls swept from the heap, the shutdown fired."""
    from twisted.logger import globalLogPublisher

    results, logged = [], []
    for lean in (False, True):
        made = EPollReactor()
        if lean:
            assert dispatch.lean_dispatch(made)
        errors: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(errors.append)
        try:
            results.append(_script(made))
        finally:
            globalLogPublisher.removeObserver(errors.append)
            made.waker.connectionLost(None)  # type: ignore[arg-type]
            made._poller.close()
        logged.append([e.get("log_format") for e in errors if e.get("log_failure")])
    assert results[0] == results[1] == [
        "at once", "10 ms", "read ping", "called from a read", "pending 1", "shutdown"]
    assert logged[0] == logged[1] == ["Unexpected error in main loop"]
