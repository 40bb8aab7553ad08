"""The config as a frozen value: what a validated hosts.json says.

Equal files give equal values; nothing here reads files or knows HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from llmproxy.config.capture import CaptureConfig
from llmproxy.config.tracing import TracingConfig
from llmproxy.config.wake import SleepConfig, WakeConfig

DEFAULT_SSH_COMMAND: tuple[str, ...] = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10")

_K = TypeVar("_K")
_V = TypeVar("_V")



def _frozen(items: Mapping[_K, _V]) -> Mapping[_K, _V]:
    """A read-only copy that keeps insertion order and compares equal by content."""
    return MappingProxyType(dict(items))


class ConfigError(Exception):
    """The config is invalid; `errors` holds one message per problem, each naming its field."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors: tuple[str, ...] = tuple(errors)
        super().__init__("\n".join(self.errors))


@dataclass(frozen=True)
class ListenAddress:
    """Where the proxy listens: an IP address (IPv6 without brackets) and a port."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class EngineConfig:
    """A preset for a managed host: the command that starts an engine, and how to see it is up."""

    name: str
    command: tuple[str, ...]
    health: str = "/health"
    start_timeout_seconds: float = 120.0
    max_concurrent: int | None = None   # overrides the host's while this engine runs
    idle_stop_seconds: float | None = None   # overrides the top-level idle_stop_seconds
    memory_gb: float | None = None      # what it holds of its host's memory_gb
    url: str | None = None              # where it listens (None: its host's url)
    restart: str = "on-failure"         # after a crash: "on-failure" or "never"
    unhealthy_seconds: float = 30.0     # a failing health check, silent responses: hung
    kv_cache: str = "drop"              # "keep": its prompt cache survives planned stops

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))


@dataclass(frozen=True)
class HostConfig:
    """A GPU host: its engine URL and, when managed, how to reach its agent and its engines."""

    name: str
    url: str
    ssh: str | None = None
    agent: tuple[str, ...] = ()         # () runs the agent the proxy brings (agentbundle)
    engines: Mapping[str, EngineConfig] = field(default_factory=lambda: _frozen({}))
    # Secrets stay out of the config: the name of the variable holding the key
    # sent upstream; TLS files for an https url (see config.security).
    api_key_env: str | None = None
    ca_file: str | None = None
    client_cert_file: str | None = None
    client_key_file: str | None = None
    insecure_skip_verify: bool = False
    max_concurrent: int | None = None     # requests at once; None: no limit
    max_queue: int = 100                  # requests waiting beyond that (then 429)
    queue_timeout_seconds: float = 60.0   # how long one may wait (then 503)
    min_engine_seconds: float = 30.0      # residency of an engine after a switch
    schedule: str = "batch"               # "batch" or "arrival" (hosts/batching.py)
    max_wait_seconds: float = 30.0        # batching makes no waiter wait longer
    preload: tuple[str, ...] = ()         # the engines started at start-up, in order
    memory_gb: float | None = None        # engines run together within it (None: one at a time)
    wake: WakeConfig | None = None        # how a magic packet wakes it (config/wake.py)
    sleep: SleepConfig | None = None      # when and how its agent puts it to sleep

    def __post_init__(self) -> None:
        object.__setattr__(self, "agent", tuple(self.agent))
        object.__setattr__(self, "preload", tuple(self.preload))
        object.__setattr__(self, "engines", _frozen(self.engines))

    @property
    def managed(self) -> bool:
        """True when llmproxy starts and stops this host's engines."""
        return bool(self.engines)

    @property
    def budgeted(self) -> bool:
        """True when several engines may run together (the host has `memory_gb`)."""
        return self.memory_gb is not None and self.managed

    def engine_url(self, engine: str | None) -> str:
        """Where `engine` listens: its own `url`, else the host's."""
        preset = self.engines.get(engine) if engine is not None else None
        return preset.url if preset is not None and preset.url is not None else self.url


@dataclass(frozen=True)
class ModelConfig:
    """A catalog entry: a public model name, where it runs, and metadata overrides."""

    name: str
    host: str                      # the first of `hosts`
    engine: str | None = None
    upstream: str = ""
    ctx: int | None = None
    hosts: tuple[str, ...] = ()    # every host that serves it (default: `host`)
    affinity: str | None = None    # "header:NAME", "body:FIELD" or "prefix" (see hosts/choose)
    fallbacks: tuple[str, ...] = ()  # models (or aliases) tried in turn when no host can

    def __post_init__(self) -> None:
        if not self.upstream:
            object.__setattr__(self, "upstream", self.name)
        object.__setattr__(self, "hosts", tuple(self.hosts) or (self.host,))


@dataclass(frozen=True)
class TLSConfig:
    """The listener's certificate chain and key (PEM files), re-read on SIGHUP."""

    cert_file: str
    key_file: str


@dataclass(frozen=True)
class Config:
    """The whole validated config; equal files give equal values."""

    listen: ListenAddress
    hosts: tuple[HostConfig, ...]
    models: Mapping[str, ModelConfig] = field(default_factory=lambda: _frozen({}))
    aliases: Mapping[str, str] = field(default_factory=lambda: _frozen({}))
    naming: str = "plain"
    drain_seconds: float = 120.0
    prestop_seconds: float = 0.0
    idle_stop_seconds: float = 900.0
    refresh_seconds: float = 600.0
    max_body_bytes: int = 16 * 1024 * 1024
    connect_timeout_seconds: float = 10.0
    header_timeout_seconds: float = 600.0
    engine_read_timeout_seconds: float = 300.0    # an answer under way: between two engine reads
    roster_timeout_seconds: float = 5.0
    upgrade_timeout_seconds: float = 30.0
    client_header_timeout_seconds: float = 10.0   # connect (or first byte) -> end of headers
    client_idle_timeout_seconds: float = 120.0    # a keep-alive connection between requests
    client_body_timeout_seconds: float = 30.0     # between two reads of a request body
    client_write_stall_seconds: float = 60.0      # a client that reads nothing while data waits
    ssh_command: tuple[str, ...] = DEFAULT_SSH_COMMAND
    runtime_dir: str | None = None
    keys_file: str | None = None      # inbound API keys (a separate file, re-read on SIGHUP)
    public_status: bool = False       # with keys: /status, /api/events, /metrics, the page open
    tls: TLSConfig | None = None      # serve https on the listening socket
    # Besides IP literals and localhost, the Host names a keyless admin action may
    # name (lower case); anything else is refused (DNS rebinding).
    server_names: tuple[str, ...] = ()
    # The peers trusted as the operator's own (keyless admin actions with keys off
    # or on, the engine logs with keys off): networks in canonical CIDR form.
    trusted_peers: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    max_event_subscribers: int = 64   # /api/events streams at once; beyond: 503
    # The origins whose pages may call the API paths from a browser (CORS); "*": any
    # (only without keys_file). Empty: none.
    cors: tuple[str, ...] = ()
    tracing: TracingConfig | None = None   # OpenTelemetry traces to a collector (opt-in)
    capture: CaptureConfig | None = None   # requests and answers kept (config/capture.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "models", _frozen(self.models))
        object.__setattr__(self, "aliases", _frozen(self.aliases))
        object.__setattr__(self, "ssh_command", tuple(self.ssh_command))
        object.__setattr__(self, "server_names", tuple(self.server_names))
        object.__setattr__(self, "trusted_peers", tuple(self.trusted_peers))
        object.__setattr__(self, "cors", tuple(self.cors))

