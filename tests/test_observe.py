"""The views in memory: the event log's ids, ring and replay; finding an engine's
usage at the end of a body or stream."""

from __future__ import annotations

from twisted.internet.task import Clock

from llmproxy.core.events import StopStage
from llmproxy.observe.eventstream import EventLog
from llmproxy.web.relay import find_usage


def test_ids_increase_across_generations_and_replay_knows_its_limits() -> None:
    """Ids of generation 2 are above every id of generation 1; replay gives what a
    client missed, [] when it missed nothing, and None (reset) for an id it no
    longer holds or never gave."""
    first, second = EventLog(Clock(), generation=1, size=3), EventLog(Clock(), generation=2)
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
