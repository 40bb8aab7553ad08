"""The config's `tracing` block, validated like the rest (`parse`): OpenTelemetry
traces sent to an OTLP/HTTP collector, opt-in.

    "tracing": {"otlp_endpoint": "http://collector:4318", "service_name": "llmproxy"}

`otlp_endpoint` is the collector's OTLP/HTTP base URL (`/v1/traces` is added)
or its full traces URL; `service_name` (default `llmproxy`) is the traces'
`service.name`. The block needs the opentelemetry SDK and its OTLP exporter
(`pip install 'llmproxy[otel]'`): without them the config is refused, by name."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from llmproxy.core.text import did_you_mean

TOP_KEYS = ("tracing",)
_KEYS = ("otlp_endpoint", "service_name")
TRACES_PATH = "/v1/traces"
# What `tracing` imports, and the extra that installs it.
NEEDS = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
INSTALL = "pip install 'llmproxy[otel]'"

Error = Callable[[str, str], None]


@dataclass(frozen=True)
class TracingConfig:
    """Where traces go: the collector's OTLP/HTTP traces URL, and the service name."""

    endpoint: str
    service_name: str = "llmproxy"


def installed() -> str | None:
    """None when the SDK and exporter can be imported; else what is missing."""
    for name in NEEDS:
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return name
    return None


def top_fields(top: dict[str, Any], error: Error) -> dict[str, Any]:
    """The Config field `tracing` gives, when present."""
    if "tracing" not in top:
        return {}
    block = top["tracing"]
    if not isinstance(block, dict):
        error("tracing", 'must be a JSON object such as {"otlp_endpoint": '
                         '"http://127.0.0.1:4318"}')
        return {}
    for key in block:
        if key not in _KEYS:
            error(f"tracing.{key}", "unknown key" + did_you_mean(key, _KEYS))
    endpoint = _endpoint(block.get("otlp_endpoint"), error)
    name = block.get("service_name", "llmproxy")
    if not isinstance(name, str) or not name.strip():
        error("tracing.service_name", "must be a non-empty string")
        return {}
    missing = installed()
    if missing is not None:
        error("tracing", f"needs the OpenTelemetry SDK and its OTLP exporter ({missing} is "
                         f"missing): {INSTALL}")
        return {}
    return {} if endpoint is None else {"tracing": TracingConfig(endpoint, name)}


def _endpoint(value: object, error: Error) -> str | None:
    """The traces URL of `otlp_endpoint` (an http or https URL)."""
    if not isinstance(value, str):
        error("tracing.otlp_endpoint", "required: the collector's OTLP/HTTP URL, such as "
                                       '"http://127.0.0.1:4318"')
        return None
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (a bad port raises)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or \
            parts.query or parts.fragment or any(c in value for c in "\r\n\0 "):
        error("tracing.otlp_endpoint", "must be an http:// or https:// URL such as "
                                       '"http://127.0.0.1:4318"')
        return None
    path = parts.path.rstrip("/")
    if path.endswith(TRACES_PATH):
        return value
    return urlunsplit((parts.scheme, parts.netloc, path + TRACES_PATH, "", ""))
