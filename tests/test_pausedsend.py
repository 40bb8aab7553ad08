"""core/pausedsend.PausedSend: written at once while the client reads, queued while
paused and written in order on resume, the client dropped once (and nothing more
queued) past the bound, flushed for a clean end, a stop reported."""

from __future__ import annotations

from llmproxy.core.pausedsend import PausedSend


def make(limit: int = 10) -> tuple[PausedSend, list[bytes], list[str]]:
    written: list[bytes] = []
    said: list[str] = []
    sender = PausedSend(written.append, limit, lambda: said.append("overflow"),
                        lambda: said.append("stopped"))
    return sender, written, said


def test_writes_at_once_and_queues_while_paused_in_order() -> None:
    sender, written, said = make()
    sender.send(b"a")
    sender.pauseProducing()
    sender.send(b"bc")
    sender.send(b"d")
    assert written == [b"a"] and sender.queued == 3
    sender.resumeProducing()
    assert written == [b"a", b"bc", b"d"] and sender.queued == 0 and said == []


def test_past_the_bound_the_client_is_dropped_once() -> None:
    sender, written, said = make(limit=4)
    sender.pauseProducing()
    sender.send(b"1234")
    assert said == []
    sender.send(b"5")
    assert said == ["overflow"] and sender.overflowed and sender.queued == 0
    sender.send(b"more")
    sender.resumeProducing()
    assert written == [] and said == ["overflow"]


def test_flush_writes_what_waits_and_stop_is_reported() -> None:
    sender, written, said = make()
    sender.pauseProducing()
    sender.send(b"x")
    sender.flush()
    assert written == [b"x"] and sender.queued == 0
    sender.stopProducing()
    assert said == ["stopped"]
