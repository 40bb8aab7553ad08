"""The event hub: synchronous delivery in order, a raising subscriber logged and
kept without hurting the publisher or the others, and each event's log line."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager

from twisted.logger import capturedLogs, formatEvent

from llmproxy.core.events import (
    EngineSwitch,
    Event,
    IdleStop,
    ReloadDone,
    RequestEnded,
    RequestRouted,
    RosterRead,
    StopStage,
    UpgradeStage,
)
from llmproxy.core.hub import Hub


@contextmanager
def only_our_logs() -> Iterator[list[dict[str, object]]]:
    """capturedLogs with nothing of earlier tests in it: their garbage collected
    first, and no collection while capturing (a suspended coroutine another test
    left behind runs its finally blocks when collected, and those may log)."""
    gc.collect()
    gc.disable()
    try:
        with capturedLogs() as events:
            yield events
    finally:
        gc.enable()


def routed(n: int = 1) -> RequestRouted:
    return RequestRouted(1.5, request_id=f"r-{n}", method="POST", path="/v1/chat/completions",
                         model="m", host="gpu1", engine="big", streaming=True)


def test_delivery_is_synchronous_and_in_subscription_order() -> None:
    """publish() returns after every subscriber has the event, each in the order
    it subscribed; an unsubscribed one gets nothing more."""
    hub = Hub()
    seen: list[tuple[str, str]] = []
    hub.subscribe(lambda e: seen.append(("a", e.type)))
    unsubscribe = hub.subscribe(lambda e: seen.append(("b", e.type)))
    hub.publish(routed())
    assert seen == [("a", "request.start"), ("b", "request.start")]
    unsubscribe()
    hub.publish(StopStage(2.0, "drained"))
    assert seen[-1] == ("a", "stop") and len(seen) == 3


def test_a_raising_subscriber_is_logged_and_kept() -> None:
    """The publisher never sees the error; later subscribers still get the event;
    each failure is logged and the subscriber that raised still gets the next
    event (one bad event does not turn a view off for good)."""
    hub = Hub()
    calls: list[str] = []

    def broken(event: Event) -> None:
        calls.append("broken")
        raise RuntimeError("boom")

    hub.subscribe(broken)
    hub.subscribe(lambda e: calls.append("after"))
    with only_our_logs() as events:
        hub.publish(routed(1))
        hub.publish(routed(2))
    assert calls == ["broken", "after", "broken", "after"]
    failures = [e for e in events if e.get("log_failure") is not None]
    assert len(failures) == 2 and failures[0]["log_failure"].check(RuntimeError)
    assert "raised on request.start: kept" in formatEvent(failures[0])


def test_events_are_json_values_with_their_type() -> None:
    """fields() is plain JSON with `type` and `time`, as the event stream sends it."""
    doc = routed().fields()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["type"] == "request.start" and doc["time"] == 1.5
    assert doc["request_id"] == "r-1" and doc["host"] == "gpu1" and doc["engine"] == "big"


def test_the_log_subscriber_writes_each_line_in_its_namespace() -> None:
    """Hub.logging() logs the lines the proxy always logged; the access line in
    llmproxy.access, at warn unless the request completed; silent events nothing."""
    hub = Hub.logging()
    end = RequestEnded(3.0, request_id="ab-1", method="POST", path="/v1/chat/completions",
                       client="10.0.0.1", model="coder", host="gpu1", engine=None, status=200,
                       bytes=5342, duration=2.1134, outcome="completed", ttfb=0.0512,
                       prompt_tokens=12, completion_tokens=48)
    with only_our_logs() as events:
        hub.publish(routed())
        hub.publish(end)
        hub.publish(RequestEnded(3.0, request_id="ab-2", method="POST", path="/v1/x",
                                 client="c", model=None, host=None, engine=None, status=None,
                                 bytes=0, duration=1.0, outcome="client-gone"))
        hub.publish(RosterRead(1.0, "gpu1", "failed", 3, error="refused"))
        hub.publish(RosterRead(1.0, "gpu1", "ok", 4, 2))
        hub.publish(EngineSwitch(1.0, "gpu1", "waiting", "small", "big", waiting_for=2,
                                 reason="busy"))
        hub.publish(EngineSwitch(1.0, "gpu1", "done", "small", "big", elapsed=3.25))
        hub.publish(IdleStop(1.0, "gpu1", "failed", "big", reason="agent gone"))
        hub.publish(ReloadDone(1.0, "kept", "reload: kept the running config: x", 1))
        hub.publish(UpgradeStage(1.0, "failed", 10, 11, 2, reason="candidate pid 11 died"))
    lines = [(e["log_namespace"], e["log_level"].name, formatEvent(e)) for e in events]
    assert lines == [
        ("llmproxy.access", "info", "ab-1 POST /v1/chat/completions model=coder host=gpu1 "
                                    "status=200 bytes=5342 duration=2.113s ttfb=0.051s "
                                    "outcome=completed tokens=12+48"),
        ("llmproxy.access", "warn", "ab-2 POST /v1/x model=- host=- status=- bytes=0 "
                                    "duration=1.000s ttfb=- outcome=client-gone"),
        ("llmproxy.events", "warn", "roster of gpu1: read 3 failed: refused"),
        ("llmproxy.events", "info", "switching gpu1 from big to small: waiting for 2 "
                                    "request(s) on big"),
        ("llmproxy.events", "info", "engine small on gpu1 ready in 3.2s"),
        ("llmproxy.events", "warn", "idle stop of big on gpu1 failed: agent gone"),
        ("llmproxy.events", "warn", "reload: kept the running config: x"),
        ("llmproxy.events", "warn", "upgrade: failed, this process keeps serving: "
                                    "candidate pid 11 died"),
    ]
    assert events[0]["llmproxy_event"] == "request.end" and events[0]["event"].bytes == 5342
