"""The config: hosts.json validated into a frozen value. Imports nothing of
llmproxy but `core`; knows no HTTP.

Modules:

- `values`: the config as frozen dataclasses (`Config`, `HostConfig`, ...) and `ConfigError`.
- `parse`: reading and validating hosts.json, strictly; every error names its field.
- `capacity`: the capacity keys (slots, queue, residency, preload).
- `kvcache`: an engine's `kv_cache` key, and when its model needs `--swa-full`.
- `supervision`: an engine's supervision keys (`restart`, `unhealthy_seconds`).
- `wake`: a host's sleep and wake keys (`wake`, `sleep`).
- `tracing`: the `tracing` block (OpenTelemetry traces to an OTLP/HTTP collector).
- `modelentry`: one catalog entry (`models.NAME`).
- `macros`: `${PORT}` and `${MODEL}` in an engine's command.
- `security`: the access and TLS keys (`keys_file`, `tls`, a host's credentials).
- `keys`: the keys file as a frozen value, and the lookup of a presented secret.
- `capture`: the `capture` block (opt-in request capture, redaction paths).
- `files`: reading the files a config names, with errors that name the file.
"""

from llmproxy.config.parse import load_config, parse_config, summary
from llmproxy.config.values import (
    DEFAULT_SSH_COMMAND,
    Config,
    ConfigError,
    EngineConfig,
    HostConfig,
    ListenAddress,
    ModelConfig,
    TLSConfig,
)

__all__ = [
    "DEFAULT_SSH_COMMAND", "Config", "ConfigError", "EngineConfig", "HostConfig",
    "ListenAddress", "ModelConfig", "TLSConfig", "load_config", "parse_config", "summary",
]
