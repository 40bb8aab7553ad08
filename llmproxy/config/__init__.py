"""The config: hosts.json as a frozen value (`model`) and its strict validation
(`parse`). Imports nothing of llmproxy but `core`; knows no HTTP."""

from llmproxy.config.model import (
    DEFAULT_SSH_COMMAND,
    Config,
    ConfigError,
    EngineConfig,
    HostConfig,
    ListenAddress,
    ModelConfig,
    TLSConfig,
)
from llmproxy.config.parse import load_config, parse_config, summary

__all__ = [
    "DEFAULT_SSH_COMMAND", "Config", "ConfigError", "EngineConfig", "HostConfig",
    "ListenAddress", "ModelConfig", "TLSConfig", "load_config", "parse_config", "summary",
]
