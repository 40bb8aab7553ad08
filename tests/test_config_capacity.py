"""The capacity keys of hosts.json: their defaults, their values, and an error
naming the field for every bad one."""

from __future__ import annotations

from typing import Any

import pytest

from llmproxy.config import ConfigError, parse_config

MANAGED = {"name": "gpu1", "url": "http://10.0.0.5:8081", "ssh": "llm@10.0.0.5",
           "engines": {"big": {"command": ["llama-server"]}}}


def errors_of(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(obj)
    return list(info.value.errors)


def test_defaults_no_limit_a_queue_of_100_a_minute_no_residency() -> None:
    """A host without the keys: no concurrency limit, max_queue 100, a 60 s queue
    timeout, no residency; an engine has no limit of its own."""
    host = parse_config({"hosts": [MANAGED]}).hosts[0]
    assert (host.max_concurrent, host.max_queue, host.queue_timeout_seconds,
            host.min_engine_seconds) == (None, 100, 60.0, 0.0)
    assert host.engines["big"].max_concurrent is None


def test_every_key_given() -> None:
    """Given values land in HostConfig and EngineConfig."""
    engines = {"big": {"command": ["llama-server"], "max_concurrent": 1}}
    host = parse_config({"hosts": [{**MANAGED, "engines": engines, "max_concurrent": 4,
                                    "max_queue": 7, "queue_timeout_seconds": 2.5,
                                    "min_engine_seconds": 30}]}).hosts[0]
    assert (host.max_concurrent, host.max_queue, host.queue_timeout_seconds,
            host.min_engine_seconds) == (4, 7, 2.5, 30.0)
    assert host.engines["big"].max_concurrent == 1


@pytest.mark.parametrize(("key", "value", "message"), [
    ("max_concurrent", 0, "must be a positive integer"),
    ("max_concurrent", 1.5, "must be a positive integer"),
    ("max_concurrent", True, "must be a positive integer"),
    ("max_queue", 0, "must be a positive integer"),
    ("max_queue", "10", "must be a positive integer"),
    ("queue_timeout_seconds", 0, "must be a number > 0"),
    ("queue_timeout_seconds", None, "must be a number > 0"),
    ("min_engine_seconds", -1, "must be a number >= 0"),
])
def test_bad_host_values_name_the_field(key: str, value: object, message: str) -> None:
    """Each bad value is an error naming hosts[i].KEY."""
    assert errors_of({"hosts": [{**MANAGED, key: value}]}) == [f"hosts[0].{key}: {message}"]


def test_a_bad_engine_limit_names_the_field() -> None:
    """engines.E.max_concurrent must be a positive integer too."""
    engines = {"big": {"command": ["x"], "max_concurrent": 0}}
    assert errors_of({"hosts": [{**MANAGED, "engines": engines}]}) == [
        "hosts[0].engines.big.max_concurrent: must be a positive integer"]


def test_a_changed_limit_is_refused_by_a_reload() -> None:
    """The host keys are read at start-up: a reload names them as restart-only."""
    from llmproxy.lifecycle.reload import refused_changes

    old = parse_config({"hosts": [MANAGED]})
    new = parse_config({"hosts": [{**MANAGED, "max_concurrent": 2}]})
    assert refused_changes(old, new) == ["hosts[0].max_concurrent changed: restart to apply"]
