"""Tests for llmproxy.config: the config file parsed into a frozen, strictly validated value."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmproxy.config import (
    DEFAULT_SSH_COMMAND,
    Config,
    ConfigError,
    EngineConfig,
    HostConfig,
    ListenAddress,
    ModelConfig,
    load_config,
    parse_config,
    summary,
)
from llmproxy.config.parse import LISTEN_ERROR

EXAMPLE = Path(__file__).resolve().parent.parent / "etc" / "hosts.example.json"


def _host(config: Config, name: str) -> HostConfig:
    return next(h for h in config.hosts if h.name == name)


def valid() -> dict[str, Any]:
    """A small valid config: one managed host, one forward-only host, two models, one alias."""
    return {
        "hosts": [
            {
                "name": "gpu1",
                "url": "http://10.0.0.5:8081",
                "ssh": "llm@10.0.0.5",
                "engines": {"big": {"command": ["llama-server", "-m", "big.gguf"]}},
            },
            {"name": "laptop", "url": "http://10.0.0.7:11434"},
        ],
        "models": {
            "qwen": {"host": "gpu1", "engine": "big"},
            "mistral": {"host": "laptop"},
        },
        "aliases": {"coder": "qwen"},
    }


def errors_of(obj: object) -> list[str]:
    """The error messages parse_config raises for `obj` (fails the test if it parses)."""
    with pytest.raises(ConfigError) as info:
        parse_config(obj)
    assert str(info.value) == "\n".join(info.value.errors)
    return list(info.value.errors)


def changed(path: str, value: Any) -> dict[str, Any]:
    """valid() with the item at a dotted path (list indexes as numbers) set to `value`."""
    config = valid()
    *parents, last = path.split(".")
    target: Any = config
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target.setdefault(part, {})
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return config


def removed(path: str) -> dict[str, Any]:
    """valid() without the item at a dotted path."""
    config = valid()
    *parents, last = path.split(".")
    target: Any = config
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    del target[last]
    return config


# -- defaults and the shape of the value ---------------------------------------------------


def test_defaults() -> None:
    """A config giving only hosts gets every documented default."""
    config = parse_config({"hosts": [{"name": "h", "url": "http://h:1"}]})
    assert config.listen == ListenAddress("127.0.0.1", 8080)
    assert dict(config.models) == {}
    assert dict(config.aliases) == {}
    assert config.naming == "plain"
    assert config.drain_seconds == 120.0
    assert config.prestop_seconds == 0.0
    assert config.idle_stop_seconds == 900.0
    assert config.refresh_seconds == 600.0
    assert config.max_body_bytes == 16 * 1024 * 1024
    assert config.connect_timeout_seconds == 10.0
    assert config.header_timeout_seconds == 600.0
    assert config.roster_timeout_seconds == 5.0
    assert config.client_header_timeout_seconds == 10.0
    assert config.client_idle_timeout_seconds == 120.0
    assert config.client_body_timeout_seconds == 30.0
    assert config.client_write_stall_seconds == 60.0
    assert config.ssh_command == DEFAULT_SSH_COMMAND
    assert DEFAULT_SSH_COMMAND == ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
    assert config.runtime_dir is None
    host = config.hosts[0]
    assert host == HostConfig("h", "http://h:1")
    assert host.ssh is None
    assert host.agent == ()   # the proxy brings its own agent (hosts/agentbundle.py)
    assert dict(host.engines) == {}
    assert not host.managed


def test_engine_and_model_defaults() -> None:
    """Engines default to health /health and a 120 s start timeout; upstream defaults to the key."""
    config = parse_config(valid())
    engine = _host(config, "gpu1").engines["big"]
    assert engine == EngineConfig("big", ("llama-server", "-m", "big.gguf"), "/health", 120.0)
    assert _host(config, "gpu1").managed
    assert config.models["qwen"] == ModelConfig("qwen", "gpu1", "big", "qwen", None)
    assert config.models["mistral"].upstream == "mistral"
    assert config.models["mistral"].engine is None
    assert ModelConfig("direct", "h").upstream == "direct"


def test_every_field_given() -> None:
    """Every key, when given a valid value, lands in the value as given (numbers as floats)."""
    obj = valid()
    obj.update(
        listen="[::1]:9000",
        naming="host",
        drain_seconds=0,
        prestop_seconds=2.5,
        idle_stop_seconds=60,
        refresh_seconds=30,
        max_body_bytes=1024,
        connect_timeout_seconds=3,
        header_timeout_seconds=90,
        roster_timeout_seconds=1.5,
        client_header_timeout_seconds=2,
        client_idle_timeout_seconds=5,
        client_body_timeout_seconds=3.5,
        client_write_stall_seconds=0.5,
        ssh_command=["ssh", "-F", "/etc/llmproxy/ssh_config"],
        runtime_dir="/run/llmproxy",
    )
    obj["hosts"][0]["agent"] = "/opt/llmproxy/bin/llmproxy-agent --log 'a b'"
    obj["hosts"][0]["engines"]["big"].update(health="/v1/models", start_timeout_seconds=300)
    obj["models"]["qwen"].update(upstream="qwen2.5-32b-instruct", ctx=32768)
    config = parse_config(obj)
    assert config.listen == ListenAddress("::1", 9000)
    assert config.naming == "host"
    assert (config.drain_seconds, config.prestop_seconds) == (0.0, 2.5)
    assert isinstance(config.drain_seconds, float)
    assert (config.idle_stop_seconds, config.refresh_seconds) == (60.0, 30.0)
    assert config.max_body_bytes == 1024
    assert config.connect_timeout_seconds == 3.0
    assert (config.header_timeout_seconds, config.roster_timeout_seconds) == (90.0, 1.5)
    assert (config.client_header_timeout_seconds, config.client_idle_timeout_seconds,
            config.client_body_timeout_seconds, config.client_write_stall_seconds) == (
                2.0, 5.0, 3.5, 0.5)
    assert config.ssh_command == ("ssh", "-F", "/etc/llmproxy/ssh_config")
    assert config.runtime_dir == "/run/llmproxy"
    gpu1 = _host(config, "gpu1")
    assert gpu1.agent == ("/opt/llmproxy/bin/llmproxy-agent", "--log", "a b")
    assert gpu1.engines["big"].health == "/v1/models"
    assert gpu1.engines["big"].start_timeout_seconds == 300.0
    assert config.models["qwen"] == ModelConfig(
        "qwen", "gpu1", "big", "qwen2.5-32b-instruct", 32768
    )


def test_agent_as_list() -> None:
    """`agent` may be a list of strings, taken word for word."""
    config = parse_config(changed("hosts.0.agent", ["python3", "-m", "llmproxy.agent x"]))
    assert _host(config, "gpu1").agent == ("python3", "-m", "llmproxy.agent x")


def test_file_order_kept() -> None:
    """Hosts, engines, models and aliases iterate in file order."""
    obj = valid()
    obj["hosts"][0]["engines"] = {n: {"command": ["x"]} for n in ("z", "a", "m")}
    obj["models"] = {n: {"host": "laptop"} for n in ("zeta", "alpha", "mu")}
    obj["aliases"] = {"z1": "mu", "a1": "zeta"}
    config = parse_config(obj)
    assert [h.name for h in config.hosts] == ["gpu1", "laptop"]
    assert list(_host(config, "gpu1").engines) == ["z", "a", "m"]
    assert list(config.models) == ["zeta", "alpha", "mu"]
    assert list(config.aliases) == ["z1", "a1"]


def test_equal_parses_are_equal() -> None:
    """Two parses of equal JSON compare equal, field by field; a changed value does not."""
    first, second = parse_config(valid()), parse_config(json.loads(json.dumps(valid())))
    assert first == second
    for f in dataclasses.fields(Config):
        assert getattr(first, f.name) == getattr(second, f.name), f.name
    assert parse_config(changed("models.qwen.ctx", 8192)) != first
    assert parse_config(changed("aliases.coder", "mistral")).aliases != first.aliases


def test_frozen() -> None:
    """Assigning fields or mutating the mappings and sequences inside a Config raises."""
    config = parse_config(valid())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.drain_seconds = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hosts[0].url = "http://elsewhere"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.models["qwen"].ctx = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.models["new"] = config.models["qwen"]  # type: ignore[index]
    with pytest.raises(TypeError):
        del config.aliases["coder"]  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        _host(config, "gpu1").engines["x"] = _host(config, "gpu1").engines["big"]  # type: ignore[index]
    assert isinstance(config.hosts, tuple)
    assert isinstance(_host(config, "gpu1").engines["big"].command, tuple)


def test_direct_construction_is_frozen_too() -> None:
    """Values built in code from dicts and lists are frozen copies, equal to parsed ones."""
    engines = {"big": EngineConfig("big", ["llama-server", "-m", "big.gguf"])}  # type: ignore[arg-type]
    gpu1 = HostConfig("gpu1", "http://10.0.0.5:8081", "llm@10.0.0.5", engines=engines)
    laptop = HostConfig("laptop", "http://10.0.0.7:11434")
    models = {
        "qwen": ModelConfig("qwen", "gpu1", "big"),
        "mistral": ModelConfig("mistral", "laptop"),
    }
    built = Config(ListenAddress("127.0.0.1", 8080), [gpu1, laptop], models, {"coder": "qwen"})  # type: ignore[arg-type]
    engines.clear()
    models.clear()
    assert built == parse_config(valid())
    with pytest.raises(TypeError):
        built.models["x"] = built.models["qwen"]  # type: ignore[index]


def test_listen_address_str() -> None:
    """ListenAddress prints as host:port, with brackets around IPv6 hosts."""
    assert str(ListenAddress("127.0.0.1", 8080)) == "127.0.0.1:8080"
    assert str(ListenAddress("::1", 8080)) == "[::1]:8080"


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:8080", "127.0.0.1", 8080),
        ("0.0.0.0:0", "0.0.0.0", 0),
        ("[::1]:8080", "::1", 8080),
        ("[::]:65535", "::", 65535),
        ("[0:0::1]:80", "::1", 80),
    ],
)
def test_listen_good(text: str, host: str, port: int) -> None:
    """`listen` accepts IPv4 host:port and bracketed IPv6, ports 0..65535."""
    assert parse_config(changed("listen", text)).listen == ListenAddress(host, port)


@pytest.mark.parametrize(
    "value",
    [
        "8080", "localhost", "localhost:http", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:",
        "::1:8080",
        "[127.0.0.1]:80", "[::1]8080", "[::1:80", "127.0.0.1:80 ", "127.0.0.1:+80", "1.2.3:80",
        "", 8080, None, ["127.0.0.1", 8080],
    ],
)  # fmt: skip
def test_listen_bad(value: object) -> None:
    """Anything but an IP address (or localhost) and a port 0..65535 is refused by
    name, the error saying what is accepted."""
    assert errors_of(changed("listen", value)) == [f"listen: {LISTEN_ERROR}"]
    assert LISTEN_ERROR.startswith("not a host:port address: the host is an IP address or "
                                   "localhost, e.g.")


def test_listen_localhost() -> None:
    """`localhost:PORT` listens on 127.0.0.1 (issue 45: it was refused)."""
    assert parse_config(changed("listen", "localhost:8093")).listen == \
        ListenAddress("127.0.0.1", 8093)


# -- the top level ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [[], None, "hosts", 3, True])
def test_top_must_be_object(value: object) -> None:
    """A file whose top level is not an object is refused with one message."""
    assert errors_of(value) == ["top level: must be a JSON object"]


def test_unknown_keys_everywhere() -> None:
    """An unknown key is named at every level: top, host, engine, model."""
    obj = valid()
    obj["colour"] = "blue"
    obj["hosts"][1]["nmae"] = "x"
    obj["hosts"][0]["engines"]["big"]["helth"] = "/h"
    obj["models"]["qwen"]["hots"] = "gpu1"
    assert errors_of(obj) == [
        "colour: unknown key",
        'hosts[0].engines.big.helth: unknown key (did you mean "health"?)',
        'hosts[1].nmae: unknown key (did you mean "name"?)',
        'models.qwen.hots: unknown key (did you mean "hosts"?)',
    ]


@pytest.mark.parametrize("key", ["drain_seconds", "prestop_seconds"])
@pytest.mark.parametrize("value", [-1, -0.5, True, False, "1", None, [], math.nan, math.inf])
def test_seconds_at_least_zero(key: str, value: object) -> None:
    """drain_seconds and prestop_seconds must be finite numbers >= 0; booleans are not numbers."""
    assert errors_of(changed(key, value)) == [f"{key}: must be a number >= 0"]
    assert getattr(parse_config(changed(key, 0)), key) == 0.0


@pytest.mark.parametrize(
    "key",
    [
        "idle_stop_seconds", "refresh_seconds", "connect_timeout_seconds",
        "header_timeout_seconds", "roster_timeout_seconds", "client_header_timeout_seconds",
        "client_idle_timeout_seconds", "client_body_timeout_seconds",
        "client_write_stall_seconds",
    ],
)  # fmt: skip
@pytest.mark.parametrize("value", [0, -1, 0.0, True, "5", None, math.nan, -math.inf, 10**400])
def test_seconds_positive(key: str, value: object) -> None:
    """The other durations must be finite numbers > 0."""
    assert errors_of(changed(key, value)) == [f"{key}: must be a number > 0"]
    assert getattr(parse_config(changed(key, 0.25)), key) == 0.25


@pytest.mark.parametrize("value", [0, -1, 1.5, 1024.0, True, "1024", None])
def test_max_body_bytes(value: object) -> None:
    """max_body_bytes must be a positive integer (not a float, not a boolean)."""
    assert errors_of(changed("max_body_bytes", value)) == [
        "max_body_bytes: must be a positive integer"
    ]


@pytest.mark.parametrize("value", ["Plain", "", None, 1, "hosts"])
def test_naming(value: object) -> None:
    """naming is "plain" or "host" and nothing else."""
    assert errors_of(changed("naming", value)) == ['naming: must be "plain" or "host"']


@pytest.mark.parametrize("value", [[], [""], "ssh -o x", ["ssh", 1], None])
def test_ssh_command(value: object) -> None:
    """ssh_command must be a non-empty list of non-empty strings."""
    assert errors_of(changed("ssh_command", value)) == [
        "ssh_command: must be a non-empty list of non-empty strings"
    ]


@pytest.mark.parametrize("value", ["", None, 5, ["/run"]])
def test_runtime_dir(value: object) -> None:
    """runtime_dir, when given, must be a non-empty string."""
    assert errors_of(changed("runtime_dir", value)) == ["runtime_dir: must be a non-empty string"]


# -- hosts ----------------------------------------------------------------------------------


def test_hosts_required() -> None:
    """A config without hosts is refused (and its models then name no known host)."""
    assert errors_of({}) == ["hosts: required"]
    obj = removed("hosts")
    assert errors_of(obj)[0] == "hosts: required"


@pytest.mark.parametrize("value", [[], {}, "gpu1", None])
def test_hosts_must_be_non_empty_list(value: object) -> None:
    """hosts must be a non-empty list."""
    assert errors_of({"hosts": value}) == ["hosts: must be a non-empty list"]


def test_host_must_be_object() -> None:
    """Each host entry must be an object."""
    obj = valid()
    obj["hosts"].append("gpu2")
    assert errors_of(obj) == ["hosts[2]: must be a JSON object"]


def test_host_name_required() -> None:
    """A host needs a name (and models naming it are not blamed twice)."""
    assert errors_of(removed("hosts.1.name")) == [
        "hosts[1].name: required",
        "models.mistral.host: no host named 'laptop'",
    ]


@pytest.mark.parametrize("value", ["", "-gpu", "gpu 1", "gpu/1", ".x", "gpü", 5, None])
def test_host_name_pattern(value: object) -> None:
    """Host names match [A-Za-z0-9][A-Za-z0-9._-]*."""
    obj = changed("hosts.1.name", value)
    obj["models"] = {}
    obj["aliases"] = {}
    assert errors_of(obj) == ["hosts[1].name: must be a name matching [A-Za-z0-9][A-Za-z0-9._-]*"]


def test_host_name_duplicate() -> None:
    """A repeated host name names the first host that has it."""
    obj = valid()
    obj["hosts"].append({"name": "gpu1", "url": "http://10.0.0.9:8081"})
    assert errors_of(obj) == ["hosts[2].name: duplicate of hosts[0]"]


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("http://10.0.0.5:8081", "http://10.0.0.5:8081"),
        ("http://10.0.0.5:8081/", "http://10.0.0.5:8081"),
        ("HTTPS://gpu1.lan/llm/v1/", "https://gpu1.lan/llm/v1"),
        ("http://[fd00::5]:8081", "http://[fd00::5]:8081"),
    ],
)
def test_url_normalised(text: str, normal: str) -> None:
    """Host URLs are kept without a trailing slash and with a lower-case scheme."""
    assert _host(parse_config(changed("hosts.1.url", text)), "laptop").url == normal


@pytest.mark.parametrize(
    "value",
    [
        "ftp://h", "http://", "http:///x", "10.0.0.5:8081", "http://h?x=1", "http://h/?",
        "http://h#top", "http://u:p@h", "http://h:99999", "http://h:0", "http://h:abc",
        "http://h:", "http://h x", "http://[::1", "http://hé", "", 42, None,
    ],
)  # fmt: skip
def test_url_bad(value: object) -> None:
    """Anything but http(s)://host[:port][/base] is refused: no query, fragment or user."""
    assert errors_of(changed("hosts.1.url", value)) == ["hosts[1].url: not an http(s) URL"]


def test_url_required() -> None:
    """A host needs a url."""
    assert errors_of(removed("hosts.1.url")) == ["hosts[1].url: required"]


def test_ssh_required_when_engines_given() -> None:
    """A managed host needs an ssh target."""
    assert errors_of(removed("hosts.0.ssh")) == ["hosts[0].ssh: required when engines are given"]


def test_ssh_without_engines_allowed() -> None:
    """ssh on a forward-only host is accepted (and unused)."""
    assert _host(parse_config(changed("hosts.1.ssh", "me@laptop")), "laptop").ssh == "me@laptop"


@pytest.mark.parametrize("value", ["", "-oProxyCommand=x", "a b", "a@b@c", "user@", "@h", 5, None])
def test_ssh_bad(value: object) -> None:
    """The ssh target is "user@host" or "host": no spaces, no leading "-" (an option)."""
    assert errors_of(changed("hosts.0.ssh", value)) == [
        'hosts[0].ssh: must be an ssh target "user@host" or "host"'
    ]


@pytest.mark.parametrize("value", ["", "   ", [], [""], ["a", 1], 5, None])
def test_agent_bad(value: object) -> None:
    """agent is a non-empty command string or list of non-empty strings."""
    assert errors_of(changed("hosts.0.agent", value)) == [
        "hosts[0].agent: must be a command: a non-empty string or list of non-empty strings"
    ]


def test_agent_unbalanced_quote() -> None:
    """An agent string that shlex cannot split says why."""
    assert errors_of(changed("hosts.0.agent", "agent 'unclosed")) == [
        "hosts[0].agent: cannot split: No closing quotation"
    ]


@pytest.mark.parametrize("value", [{}, [], "big", None])
def test_engines_must_be_non_empty_object(value: object) -> None:
    """engines, when present, must be a non-empty object (models then are not blamed for it)."""
    assert errors_of(changed("hosts.0.engines", value)) == [
        "hosts[0].engines: must be a non-empty object"
    ]


def test_engine_must_be_object() -> None:
    """Each engine is an object."""
    assert errors_of(changed("hosts.0.engines.big", ["llama-server"])) == [
        "hosts[0].engines.big: must be a JSON object"
    ]


def test_engine_name_pattern() -> None:
    """Engine names follow the host name pattern."""
    obj = changed("hosts.0.engines.b g", {"command": ["x"]})
    assert errors_of(obj) == [
        "hosts[0].engines.b g: must be a name matching [A-Za-z0-9][A-Za-z0-9._-]*"
    ]


def test_engine_command_required() -> None:
    """An engine needs a command."""
    assert errors_of(removed("hosts.0.engines.big.command")) == [
        "hosts[0].engines.big.command: required"
    ]


@pytest.mark.parametrize("value", [[], [""], "llama-server -m x", ["llama-server", 8081], None])
def test_engine_command_bad(value: object) -> None:
    """An engine command is a non-empty list of non-empty strings (no shell strings)."""
    assert errors_of(changed("hosts.0.engines.big.command", value)) == [
        "hosts[0].engines.big.command: must be a non-empty list of non-empty strings"
    ]


@pytest.mark.parametrize("value", ["health", "", "http://h/health", 5, None])
def test_engine_health_bad(value: object) -> None:
    """An engine's health path starts with "/"."""
    assert errors_of(changed("hosts.0.engines.big.health", value)) == [
        'hosts[0].engines.big.health: must be a path starting with "/"'
    ]


@pytest.mark.parametrize("value", [0, -5, True, "60", math.nan])
def test_engine_start_timeout_bad(value: object) -> None:
    """An engine's start timeout is a number > 0."""
    assert errors_of(changed("hosts.0.engines.big.start_timeout_seconds", value)) == [
        "hosts[0].engines.big.start_timeout_seconds: must be a number > 0"
    ]


# -- models ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [[], "qwen", None])
def test_models_must_be_object(value: object) -> None:
    """models is an object (aliases are then not checked against it)."""
    assert errors_of(changed("models", value)) == ["models: must be a JSON object"]


def test_model_must_be_object() -> None:
    """Each model is an object."""
    assert errors_of(changed("models.mistral", "laptop")) == [
        "models.mistral: must be a JSON object"
    ]


@pytest.mark.parametrize("name", ["gpu1/qwen", "/", ""])
def test_model_name(name: str) -> None:
    """Model names are non-empty and free of "/", which naming "host" uses."""
    shown = name or '""'
    assert errors_of(changed(f"models.{name}", {"host": "laptop"})) == [
        f'models.{shown}: must be non-empty and must not contain "/"'
    ]


def test_model_host_required() -> None:
    """A model names its host."""
    assert errors_of(removed("models.mistral.host")) == ["models.mistral.host: required"]


def test_model_host_unknown() -> None:
    """A model's host must be one of the hosts."""
    assert errors_of(changed("models.mistral.host", "gpu9")) == [
        "models.mistral.host: no host named 'gpu9'"
    ]


@pytest.mark.parametrize("value", ["", 1, None])
def test_model_host_type(value: object) -> None:
    """A model's host is a non-empty string."""
    assert errors_of(changed("models.mistral.host", value)) == [
        "models.mistral.host: must be a non-empty string"
    ]


def test_model_engine_required_on_managed_host() -> None:
    """A model on a managed host names its engine."""
    assert errors_of(removed("models.qwen.engine")) == [
        "models.qwen.engine: required: host 'gpu1' is managed"
    ]


def test_model_engine_unknown() -> None:
    """A model's engine must be one of its host's engines."""
    assert errors_of(changed("models.qwen.engine", "x")) == [
        "models.qwen.engine: host 'gpu1' has no engine 'x'"
    ]


def test_model_engine_on_forward_only_host() -> None:
    """A model on a host without engines must not name an engine."""
    assert errors_of(changed("models.mistral.engine", "big")) == [
        "models.mistral.engine: host 'laptop' has no engines"
    ]


@pytest.mark.parametrize("value", ["", 1, None])
def test_model_engine_type(value: object) -> None:
    """A model's engine, when given, is a non-empty string."""
    assert errors_of(changed("models.qwen.engine", value)) == [
        "models.qwen.engine: must be a non-empty string"
    ]


@pytest.mark.parametrize("value", ["", 1, None, ["qwen"]])
def test_model_upstream_type(value: object) -> None:
    """A model's upstream name, when given, is a non-empty string."""
    assert errors_of(changed("models.qwen.upstream", value)) == [
        "models.qwen.upstream: must be a non-empty string"
    ]


@pytest.mark.parametrize("value", [0, -1, 1.5, 4096.0, True, "4096", None])
def test_model_ctx(value: object) -> None:
    """A model's ctx is a positive integer."""
    assert errors_of(changed("models.qwen.ctx", value)) == [
        "models.qwen.ctx: must be a positive integer"
    ]


# -- aliases --------------------------------------------------------------------------------


def test_alias_unknown_target() -> None:
    """An alias must point at a catalog model."""
    assert errors_of(changed("aliases.coder", "x")) == [
        "aliases.coder: points at unknown model 'x'"
    ]


def test_alias_shadows_model() -> None:
    """An alias may not reuse a model's name."""
    assert errors_of(changed("aliases.qwen", "mistral")) == ["aliases.qwen: is also a model name"]


@pytest.mark.parametrize("value", [1, None, ["qwen"], {"model": "qwen"}])
def test_alias_value_type(value: object) -> None:
    """An alias value is a string."""
    assert errors_of(changed("aliases.coder", value)) == [
        "aliases.coder: must be a string naming a model"
    ]


def test_alias_name() -> None:
    """Alias names follow the model name rule."""
    assert errors_of(changed("aliases.gpu1/coder", "qwen")) == [
        'aliases.gpu1/coder: must be non-empty and must not contain "/"'
    ]


def test_aliases_must_be_object() -> None:
    """aliases is an object."""
    assert errors_of(changed("aliases", ["coder"])) == ["aliases: must be a JSON object"]


# -- all errors at once ---------------------------------------------------------------------


def test_every_error_reported() -> None:
    """parse_config reports every problem in one go, each naming its field."""
    obj = {
        "listen": "localhost",
        "colour": 1,
        "drain_seconds": True,
        "hosts": [
            {"name": "gpu1", "url": "ftp://x", "engines": {"big": {"command": []}}},
            {"name": "gpu1", "url": "http://h/", "nmae": 1},
        ],
        "models": {"qwen": {"host": "gpu9"}, "q2": {"host": "gpu1", "engine": "x"}},
        "aliases": {"coder": "nope"},
        "naming": "flat",
    }
    assert errors_of(obj) == [
        "colour: unknown key",
        f"listen: {LISTEN_ERROR}",
        "hosts[0].url: not an http(s) URL",
        "hosts[0].ssh: required when engines are given",
        "hosts[0].engines.big.command: must be a non-empty list of non-empty strings",
        'hosts[1].nmae: unknown key (did you mean "name"?)',
        "hosts[1].name: duplicate of hosts[0]",
        "models.qwen.host: no host named 'gpu9'",
        "models.q2.engine: host 'gpu1' has no engine 'x'",
        "aliases.coder: points at unknown model 'nope'",
        'naming: must be "plain" or "host"',
        "drain_seconds: must be a number >= 0",
    ]


# -- files ----------------------------------------------------------------------------------


def test_example_file_parses() -> None:
    """etc/hosts.example.json (the DESIGN.md example) is valid and reads as documented."""
    config = load_config(str(EXAMPLE))
    assert summary(config) == "2 hosts (1 managed), 3 models, 1 alias, listen 127.0.0.1:8080"
    gpu1 = _host(config, "gpu1")
    assert gpu1.ssh == "llm@10.0.0.5"
    assert list(gpu1.engines) == ["big", "small"]
    assert not _host(config, "laptop").managed
    assert config.models["qwen-32b"] == ModelConfig(
        "qwen-32b", "gpu1", "big", "qwen2.5-32b-instruct", 32768
    )
    assert config.models["llama-8b"].upstream == "llama-8b"
    assert dict(config.aliases) == {"coder": "qwen-32b"}
    assert config == parse_config(json.loads(EXAMPLE.read_text()))


def test_load_missing_file(tmp_path: Path) -> None:
    """An unreadable path is one error naming the path and the OS reason."""
    path = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == (f"{path}: cannot read: No such file or directory",)
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path))
    assert info.value.errors == (f"{tmp_path}: cannot read: Is a directory",)


def test_load_invalid_json(tmp_path: Path) -> None:
    """Invalid JSON is one error with the line and column of the problem."""
    path = tmp_path / "bad.json"
    path.write_text('{\n  "hosts": [}\n')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.errors == (f"{path}: not valid JSON: line 2 column 13: Expecting value",)


def test_load_not_utf8(tmp_path: Path) -> None:
    """A file that is not UTF-8 is refused with a message, not a traceback."""
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"hosts": "\xe9"}')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.errors == (f"{path}: not valid UTF-8: invalid continuation byte at byte 11",)


def test_load_duplicate_keys(tmp_path: Path) -> None:
    """A key given twice in one object is an error rather than silently keeping the last."""
    path = tmp_path / "dup.json"
    path.write_text(json.dumps(valid())[:-1] + ', "models": {}}')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.errors == (f"{path}: duplicate key 'models'",)


def test_load_validates(tmp_path: Path) -> None:
    """load_config reports the same field errors as parse_config."""
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(removed("hosts.0.ssh")))
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.errors == ("hosts[0].ssh: required when engines are given",)
    path.write_text(json.dumps(valid()))
    assert load_config(str(path)) == parse_config(valid())


# -- summary --------------------------------------------------------------------------------


def test_summary_singular_and_plural() -> None:
    """summary counts hosts, managed hosts, models and aliases, with the right plurals."""
    one = parse_config(
        {"listen": "[::1]:9000", "hosts": [{"name": "h", "url": "http://h"}],
         "models": {"m": {"host": "h"}}}
    )  # fmt: skip
    assert summary(one) == "1 host (0 managed), 1 model, 0 aliases, listen [::1]:9000"
    two = parse_config(changed("aliases.writer", "mistral"))
    assert summary(two) == "2 hosts (1 managed), 2 models, 2 aliases, listen 127.0.0.1:8080"


# -- properties -----------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
TOP_KEYS = [f.name for f in dataclasses.fields(Config)]
HOST_KEYS = ["name", "url", "ssh", "agent", "engines"]


def near_miss_host() -> st.SearchStrategy[dict[str, Any]]:
    """Host objects whose keys are mostly the real ones, with arbitrary values."""
    engine = st.dictionaries(
        st.sampled_from(["command", "health", "start_timeout_seconds", "x"]), JSON, max_size=3
    )
    value = JSON | st.dictionaries(st.text(max_size=4), engine, max_size=2)
    return st.dictionaries(st.sampled_from([*HOST_KEYS, "nmae"]), value, max_size=5)


NEAR_MISS = st.dictionaries(
    st.sampled_from([*TOP_KEYS, "colour"]),
    JSON | st.lists(near_miss_host(), max_size=3)
    | st.dictionaries(st.text(max_size=4), st.dictionaries(
        st.sampled_from(["host", "engine", "upstream", "ctx"]), JSON), max_size=3),
    max_size=8,
)  # fmt: skip


@settings(max_examples=300)
@given(st.one_of(JSON, NEAR_MISS))
def test_arbitrary_json_only_raises_config_error(obj: object) -> None:
    """Any JSON value either parses or raises ConfigError with field-named messages."""
    try:
        config = parse_config(obj)
    except ConfigError as e:
        assert e.errors
        assert all(isinstance(m, str) and ": " in m for m in e.errors)
    else:
        assert isinstance(config, Config)
        assert config == parse_config(copy.deepcopy(obj))


NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,8}", fullmatch=True)
SECONDS = st.integers(1, 10**6) | st.floats(0.001, 1e6, allow_nan=False, allow_infinity=False)
WORDS = st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4)


@st.composite
def valid_configs(draw: st.DrawFn) -> dict[str, Any]:
    """Random configs that obey every rule: hosts, engines, models and aliases that agree."""
    host_names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    hosts: list[dict[str, Any]] = []
    engines_of: dict[str, list[str]] = {}
    for name in host_names:
        host: dict[str, Any] = {
            "name": name,
            "url": f"http://{name.lower()}x:{draw(st.integers(1, 65535))}",
        }
        if draw(st.booleans()):
            engines = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
            host["ssh"] = f"llm@{name}"
            host["engines"] = {e: {"command": draw(WORDS)} for e in engines}
            engines_of[name] = engines
            if draw(st.booleans()):
                host["agent"] = draw(WORDS)
        hosts.append(host)
    model_names = draw(st.lists(st.text(min_size=1, max_size=8).filter(lambda s: "/" not in s),
                                max_size=5, unique=True))  # fmt: skip
    models: dict[str, Any] = {}
    for name in model_names:
        host_name = draw(st.sampled_from(host_names))
        model: dict[str, Any] = {"host": host_name}
        if host_name in engines_of:
            model["engine"] = draw(st.sampled_from(engines_of[host_name]))
        if draw(st.booleans()):
            model["upstream"] = draw(st.text(min_size=1, max_size=8))
        if draw(st.booleans()):
            model["ctx"] = draw(st.integers(1, 10**7))
        models[name] = model
    obj: dict[str, Any] = {"hosts": hosts, "models": models}
    if model_names:
        alias_names = st.text(min_size=1, max_size=8).filter(
            lambda s: "/" not in s and s not in models
        )
        obj["aliases"] = draw(
            st.dictionaries(alias_names, st.sampled_from(model_names), max_size=3)
        )
    obj["naming"] = draw(st.sampled_from(["plain", "host"]))
    obj["listen"] = (
        draw(st.sampled_from(["127.0.0.1", "0.0.0.0", "[::1]", "[::]"]))
        + ":"
        + str(draw(st.integers(0, 65535)))
    )
    for key in ("drain_seconds", "idle_stop_seconds", "header_timeout_seconds"):
        if draw(st.booleans()):
            obj[key] = draw(SECONDS)
    return obj


def to_json(config: Config) -> dict[str, Any]:
    """The JSON a Config came from (every field written out), for round-trip checks."""

    def host(h: HostConfig) -> dict[str, Any]:
        out: dict[str, Any] = {"name": h.name, "url": h.url}
        if h.agent:
            out["agent"] = list(h.agent)
        if h.ssh is not None:
            out["ssh"] = h.ssh
        if h.engines:
            out["engines"] = {
                e.name: {"command": list(e.command), "health": e.health,
                         "start_timeout_seconds": e.start_timeout_seconds}
                for e in h.engines.values()
            }  # fmt: skip
        return out

    def model(m: ModelConfig) -> dict[str, Any]:
        out: dict[str, Any] = {"host": m.host, "upstream": m.upstream}
        if m.engine is not None:
            out["engine"] = m.engine
        if m.ctx is not None:
            out["ctx"] = m.ctx
        return out

    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    out.update(
        listen=str(config.listen),
        hosts=[host(h) for h in config.hosts],
        models={name: model(m) for name, m in config.models.items()},
        aliases=dict(config.aliases),
        ssh_command=list(config.ssh_command),
        cors={"origins": list(config.cors)},
    )
    for key in ("runtime_dir", "keys_file", "tls", "tracing", "capture"):
        if out[key] is None:
            del out[key]
    if config.tracing is not None:
        out["tracing"] = {"otlp_endpoint": config.tracing.endpoint,
                          "service_name": config.tracing.service_name}
    return out


@settings(max_examples=200)
@given(valid_configs())
def test_valid_configs_parse_and_round_trip(obj: dict[str, Any]) -> None:
    """Configs that obey the rules parse, keep what they say, and survive a JSON round trip."""
    config = parse_config(obj)
    assert [h.name for h in config.hosts] == [h["name"] for h in obj["hosts"]]
    assert list(config.models) == list(obj["models"])
    for name, model in obj["models"].items():
        assert config.models[name].upstream == model.get("upstream", name)
        assert config.models[name].engine == model.get("engine")
    assert dict(config.aliases) == obj.get("aliases", {})
    assert sum(h.managed for h in config.hosts) == sum("engines" in h for h in obj["hosts"])
    again = parse_config(json.loads(json.dumps(to_json(config))))
    assert again == config
    assert parse_config(json.loads(json.dumps(obj))) == config
