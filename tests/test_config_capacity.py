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


def test_an_engine_s_own_idle_stop_seconds() -> None:
    """engines.E.idle_stop_seconds is E's TTL (default: none of its own); it must be > 0."""
    engines = {"big": {"command": ["x"], "idle_stop_seconds": 60},
               "small": {"command": ["y"]}}
    host = parse_config({"hosts": [{**MANAGED, "engines": engines}]}).hosts[0]
    assert (host.engines["big"].idle_stop_seconds, host.engines["small"].idle_stop_seconds) \
        == (60.0, None)
    for bad in (0, -5, "60", None):
        engines = {"big": {"command": ["x"], "idle_stop_seconds": bad}}
        assert errors_of({"hosts": [{**MANAGED, "engines": engines}]}) == [
            "hosts[0].engines.big.idle_stop_seconds: must be a number > 0"]


def test_a_changed_limit_is_refused_by_a_reload() -> None:
    """The host keys are read at start-up: a reload names them as restart-only."""
    from llmproxy.lifecycle.reload import refused_changes

    old = parse_config({"hosts": [MANAGED]})
    new = parse_config({"hosts": [{**MANAGED, "max_concurrent": 2}]})
    assert refused_changes(old, new) == ["hosts[0].max_concurrent changed: restart to apply"]


HOSTS = [MANAGED, {"name": "gpu2", "url": "http://10.0.0.6:8081", "ssh": "llm@10.0.0.6",
                   "engines": {"big": {"command": ["x"]}, "small": {"command": ["y"]}}},
         {"name": "laptop", "url": "http://10.0.0.7:11434"}]


def test_a_model_may_name_several_hosts_and_an_affinity() -> None:
    """`hosts` instead of `host`: every host kept in order (host is the first); the
    engine applies on the managed ones; affinity as given."""
    config = parse_config({"hosts": HOSTS, "models": {
        "big": {"hosts": ["gpu2", "gpu1", "laptop"], "engine": "big",
                "affinity": "header:X-Session-Id"},
        "plain": {"host": "laptop", "affinity": "body:user"}}})
    big = config.models["big"]
    assert (big.host, big.hosts, big.engine, big.affinity) == (
        "gpu2", ("gpu2", "gpu1", "laptop"), "big", "header:X-Session-Id")
    assert config.models["plain"].hosts == ("laptop",)
    assert config.models["plain"].affinity == "body:user"


@pytest.mark.parametrize(("model", "errors"), [
    ({"host": "gpu1", "hosts": ["gpu1"], "engine": "big"},
     ['models.m.hosts: give "host" or "hosts", not both']),
    ({"hosts": []}, ["models.m.hosts: must be a non-empty list of host names"]),
    ({"hosts": "gpu1"}, ["models.m.hosts: must be a non-empty list of host names"]),
    ({"hosts": ["laptop", "gpu9"]}, ["models.m.hosts[1]: no host named 'gpu9'"]),
    ({"hosts": ["laptop", "laptop"]}, ["models.m.hosts[1]: duplicate of hosts[0]"]),
    ({"hosts": ["laptop", "gpu1"]}, ["models.m.engine: required: host 'gpu1' is managed"]),
    ({"hosts": ["gpu1", "gpu2"], "engine": "small"},
     ["models.m.engine: host 'gpu1' has no engine 'small'"]),
    ({"hosts": ["laptop"], "engine": "big"}, ["models.m.engine: host 'laptop' has no engines"]),
    ({"host": "laptop", "affinity": "cookie:x"},
     ['models.m.affinity: must be "header:NAME" or "body:FIELD" (e.g. "header:X-Session-Id")']),
    ({"host": "laptop", "affinity": "header:"},
     ['models.m.affinity: must be "header:NAME" or "body:FIELD" (e.g. "header:X-Session-Id")']),
])
def test_bad_model_hosts_and_affinity_name_the_field(model: dict[str, Any],
                                                     errors: list[str]) -> None:
    """Each mistake is reported by field."""
    assert errors_of({"hosts": HOSTS, "models": {"m": model}}) == errors


def test_a_models_hosts_and_affinity_are_reloadable() -> None:
    """They are part of `models`: a reload applies them."""
    from llmproxy.lifecycle.reload import applied_changes, refused_changes

    old = parse_config({"hosts": HOSTS, "models": {"m": {"host": "laptop"}}})
    new = parse_config({"hosts": HOSTS, "models": {"m": {"hosts": ["laptop", "gpu1"],
                                                          "engine": "big",
                                                          "affinity": "body:user"}}})
    assert refused_changes(old, new) == []
    assert applied_changes(old, new) == ["models (~m)"]
