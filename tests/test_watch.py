"""HostWatch on a clock with fake streams: events handed on and remembered
(health, GPUs), the session reopened with backoff when it breaks, the host
unreachable meanwhile, and a stable session resetting the backoff."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from llmproxy.agent.protocol import AgentEvent, Exit, Gpu, Health, Hello, decode
from llmproxy.config import EngineConfig, HostConfig
from llmproxy.hosts.agentstream import StreamEnded
from llmproxy.hosts.watch import GPUS_STALE, HostWatch

HOST = HostConfig("gpu1", "http://10.0.0.5:8081", ssh="llm@10.0.0.5",
                  engines={"big": EngineConfig("big", ("llama-server",))})


class FakeStream:
    def __init__(self, order: dict[str, Any], on_event: Any) -> None:
        self.order, self._on_event = order, on_event
        self.ended: Deferred[StreamEnded] = Deferred()
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def on_event(self, doc: dict[str, Any]) -> None:
        """An event line as the agent writes it, decoded as the real stream does."""
        self._on_event(decode(doc))


def make() -> tuple[HostWatch, Clock, list[FakeStream], list[tuple[str, AgentEvent]]]:
    clock, streams, events = Clock(), [], []

    def open_stream(host: HostConfig, order: dict[str, Any], on_event: Any) -> Any:
        streams.append(FakeStream(order, on_event))
        return streams[-1]

    watch = HostWatch(HOST, clock, open_stream, lambda h, e: events.append((h, e)))  # type: ignore[arg-type]
    return watch, clock, streams, events


def test_events_are_handed_on_and_remembered() -> None:
    watch, _, streams, events = make()
    watch.start()
    assert streams[0].order["op"] == "watch" and not watch.connected
    streams[0].on_event({"event": "hello", "protocol": 4,
                         "engines": [{"engine": "big", "healthy": True}]})
    streams[0].on_event({"event": "gpu", "gpus": [{"index": 0, "memory_used_bytes": 5}]})
    streams[0].on_event({"event": "health", "engine": "big", "healthy": False})
    assert watch.connected and watch.healthy == {"big": False}
    assert watch.gpus == [{"index": 0, "memory_used_bytes": 5}]
    assert [type(e) for _, e in events] == [Hello, Gpu, Health]
    streams[0].on_event({"event": "exit", "engine": "big", "signal": 9})
    assert watch.healthy == {} and events[-1] == ("gpu1", Exit("big", signal=9))


def test_a_broken_session_reopens_with_backoff_and_the_host_is_down_meanwhile() -> None:
    watch, clock, streams, _ = make()
    watch.start()
    streams[0].on_event({"event": "tick"})
    clock.advance(5)
    streams[0].ended.callback(StreamEnded("agent on gpu1: exit status 255"))
    assert not watch.connected and watch.down_since == 5
    assert watch.snapshot(7.0)["down_seconds"] == 2.0
    delays = []
    for _ in range(4):
        before = len(streams)
        while len(streams) == before:
            clock.advance(0.5)
        delays.append(clock.seconds())
        streams[-1].ended.callback(StreamEnded("agent on gpu1: connection refused"))
    assert [b - a for a, b in zip([5.0, *delays[:-1]], delays, strict=True)] == \
        [1.0, 2.0, 4.0, 8.0]


def test_a_session_that_lived_a_minute_resets_the_backoff() -> None:
    watch, clock, streams, _ = make()
    watch.start()
    streams[0].ended.callback(StreamEnded("x"))
    clock.advance(1)
    streams[1].ended.callback(StreamEnded("x"))        # second failure: 2 s
    clock.advance(2)
    clock.advance(60)
    streams[2].ended.callback(StreamEnded("x"))        # lived 60 s: 1 s again
    clock.advance(1)
    assert len(streams) == 4


def test_stop_ends_the_session_and_opens_no_other() -> None:
    watch, clock, streams, _ = make()
    watch.start()
    watch.stop()
    assert streams[0].stopped
    streams[0].ended.callback(StreamEnded("x"))
    clock.advance(120)
    assert len(streams) == 1


def test_gpu_figures_that_stop_coming_are_no_longer_shown() -> None:
    """An nvidia-smi that stops answering (the agent warns once and sends no more
    gpu events) leaves no figures in the snapshot once they are stale."""
    watch, clock, streams, _ = make()
    watch.start()
    streams[0].on_event({"event": "gpu", "gpus": [{"index": 0, "memory_used_bytes": 5}]})
    clock.advance(GPUS_STALE)
    assert watch.snapshot(clock.seconds())["gpus"] == [{"index": 0, "memory_used_bytes": 5}]
    clock.advance(1)
    assert watch.snapshot(clock.seconds())["gpus"] == []
    streams[0].on_event({"event": "gpu", "gpus": [{"index": 0, "memory_used_bytes": 6}]})
    assert watch.snapshot(clock.seconds())["gpus"] == [{"index": 0, "memory_used_bytes": 6}]
