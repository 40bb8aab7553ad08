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


def test_defaults_no_limit_a_queue_of_100_a_minute_a_residency_of_30_s() -> None:
    """A host without the keys: no concurrency limit, max_queue 100, a 60 s queue
    timeout, 30 s of residency after a switch; an engine has no limit of its own.
    `min_engine_seconds: 0` turns the residency off."""
    host = parse_config({"hosts": [MANAGED]}).hosts[0]
    assert (host.max_concurrent, host.max_queue, host.queue_timeout_seconds,
            host.min_engine_seconds) == (None, 100, 60.0, 30.0)
    off = parse_config({"hosts": [{**MANAGED, "min_engine_seconds": 0}]}).hosts[0]
    assert off.min_engine_seconds == 0.0
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
     ['models.m.affinity: must be "header:NAME", "body:FIELD" or "prefix" '
      '(e.g. "header:X-Session-Id")']),
    ({"host": "laptop", "affinity": "prefix:x"},
     ['models.m.affinity: must be "header:NAME", "body:FIELD" or "prefix" '
      '(e.g. "header:X-Session-Id")']),
    ({"host": "laptop", "affinity": "header:"},
     ['models.m.affinity: must be "header:NAME", "body:FIELD" or "prefix" '
      '(e.g. "header:X-Session-Id")']),
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


BUDGETED = {"name": "gpu1", "url": "http://10.0.0.5:8081", "ssh": "llm@10.0.0.5",
            "memory_gb": 80, "engines": {
                "chat": {"command": ["x"], "memory_gb": 40},
                "embed": {"command": ["y"], "memory_gb": 4, "url": "http://10.0.0.5:8082/"}},
            "preload": ["chat", "embed"]}


def test_a_budgeted_host_and_its_engines() -> None:
    """memory_gb on the host and each engine, an engine's own url (normalised), a
    preload list; a host without memory_gb runs one engine at a time."""
    host = parse_config({"hosts": [BUDGETED]}).hosts[0]
    assert (host.memory_gb, host.budgeted, host.preload) == (80.0, True, ("chat", "embed"))
    assert host.engine_url("chat") == "http://10.0.0.5:8081"
    assert host.engine_url("embed") == "http://10.0.0.5:8082"
    plain = parse_config({"hosts": [MANAGED]}).hosts[0]
    assert (plain.memory_gb, plain.budgeted, plain.preload) == (None, False, ())


@pytest.mark.parametrize(("change", "error"), [
    ({"engines": {"chat": {"command": ["x"]}, "embed": BUDGETED["engines"]["embed"]}},
     "hosts[0].preload: chat, embed need 84 GB together, more than the host's memory_gb (80)"),
    ({"engines": {"chat": {"command": ["x"], "memory_gb": 90},
                  "embed": BUDGETED["engines"]["embed"]}, "preload": "embed"},
     "hosts[0].engines.chat.memory_gb: 90 is more than the host's memory_gb (80)"),
    ({"engines": {"chat": BUDGETED["engines"]["chat"],
                  "embed": {"command": ["y"], "memory_gb": 4}}},
     "hosts[0].engines.embed.url: the same as engine chat's (http://10.0.0.5:8081): engines "
     "that run together need their own url"),
    ({"preload": ["chat", "chat"]}, "hosts[0].preload: names an engine twice"),
    ({"memory_gb": 41},
     "hosts[0].preload: chat, embed need 44 GB together, more than the host's memory_gb (41)"),
    ({"memory_gb": 0}, "hosts[0].memory_gb: must be a number > 0"),
])
def test_llmproxy_check_names_each_budget_error(change: dict[str, Any], error: str) -> None:
    assert error in errors_of({"hosts": [{**BUDGETED, **change}]})


def test_an_engine_s_memory_needs_the_host_s_budget() -> None:
    engines = {"big": {"command": ["x"], "memory_gb": 4}}
    assert errors_of({"hosts": [{**MANAGED, "engines": engines}]}) == [
        "hosts[0].engines.big.memory_gb: needs the host's memory_gb (without it the host "
        "runs one engine at a time)"]


def test_check_exits_78_naming_a_budget_error(tmp_path: Any,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`llmproxy check` on such a file: exit 78 (EX_CONFIG), the field named."""
    import json

    from llmproxy.cli import main
    path = tmp_path / "hosts.json"
    bad = {**BUDGETED, "engines": {**BUDGETED["engines"],
                                   "big": {"command": ["z"], "memory_gb": 81}}}
    path.write_text(json.dumps({"hosts": [bad]}))
    assert main(["check", "-c", str(path)]) == 78
    assert "hosts[0].engines.big.memory_gb: 81 is more than the host's memory_gb (80)" in \
        capsys.readouterr().err


def test_an_engine_of_a_budgeted_host_may_leave_memory_out() -> None:
    """Without memory_gb an engine is valid on a budgeted host (it counts for the whole
    budget until measured: hosts/measured.py)."""
    engines = {**BUDGETED["engines"], "big": {"command": ["z"], "url": "http://10.0.0.5:8083"}}
    host = parse_config({"hosts": [{**BUDGETED, "engines": engines}]}).hosts[0]
    assert host.engines["big"].memory_gb is None


def test_schedule_defaults_to_batch_with_30_s_of_max_wait_and_names_a_bad_value() -> None:
    """`schedule` is "batch" or "arrival" (hosts/batching.py); `max_wait_seconds` >= 0."""
    host = parse_config({"hosts": [MANAGED]}).hosts[0]
    assert (host.schedule, host.max_wait_seconds) == ("batch", 30.0)
    given = parse_config({"hosts": [{**MANAGED, "schedule": "arrival",
                                     "max_wait_seconds": 5}]}).hosts[0]
    assert (given.schedule, given.max_wait_seconds) == ("arrival", 5.0)
    errors = errors_of({"hosts": [{**MANAGED, "schedule": "fifo", "max_wait_seconds": -1}]})
    assert any(e.startswith("hosts[0].schedule: must be one of arrival, batch") for e in errors)
    assert any(e.startswith("hosts[0].max_wait_seconds") for e in errors), errors
