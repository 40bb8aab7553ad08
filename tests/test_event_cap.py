"""The cap on `/api/events` subscribers (`max_event_subscribers`), through the
real Site in memory (task.Clock, fake upstream): the subscriber past the cap
gets a 503 with Retry-After and an OpenAI-style error, and a freed slot is
taken again; and the key is validated by field."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from llmproxy.config import ConfigError, parse_config
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.reload import refused_changes
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.fakes import Connection, FakeHTTPClient

BASE = {"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}]}


def make(cap: int) -> LLMProxyService:
    return build_service(ServiceInputs(parse_config({**BASE, "max_event_subscribers": cap}),
                                       Clock(), http=FakeHTTPClient()))


def subscribe(svc: LLMProxyService) -> Connection:
    conn = Connection(svc.site, "127.0.0.1")
    conn.send("GET", "/api/events")
    return conn


def test_the_subscriber_past_the_cap_gets_503_and_a_freed_slot_is_reused() -> None:
    """With max_event_subscribers 3, three streams open (200, text/event-stream);
    the fourth is a whole 503 too_many_subscribers with Retry-After, naming the
    key, and holds no slot; when one of the three leaves, the next one gets a
    stream."""
    svc = make(3)
    streams = [subscribe(svc) for _ in range(3)]
    for conn in streams:
        head = conn.response()
        assert head.status == 200 and head.headers["content-type"] == "text/event-stream"
    assert svc.events.streams == 3
    refused = subscribe(svc).response()
    assert refused.status == 503 and refused.complete
    assert refused.headers["retry-after"] == "5"
    assert refused.headers["content-type"] == "application/json"
    error = refused.json()["error"]
    assert error["code"] == "too_many_subscribers" and error["type"] == "service_unavailable"
    assert "at most 3 at once" in error["message"] and "max_event_subscribers" in error["message"]
    assert svc.events.streams == 3
    streams[1].disconnect()
    assert svc.events.streams == 2
    again = subscribe(svc)
    assert again.response().status == 200 and svc.events.streams == 3
    assert subscribe(svc).response().status == 503


def test_the_default_cap_is_64() -> None:
    """Without the key, 64 streams are served and the 65th is refused."""
    svc = build_service(ServiceInputs(parse_config(BASE), Clock(), http=FakeHTTPClient()))
    assert svc.runtime.config.max_event_subscribers == 64
    held = [subscribe(svc) for _ in range(64)]
    assert all(conn.response().status == 200 for conn in held)
    assert subscribe(svc).response().status == 503


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8", None])
def test_max_event_subscribers_is_a_positive_integer(value: object) -> None:
    """Anything but a positive integer is an error naming the key."""
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "max_event_subscribers": value})
    assert info.value.errors == ("max_event_subscribers: must be a positive integer",)


def test_a_reload_that_changes_the_cap_is_refused_by_name() -> None:
    """max_event_subscribers is not reloadable: a change refuses the reload, naming it."""
    old, new = (parse_config({**BASE, "max_event_subscribers": n}) for n in (8, 16))
    assert refused_changes(old, new) == ["max_event_subscribers changed: restart to apply"]
