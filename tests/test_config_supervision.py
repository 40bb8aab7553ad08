"""An engine's supervision keys in hosts.json (`restart`, `unhealthy_seconds`):
their defaults, their values, an error naming the field for every bad one, and
a reload that changes one refused like any other engine key."""

from __future__ import annotations

import math
from typing import Any

import pytest

from llmproxy.config import ConfigError, parse_config
from llmproxy.lifecycle.reload import refused_changes


def hosts(**engine: Any) -> dict[str, Any]:
    return {"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081", "ssh": "llm@10.0.0.5",
                       "engines": {"big": {"command": ["llama-server"], **engine}}}]}


def errors_of(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(obj)
    return list(info.value.errors)


def test_defaults_restart_on_failure_and_30_s_unhealthy() -> None:
    """Without the keys an engine is restarted after a crash and hung after 30 s."""
    engine = parse_config(hosts()).hosts[0].engines["big"]
    assert (engine.restart, engine.unhealthy_seconds) == ("on-failure", 30.0)


@pytest.mark.parametrize(("restart", "seconds"), [("never", 2), ("on-failure", 0.5)])
def test_given_values_land_in_the_engine(restart: str, seconds: float) -> None:
    engine = parse_config(hosts(restart=restart, unhealthy_seconds=seconds)).hosts[0] \
        .engines["big"]
    assert (engine.restart, engine.unhealthy_seconds) == (restart, seconds)


@pytest.mark.parametrize("value", ["always", "", "Never", None, True, 1, ["never"]])
def test_a_bad_restart_names_the_field(value: object) -> None:
    assert errors_of(hosts(restart=value)) == [
        'hosts[0].engines.big.restart: must be "on-failure" or "never"']


@pytest.mark.parametrize("value", [0, -1, True, "30", None, math.inf, math.nan])
def test_a_bad_unhealthy_seconds_names_the_field(value: object) -> None:
    assert errors_of(hosts(unhealthy_seconds=value)) == [
        "hosts[0].engines.big.unhealthy_seconds: must be a number > 0"]


def test_a_reload_that_changes_them_is_refused() -> None:
    """Engines are part of their host: a change of either key needs a restart."""
    old = parse_config(hosts())
    for change in ({"restart": "never"}, {"unhealthy_seconds": 5}):
        assert refused_changes(old, parse_config(hosts(**change))) == [
            "hosts[0].engines changed: restart to apply"]
