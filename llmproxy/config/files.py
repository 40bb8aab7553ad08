"""Reading the files a config names, with errors that name the file or the field."""

from __future__ import annotations

from llmproxy.config.values import ConfigError


def read_text(path: str) -> str:
    """A UTF-8 text file (hosts.json, the keys file); ConfigError naming `path`."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read: {e.strerror or e}"]) from e
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: not valid UTF-8: {e.reason} at byte {e.start}"]) from e


def read_bytes(path: str, field: str) -> bytes:
    """A file the config names in `field` (certificates, keys); ConfigError naming both."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError([f"{field}: cannot read {path}: {e.strerror or e}"]) from None
