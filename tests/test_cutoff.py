"""web/cutoff.StallGuard on a task.Clock: an HTTP/2 response's producer paused by
flow control for the write stall limit in a row is reported stalled once; a
resume (the client read something) or a stop starts nothing; the engine's
transport sees every pause, resume and stop."""

from __future__ import annotations

from twisted.internet.task import Clock

from llmproxy.web.cutoff import StallGuard, response_producer


class Producer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def pauseProducing(self) -> None:
        self.calls.append("pause")

    def resumeProducing(self) -> None:
        self.calls.append("resume")

    def stopProducing(self) -> None:
        self.calls.append("stop")


def make() -> tuple[StallGuard, Producer, Clock, list[float]]:
    clock, producer, stalls = Clock(), Producer(), []
    guard = StallGuard(producer, clock, 5.0, lambda: stalls.append(clock.seconds()))
    return guard, producer, clock, stalls


def test_paused_for_the_limit_is_stalled_once() -> None:
    guard, producer, clock, stalls = make()
    guard.pauseProducing()
    clock.advance(4.9)
    guard.pauseProducing()          # a second pause does not restart the count
    assert stalls == []
    clock.advance(0.1)
    assert stalls == [5.0]
    clock.advance(60)
    assert stalls == [5.0] and producer.calls == ["pause", "pause"]


def test_a_resume_starts_the_count_again() -> None:
    guard, producer, clock, stalls = make()
    guard.pauseProducing()
    clock.advance(4)
    guard.resumeProducing()
    guard.pauseProducing()
    clock.advance(4)
    assert stalls == []
    clock.advance(1)
    assert stalls == [9.0]
    assert producer.calls == ["pause", "resume", "pause"]


def test_a_stop_ends_the_count() -> None:
    guard, producer, clock, stalls = make()
    guard.pauseProducing()
    guard.stopProducing()
    clock.advance(60)
    assert stalls == [] and producer.calls == ["pause", "stop"]


class Request:
    def __init__(self, proto: bytes) -> None:
        self.clientproto = proto
        self.site = type("Site", (), {"timeouts": type("T", (), {"write_stall": 5.0})(),
                                      "reactor": Clock()})()


def test_only_http2_responses_are_guarded() -> None:
    """HTTP/1.1 channels have the stall timer of their own: the producer is the
    engine's transport itself there."""
    producer = Producer()
    assert response_producer(Request(b"HTTP/1.1"), producer) is producer
    assert isinstance(response_producer(Request(b"HTTP/2"), producer), StallGuard)
