"""Macros in an engine's `command`, as llama-swap users know them, so a port or a name is
written once: ``${PORT}`` is the port of the engine's url (its own `url`, else its host's;
80 or 443 when the url names none), ``${MODEL}`` the upstream name of the model that names
this engine on this host (an error unless exactly one such name). A word may hold several
macros and other text (``--alias=${MODEL}``); any other ``${NAME}`` is an error, as is a
``${MODEL}`` that is not one name. Expanded once, when the config is read."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from llmproxy.config.values import EngineConfig, HostConfig, ModelConfig

MACRO = re.compile(r"\$\{([^}]*)\}")
KNOWN = ("PORT", "MODEL")


def url_port(url: str) -> str:
    """The port of `url` as text (the scheme's default when it names none)."""
    parts = urlsplit(url)
    return str(parts.port or (443 if parts.scheme == "https" else 80))


def _model_names(host: str, engine: str, models: Mapping[str, ModelConfig]) -> list[str]:
    return sorted({m.upstream for m in models.values() if m.engine == engine and host in m.hosts})


def expand_engine(host: HostConfig, engine: EngineConfig, models: Mapping[str, ModelConfig],
                  path: str, error: Callable[[str, str], None]) -> EngineConfig:
    """`engine` with its command's macros replaced; each problem goes to `error(path, ...)`."""
    if not any("${" in word for word in engine.command):
        return engine
    names = _model_names(host.name, engine.name, models)

    def value(m: re.Match[str]) -> str:
        name = m.group(1)
        if name == "PORT":
            return url_port(host.engine_url(engine.name))
        if name == "MODEL" and len(names) == 1:
            return names[0]
        if name == "MODEL":
            error(path, f"${{MODEL}}: {len(names)} model names run on engine {engine.name} of "
                        f"{host.name} ({', '.join(names) or 'no model names it'}): write the "
                        "name instead")
        else:
            error(path, f"unknown macro ${{{name}}}: the macros are "
                        + ", ".join(f"${{{k}}}" for k in KNOWN))
        return m.group(0)

    command = tuple(MACRO.sub(value, word) for word in engine.command)
    return dataclasses.replace(engine, command=command)


def expand(hosts: list[HostConfig], models: Mapping[str, ModelConfig],
           error: Callable[[str, str], None]) -> list[HostConfig]:
    """Every host with its engines' macros expanded (see the module)."""
    out = []
    for i, host in enumerate(hosts):
        engines = {name: expand_engine(host, e, models, f"hosts[{i}].engines.{name}.command",
                                       error) for name, e in host.engines.items()}
        out.append(dataclasses.replace(host, engines=engines))
    return out
