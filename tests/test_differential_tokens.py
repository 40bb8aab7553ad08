"""Token timing is measured alike on both paths (issue 49, item 3): the same
engine stream, read by the reference relay (web/relay.py) and by the fast one
(speedups/relaychunks.py), gives the same TokensTimed (tokens, gaps observed,
usage, prompt rate) and the same /metrics series. Harness: tests/differential.py
(two proxies in this process, a scripted engine writing each piece a few
reactor turns apart, so each is a read of its own)."""

from __future__ import annotations

import json

import pytest
import pytest_twisted
from prometheus_client.parser import text_string_to_metric_families

from llmproxy.core.events import Event
from llmproxy.core.tokens import TokensTimed
from tests.differential import Rig, Script, exchange

pytestmark = pytest.mark.integration

HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(doc: object) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


ROLE = event({"choices": [{"delta": {"role": "assistant", "content": None}}]})
TOKEN = event({"choices": [{"delta": {"content": "tok"}}]})
LAST = event({"choices": [{"delta": {}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 12, "completion_tokens": 6},
              "timings": {"prompt_n": 12, "prompt_ms": 24.0, "prompt_per_second": 500.0}})
PIECES = [HEAD + chunk(ROLE), chunk(TOKEN), chunk(TOKEN * 2), chunk(TOKEN), chunk(TOKEN),
          chunk(TOKEN + LAST), chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"]
REQUEST = json.dumps({"model": "m", "stream": True}).encode()


@pytest_twisted.ensureDeferred
async def test_both_paths_time_a_stream_alike(rig: Rig) -> None:
    """Six token events in five reads: four gaps, usage's 6 output tokens,
    the prompt rate of `timings`; the same on both paths, and in /metrics."""
    timed: dict[str, list[TokensTimed]] = {name: [] for name in rig.proxies}
    for name, proxy in rig.proxies.items():
        def heard(e: Event, into: list[TokensTimed] = timed[name]) -> None:
            if isinstance(e, TokensTimed):
                into.append(e)
        proxy.service.parts.hub.subscribe(heard)
        outcome = await exchange(rig, name, [
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(REQUEST), REQUEST)], Script(PIECES, close=True))
        assert outcome.ended[0].outcome == "completed"
        proxy.service.parts.hub.unsubscribe(heard)
    seen = {}
    for name, events in timed.items():
        (e,) = events
        assert e.first_token is not None and e.engine_first_token is not None
        assert 0 <= e.engine_first_token <= e.first_token
        assert e.output_per_second is not None and e.output_per_second > 0
        seen[name] = (e.model, e.host, e.streaming, e.tokens, e.output_tokens, sum(e.gaps),
                      e.prompt_per_second)
        text = rig.proxies[name].service.parts.metrics.exposition().decode()
        counts = {(s.name, s.labels.get("model"), s.labels.get("host")): s.value
                  for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name.endswith("_count")}
        for family in ("time_to_first_token_seconds", "engine_time_to_first_token_seconds",
                       "output_tokens_per_second", "prompt_tokens_per_second"):
            assert counts[(f"llmproxy_{family}_count", "m", "gpu1")] >= 1
        assert counts[("llmproxy_inter_token_gap_seconds_count", "m", "gpu1")] >= 4
    assert seen["reference"] == seen["speedups"] == ("m", "gpu1", True, 6, 6, 4, 500.0)
