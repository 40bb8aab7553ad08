"""web/errorbody.py: at most `limit` bytes of an engine's error answer, never a failure, never
a wait past `timeout`."""

from __future__ import annotations

from twisted.internet.task import Clock

from llmproxy.testing.fakes import FakeResponse
from llmproxy.web.errorbody import error_text


def read(response: FakeResponse, clock: Clock, limit: int = 8) -> list[bytes]:
    got: list[bytes] = []
    error_text(response, clock, limit=limit, timeout=5).addCallback(got.append)
    return got


def test_a_short_answer_is_read_whole_when_it_ends() -> None:
    clock, response = Clock(), FakeResponse(500)
    got = read(response, clock)
    response.send(b"oops")
    assert got == []
    response.finish()
    assert got == [b"oops"] and not response.transport.stopped and not clock.getDelayedCalls()


def test_a_long_answer_stops_at_the_limit_and_closes_the_connection() -> None:
    clock, response = Clock(), FakeResponse(500)
    got = read(response, clock)
    response.send(b"12345")
    response.send(b"67890")
    assert got == [b"12345678"] and response.transport.stopped
    assert not clock.getDelayedCalls()


def test_an_answer_that_fails_gives_what_came() -> None:
    clock, response = Clock(), FakeResponse(502)
    got = read(response, clock)
    response.send(b"half")
    response.die()
    assert got == [b"half"]


def test_a_stalled_answer_gives_what_came_after_the_timeout() -> None:
    clock, response = Clock(), FakeResponse(503)
    got = read(response, clock)
    response.send(b"slow")
    clock.advance(4.9)
    assert got == [] and not response.transport.stopped
    clock.advance(0.1)
    assert got == [b"slow"] and response.transport.stopped
