"""The views in memory: the event log's ids, ring and replay; finding an engine's
usage at the end of a body or stream."""

from __future__ import annotations

from twisted.internet.task import Clock

from llmproxy.core.events import RequestEnded, StopStage
from llmproxy.observe.eventstream import EventLog
from llmproxy.web.relay import find_usage


def test_ids_increase_across_generations_and_replay_knows_its_limits() -> None:
    """A process started a second later numbers its events above every id of the
    earlier one (an upgrade's successor, a restart); replay gives what a client
    missed, [] when it missed nothing, and None (reset) for an id it no longer
    holds or never gave."""
    first = EventLog(Clock(), started=1_796_000_000.5, size=3)
    second = EventLog(Clock(), started=1_796_000_001.0)
    for n in range(5):
        first(StopStage(float(n), "drained"))
    second(StopStage(0.0, "drained"))
    assert second.last_id > first.last_id
    last = first.last_id
    assert first.replay(last) == []
    assert [f.split(b"\n")[0] for f in first.replay(last - 2) or []] == [
        f"id: {last - 1}".encode(), f"id: {last}".encode()]
    assert first.replay(last - 3) is not None          # the oldest held is last - 2
    assert first.replay(last - 4) is None              # evicted from the ring of 3
    assert first.replay(second.last_id) is None        # another process's id


def test_reads_are_not_events_but_api_calls_are() -> None:
    """The page's own /status reads (GETs without a model) do not fill the ring;
    an API request's end does."""
    log = EventLog(Clock())
    base = log.last_id

    def ended(method: str, path: str, model: str | None) -> RequestEnded:
        return RequestEnded(1.0, request_id="r", method=method, path=path, client="c",
                            model=model, host=None, engine=None, status=200, bytes=1,
                            duration=0.1, outcome="completed")

    log(ended("GET", "/status", None))
    log(ended("GET", "/metrics", None))
    assert log.last_id == base
    log(ended("POST", "/v1/chat/completions", "m"))
    log(ended("POST", "/v1/chat/completions", None))        # a 400 without a model
    assert log.last_id == base + 2


def test_usage_is_found_at_the_end_of_a_json_body_or_a_stream() -> None:
    """OpenAI and Anthropic spellings; a stream's last usage wins; null or absent
    usage is None."""
    assert find_usage(b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9,'
                      b' "total_tokens": 12}}') == (3, 9)
    stream = (b'data: {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 7}}\n\n'
              b"data: [DONE]\n\n")
    assert find_usage(stream) == (4, 7)
    assert find_usage(b'{"usage": {"input_tokens": 5, "output_tokens": 2}}') == (5, 2)
    assert find_usage(b'{"usage": null, "x": {"prompt_tokens": 1}}') is None
    assert find_usage(b'{"choices": []}') is None
    assert find_usage(b'"usage": {"prompt_tokens": 1, "comple') is None   # cut short
