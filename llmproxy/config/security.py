"""The config's access and TLS keys, validated: `keys_file`, `public_status`,
`server_names`, `tls` and `cors` at the top level; `api_key_env`, `ca_file`, `client_cert_file`,
`client_key_file` and `insecure_skip_verify` on a host.

No secret is ever in the config: a host names the environment variable that
holds its upstream key, and client keys live in the keys file (`config.keys`).
Files are named here, not read; relative paths are relative to the config file.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Callable
from typing import Any

from llmproxy.config.values import Config, HostConfig, TLSConfig
from llmproxy.core.text import did_you_mean

TOP_KEYS = ("keys_file", "public_status", "tls", "server_names", "cors")
HOST_KEYS = ("api_key_env", "ca_file", "client_cert_file", "client_key_file",
             "insecure_skip_verify")
_TLS_KEYS = ("cert_file", "key_file")
_CORS_KEYS = ("origins",)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")
_HOST_FILES = ("ca_file", "client_cert_file", "client_key_file")

Error = Callable[[str, str], None]


def _path(value: object, field: str, error: Error) -> str | None:
    if isinstance(value, str) and value and "\0" not in value:
        return value
    error(field, "must be a non-empty file path")
    return None


def top_fields(top: dict[str, Any], error: Error) -> dict[str, Any]:
    """The Config fields these keys give (only those present)."""
    fields: dict[str, Any] = {}
    if "keys_file" in top:
        fields["keys_file"] = _path(top["keys_file"], "keys_file", error)
    if "public_status" in top:
        if isinstance(top["public_status"], bool):
            fields["public_status"] = top["public_status"]
        else:
            error("public_status", "must be true or false")
    if "tls" in top:
        fields["tls"] = _tls(top["tls"], error)
    if "server_names" in top:
        fields["server_names"] = _server_names(top["server_names"], error)
    if "cors" in top:
        fields["cors"] = _cors(top["cors"], "keys_file" in top, error)
    return fields


def _cors(value: object, keyed: bool, error: Error) -> tuple[str, ...]:
    """`cors`: {"origins": [...]}, each a scheme://host[:port] origin, or "*"
    alone (refused with keys: a key would then be usable from any page)."""
    origins = value.get("origins") if isinstance(value, dict) else None
    if not isinstance(value, dict) or not isinstance(origins, list):
        error("cors", 'must be a JSON object with "origins", e.g. '
              '{"origins": ["https://chat.example"]}')
        return ()
    for key in value:
        if key not in _CORS_KEYS:
            error(f"cors.{key}", "unknown key" + did_you_mean(key, _CORS_KEYS))
    found = []
    for i, item in enumerate(origins):
        if item == "*":
            if keyed:
                error(f"cors.origins[{i}]", '"*" is refused with keys_file: name the origins')
            found.append(item)
        elif isinstance(item, str) and _ORIGIN.fullmatch(item):
            found.append(item.lower())
        else:
            error(f"cors.origins[{i}]", 'must be an origin such as "https://chat.example" '
                  '(scheme, host and optional port; no path) or "*"')
    if "*" in found and len(found) > 1:
        error("cors.origins", '"*" stands alone')
    return tuple(found)


def is_host_name(text: str) -> bool:
    """A DNS host name (RFC 1123 labels, lower case, no trailing dot), not an IP address."""
    if not text or len(text) > 253 or not all(_LABEL.fullmatch(x) for x in text.split(".")):
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return True
    return False


def _server_names(value: object, error: Error) -> tuple[str, ...]:
    """The names besides IP literals and localhost that a keyless admin action's
    Host may give, in lower case."""
    if not isinstance(value, list):
        error("server_names", 'must be a list of host names, e.g. ["gpu-gateway.lan"]')
        return ()
    names = []
    for i, item in enumerate(value):
        name = item.lower() if isinstance(item, str) else ""
        if is_host_name(name):
            names.append(name)
        else:
            error(f"server_names[{i}]", "must be a host name (IP addresses and localhost "
                  "need no listing)")
    return tuple(names)


def _tls(value: object, error: Error) -> TLSConfig | None:
    if not isinstance(value, dict):
        error("tls", 'must be a JSON object with "cert_file" and "key_file"')
        return None
    for key in value:
        if key not in _TLS_KEYS:
            error(f"tls.{key}", "unknown key" + did_you_mean(key, _TLS_KEYS))
    found = {}
    for key in _TLS_KEYS:
        if key not in value:
            error(f"tls.{key}", "required")
        else:
            found[key] = _path(value[key], f"tls.{key}", error)
    if len(found) == 2 and None not in found.values():
        return TLSConfig(str(found["cert_file"]), str(found["key_file"]))
    return None


def host_fields(d: dict[str, Any], path: str, url: str | None, error: Error) -> dict[str, Any]:
    """The HostConfig fields these keys give; TLS keys only for an https url."""
    fields: dict[str, Any] = {}
    if "api_key_env" in d:
        name = d["api_key_env"]
        if isinstance(name, str) and _ENV_NAME.fullmatch(name):
            fields["api_key_env"] = name
        else:
            error(f"{path}.api_key_env", "must name an environment variable "
                  "([A-Za-z_][A-Za-z0-9_]*), never hold the key itself")
    for key in _HOST_FILES:
        if key in d:
            fields[key] = _path(d[key], f"{path}.{key}", error)
    if "insecure_skip_verify" in d:
        if isinstance(d["insecure_skip_verify"], bool):
            fields["insecure_skip_verify"] = d["insecure_skip_verify"]
        else:
            error(f"{path}.insecure_skip_verify", "must be true or false")
    tls_keys = [k for k in (*_HOST_FILES, "insecure_skip_verify") if k in d]
    if tls_keys and url is not None and not url.startswith("https://"):
        for key in tls_keys:
            error(f"{path}.{key}", "only for an https url")
    if ("client_cert_file" in d) != ("client_key_file" in d):
        missing = "client_key_file" if "client_cert_file" in d else "client_cert_file"
        error(f"{path}.{missing}", "required with "
              f"{'client_cert_file' if missing == 'client_key_file' else 'client_key_file'}")
    if fields.get("insecure_skip_verify") and "ca_file" in d:
        error(f"{path}.ca_file", "pointless with insecure_skip_verify: true")
    return fields


def resolve_paths(config: Config, base_dir: str) -> Config:
    """`config` with its relative file paths made absolute against `base_dir`
    (the config file's directory), so a reload reads the same files."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else os.path.join(base_dir, path)

    hosts = tuple(dataclasses.replace(h, ca_file=absolute(h.ca_file),
                                      client_cert_file=absolute(h.client_cert_file),
                                      client_key_file=absolute(h.client_key_file))
                  for h in config.hosts)
    tls = None if config.tls is None else TLSConfig(
        str(absolute(config.tls.cert_file)), str(absolute(config.tls.key_file)))
    return dataclasses.replace(config, hosts=hosts, keys_file=absolute(config.keys_file),
                               tls=tls)


def secrets_of(hosts: tuple[HostConfig, ...], environ: dict[str, str] | Any
               ) -> tuple[dict[str, str], list[str]]:
    """Each host's upstream key read from its `api_key_env`, and an error per
    variable that is missing or empty (naming the variable, never a value)."""
    keys: dict[str, str] = {}
    errors: list[str] = []
    for i, host in enumerate(hosts):
        if host.api_key_env is None:
            continue
        value = environ.get(host.api_key_env, "")
        if value:
            keys[host.name] = value
        else:
            errors.append(f"hosts[{i}].api_key_env: the environment variable "
                          f"{host.api_key_env} is not set (or empty)")
    return keys, errors
