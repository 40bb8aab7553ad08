"""Reading and validating hosts.json into a frozen `Config`, strictly.

Every problem is reported at once, each message naming its field
(``hosts[1].ssh: required when engines are given``).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import shlex
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from llmproxy.config import capacity, kvcache, macros, supervision, tracing, wake
from llmproxy.config import modelentry as catalog_entry
from llmproxy.config.capture import parse_capture
from llmproxy.config.files import read_text
from llmproxy.config.security import HOST_KEYS, TOP_KEYS, host_fields, resolve_paths, top_fields
from llmproxy.config.values import (
    Config,
    ConfigError,
    EngineConfig,
    HostConfig,
    ListenAddress,
    ModelConfig,
)
from llmproxy.core.text import did_you_mean

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_NAME_RULE = "must be a name matching [A-Za-z0-9][A-Za-z0-9._-]*"
_SSH_TARGET = re.compile(r"(?:[^\s@-][^\s@]*@)?[^\s@-][^\s@]*")
_PORT = re.compile(r"[0-9]{1,5}")
_STRINGS = "must be a non-empty list of non-empty strings"

_CLIENT_SECONDS = (
    "client_header_timeout_seconds", "client_idle_timeout_seconds",
    "client_body_timeout_seconds", "client_write_stall_seconds",
)  # fmt: skip
_TOP_KEYS = (
    "listen", "hosts", "models", "aliases", "naming", "drain_seconds", "prestop_seconds",
    "idle_stop_seconds", "refresh_seconds", "max_body_bytes", "connect_timeout_seconds",
    "header_timeout_seconds", "engine_read_timeout_seconds", "roster_timeout_seconds",
    "upgrade_timeout_seconds", "ssh_command", "runtime_dir", "max_event_subscribers", "capture",
    *TOP_KEYS,
    *_CLIENT_SECONDS,
    *tracing.TOP_KEYS,
)  # fmt: skip
_SECONDS = (
    "drain_seconds", "prestop_seconds", "idle_stop_seconds", "refresh_seconds",
    "connect_timeout_seconds", "header_timeout_seconds", "engine_read_timeout_seconds",
    "roster_timeout_seconds", "upgrade_timeout_seconds", *_CLIENT_SECONDS,
)  # fmt: skip
_MAY_BE_ZERO = ("drain_seconds", "prestop_seconds")
_HOST_KEYS = ("name", "url", "ssh", "agent", "engines", *HOST_KEYS, *capacity.HOST_KEYS,
              *wake.HOST_KEYS)
_ENGINE_KEYS = ("command", "health", "start_timeout_seconds", "url", *capacity.ENGINE_KEYS,
                *supervision.ENGINE_KEYS, *kvcache.ENGINE_KEYS)
_PUBLIC_NAME_RULE = 'must be non-empty and must not contain "/"'


def _sub(path: str, key: str) -> str:
    """The field path of `key` inside `path`; an empty key shows as ``""``."""
    shown = key if key else '""'
    return f"{path}.{shown}" if path else shown


def _public_name_ok(name: str) -> bool:
    # "/" is reserved for `naming: host` display names such as gpu1/qwen.
    return bool(name) and "/" not in name


LISTEN_ERROR = ('not a host:port address: the host is an IP address or localhost, e.g. '
                '"127.0.0.1:8080", "0.0.0.0:8080", "[::]:8080", "localhost:8080"')


def parse_listen(text: str) -> ListenAddress | None:
    """``host:port`` or ``[v6]:port`` with an IP address literal, or
    ``localhost:port`` (127.0.0.1); None if it is not."""
    if text.startswith("localhost:"):
        text = "127.0.0.1" + text[len("localhost"):]
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        version = 6
    else:
        host, sep, port = text.rpartition(":")
        version = 4
    if not sep or not _PORT.fullmatch(port) or int(port) > 65535:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return ListenAddress(str(address), int(port)) if address.version == version else None


def _normalise_url(text: str) -> str | None:
    """``scheme://netloc[/base]`` with no trailing slash, or None if not a plain http(s) URL."""
    if not text.isascii() or not text.isprintable() or any(c in text for c in " ?#@"):
        return None
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname or parts.netloc.endswith(":"):
        return None
    return None if port == 0 else f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def _strings(value: object) -> tuple[str, ...] | None:
    """A non-empty list of non-empty strings as a tuple, else None."""
    if isinstance(value, list) and value and all(isinstance(s, str) and s for s in value):
        return tuple(value)
    return None


class _Parser:
    """Walks a decoded JSON value, collecting every error instead of stopping at the first."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def error(self, path: str, message: str) -> None:
        self.errors.append(f"{path or 'top level'}: {message}")

    def mapping(self, value: object, path: str, keys: Sequence[str] | None) -> dict[str, Any]:
        """`value` if it is an object, else {}; with `keys`, any other key is unknown."""
        if not isinstance(value, dict):
            self.error(path, "must be a JSON object")
            return {}
        for key in value:
            if keys is not None and key not in keys:
                self.error(_sub(path, key), "unknown key" + did_you_mean(key, keys))
        return value

    def seconds(self, value: object, path: str, positive: bool = True) -> float:
        """A finite number of seconds, > 0 (or >= 0 unless `positive`)."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int too big for a float
                number = math.inf
            if math.isfinite(number) and (number > 0 if positive else number >= 0):
                return number
        self.error(path, "must be a number > 0" if positive else "must be a number >= 0")
        return 0.0

    def positive_int(self, value: object, path: str) -> int | None:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        self.error(path, "must be a positive integer")
        return None

    def string(self, value: object, path: str) -> str | None:
        if isinstance(value, str) and value:
            return value
        self.error(path, "must be a non-empty string")
        return None

    def parse(self, obj: object) -> Config | None:
        if not isinstance(obj, dict):
            self.error("", "must be a JSON object")
            return None
        top = self.mapping(obj, "", _TOP_KEYS)
        fields: dict[str, Any] = {"listen": ListenAddress("127.0.0.1", 8080)}
        if "listen" in top:
            text = top["listen"]
            fields["listen"] = parse_listen(text) if isinstance(text, str) else None
            if fields["listen"] is None:
                self.error("listen", LISTEN_ERROR)
        fields["hosts"], engines_by_host = self.hosts(top)
        models = top.get("models", {})
        fields["models"] = self.models(self.mapping(models, "models", None), engines_by_host)
        model_names = set(models) if isinstance(models, dict) else None
        fields["aliases"] = self.aliases(top.get("aliases", {}), model_names)
        catalog_entry.check_fallbacks(self, fields["models"], fields["aliases"])
        catalog_entry.check_engine_overrides(self, fields["models"], fields["hosts"])
        fields["hosts"] = macros.expand(fields["hosts"], fields["models"], self.error)
        if top.get("naming", "plain") not in ("plain", "host"):
            self.error("naming", 'must be "plain" or "host"')
        for key in _SECONDS:
            if key in top:
                fields[key] = self.seconds(top[key], key, key not in _MAY_BE_ZERO)
        if "max_body_bytes" in top:
            fields["max_body_bytes"] = self.positive_int(top["max_body_bytes"], "max_body_bytes")
        if "max_event_subscribers" in top:
            fields["max_event_subscribers"] = self.positive_int(top["max_event_subscribers"],
                                                                "max_event_subscribers")
        if "ssh_command" in top:
            fields["ssh_command"] = _strings(top["ssh_command"])
            if fields["ssh_command"] is None:
                self.error("ssh_command", _STRINGS)
        if "runtime_dir" in top:
            fields["runtime_dir"] = self.string(top["runtime_dir"], "runtime_dir")
        fields.update(top_fields(top, self.error))
        fields.update(tracing.top_fields(top, self.error))
        fields.update(parse_capture(top, self.error))
        if self.errors:
            return None
        return Config(**fields, naming=top.get("naming", "plain"))

    def hosts(self, top: dict[str, Any]) -> tuple[list[HostConfig], dict[str, set[str] | None]]:
        """The hosts, and each named host's engine names (None: its engines are invalid)."""
        if "hosts" not in top:
            self.error("hosts", "required")
            return [], {}
        if not isinstance(top["hosts"], list) or not top["hosts"]:
            self.error("hosts", "must be a non-empty list")
            return [], {}
        hosts: list[HostConfig] = []
        engines_by_host: dict[str, set[str] | None] = {}
        first_index: dict[str, int] = {}
        for i, item in enumerate(top["hosts"]):
            path = f"hosts[{i}]"
            if not isinstance(item, dict):
                self.error(path, "must be a JSON object")
                continue
            d = self.mapping(item, path, _HOST_KEYS)
            name = d.get("name")
            if "name" not in d:
                self.error(f"{path}.name", "required")
            elif not isinstance(name, str) or not _NAME.fullmatch(name):
                self.error(f"{path}.name", _NAME_RULE)
            elif name in first_index:
                self.error(f"{path}.name", f"duplicate of hosts[{first_index[name]}]")
            else:
                first_index[name] = i
            hosts.append(self.host(d, path, name if isinstance(name, str) else ""))
            if isinstance(name, str) and name not in engines_by_host:
                engines = d.get("engines", {})
                valid = isinstance(engines, dict) and (engines or "engines" not in d)
                engines_by_host[name] = set(engines) if valid else None
        return hosts, engines_by_host

    def host(self, d: dict[str, Any], path: str, name: str) -> HostConfig:
        text = d.get("url")
        url = _normalise_url(text) if isinstance(text, str) else None
        if "url" not in d:
            self.error(f"{path}.url", "required")
        elif url is None:
            self.error(f"{path}.url", "not an http(s) URL")
        ssh = d.get("ssh")
        if "ssh" in d and not (isinstance(ssh, str) and _SSH_TARGET.fullmatch(ssh)):
            self.error(f"{path}.ssh", 'must be an ssh target "user@host" or "host"')
        if "engines" in d and "ssh" not in d:
            self.error(f"{path}.ssh", "required when engines are given")
        agent = self.command(d["agent"], f"{path}.agent") if "agent" in d else None
        engines: dict[str, EngineConfig] = {}
        if "engines" in d:
            value = d["engines"]
            if not isinstance(value, dict) or not value:
                self.error(f"{path}.engines", "must be a non-empty object")
            else:
                for key, item in value.items():
                    engines[key] = self.engine(key, item, _sub(f"{path}.engines", key))
        extra = capacity.host_capacity(self, d, path, url, engines)
        extra.update(wake.host_sleep_wake(self, d, path, "engines" in d))
        return HostConfig(name, url or "", ssh, agent or HostConfig.agent, engines,
                          **host_fields(d, path, url, self.error), **extra)

    def command(self, value: object, path: str) -> tuple[str, ...] | None:
        """A command given as a shell-like string or as a list of strings."""
        if isinstance(value, str):
            try:
                words = tuple(shlex.split(value))
            except ValueError as e:
                self.error(path, f"cannot split: {e}")
                return None
            if words:
                return words
        elif _strings(value) is not None:
            return _strings(value)
        self.error(path, "must be a command: a non-empty string or list of non-empty strings")
        return None

    def engine(self, name: str, value: object, path: str) -> EngineConfig:
        if not _NAME.fullmatch(name):
            self.error(path, _NAME_RULE)
        d = self.mapping(value, path, _ENGINE_KEYS)
        command = _strings(d.get("command"))
        if "command" not in d and isinstance(value, dict):
            self.error(f"{path}.command", "required")
        elif command is None and isinstance(value, dict):
            self.error(f"{path}.command", _STRINGS)
        health = d.get("health", EngineConfig.health)
        if not isinstance(health, str) or not health.startswith("/"):
            self.error(f"{path}.health", 'must be a path starting with "/"')
        start = EngineConfig.start_timeout_seconds
        if "start_timeout_seconds" in d:
            start = self.seconds(d["start_timeout_seconds"], f"{path}.start_timeout_seconds")
        own: dict[str, Any] = {}
        if "url" in d:
            text = d["url"]
            own["url"] = _normalise_url(text) if isinstance(text, str) else None
            if own["url"] is None:
                self.error(f"{path}.url", "not an http(s) URL")
        return EngineConfig(name, command or (), health, start,
                            **capacity.engine_capacity(self, d, path),
                            **supervision.engine_supervision(self, d, path),
                            **kvcache.engine_kv_cache(self, d, path, command), **own)

    def models(
        self, d: dict[str, Any], engines_by_host: dict[str, set[str] | None]
    ) -> dict[str, ModelConfig]:
        """The catalog, in file order."""
        models: dict[str, ModelConfig] = {}
        for key, value in d.items():
            path = _sub("models", key)
            if not _public_name_ok(key):
                self.error(path, _PUBLIC_NAME_RULE)
            if not isinstance(value, dict):
                self.error(path, "must be a JSON object")
                continue
            d = self.mapping(value, path, catalog_entry.MODEL_KEYS)
            models[key] = self.model(key, d, path, engines_by_host)
        return models

    def model(
        self, key: str, d: dict[str, Any], path: str, engines_by_host: dict[str, set[str] | None]
    ) -> ModelConfig:
        return catalog_entry.model(self, key, d, path, engines_by_host)

    def aliases(self, value: object, model_names: set[str] | None) -> dict[str, str]:
        aliases: dict[str, str] = {}
        for key, target in self.mapping(value, "aliases", None).items():
            path = _sub("aliases", key)
            if not _public_name_ok(key):
                self.error(path, _PUBLIC_NAME_RULE)
            if not isinstance(target, str):
                self.error(path, "must be a string naming a model")
            elif model_names is None:
                pass  # `models` is not an object: reported there
            elif key in model_names:
                self.error(path, "is also a model name")
            elif target not in model_names:
                self.error(path, f"points at unknown model {target!r}")
            aliases[key] = str(target)
        return aliases


def parse_config(obj: object) -> Config:
    """Validate a decoded JSON value; raise ConfigError listing every problem found."""
    parser = _Parser()
    config = parser.parse(obj)
    if config is None:
        raise ConfigError(parser.errors)
    return config


def load_config(path: str) -> Config:
    """Read, decode and validate the JSON config file at `path`."""
    duplicates: list[str] = []

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        seen: dict[str, object] = {}
        for key, value in items:
            if key in seen:
                duplicates.append(key)
            seen[key] = value
        return seen

    text = read_text(path)
    try:
        obj = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise ConfigError([f"{path}: not valid JSON: {where}: {e.msg}"]) from None
    except RecursionError:
        raise ConfigError([f"{path}: not valid JSON: nested too deeply"]) from None
    if duplicates:
        # json keeps the last of two equal keys; a silently lost model is worse than an error.
        raise ConfigError([f"{path}: duplicate key {key!r}" for key in duplicates])
    return resolve_paths(parse_config(obj), os.path.dirname(os.path.abspath(path)))


def _count(n: int, noun: str, plural: str = "") -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def summary(config: Config) -> str:
    """One line for logs and ``llmproxy check``: counts of hosts, models, aliases; the address."""
    managed = sum(1 for host in config.hosts if host.managed)
    return (
        f"{_count(len(config.hosts), 'host')} ({managed} managed), "
        f"{_count(len(config.models), 'model')}, "
        f"{_count(len(config.aliases), 'alias', 'aliases')}, listen {config.listen}"
    )
