"""What the config's access and TLS fields name, read once at start-up: the keys
file, each host's upstream key from its `api_key_env`, the upstreams' TLS files
and the listener's certificate. `tap.postOptions` loads them through `load_startup`
(a failure refuses to start), and so does `llmproxy check`, so what one refuses the other
refuses with the same message and `makeService` hands the same value to the engine client and to the
service. A SIGHUP re-reads the keys file and the certificate as reloadable parts
(`keysfile`, `tlslistener`), not through here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmproxy.config import Config, ConfigError, load_config
from llmproxy.config.keys import KeyRing, load_keys
from llmproxy.config.security import secrets_of
from llmproxy.lifecycle.tlslistener import ServerCertificate
from llmproxy.lifecycle.upstreamtls import HostTLSPolicy


def _no_host_policy() -> HostTLSPolicy:
    return HostTLSPolicy(())


@dataclass(frozen=True)
class AccessFiles:
    """The access files as loaded: the inbound keys (None: keys are off), each
    host's upstream key by host name, the engine client's TLS policy and the
    listener's certificate (None: plain http). The defaults are a config that
    names none of them (the policy verifies every https upstream against the
    system's roots)."""

    keys: KeyRing | None = None
    upstream_keys: Mapping[str, str] = field(default_factory=dict, repr=False)  # secrets
    tls_policy: HostTLSPolicy = field(default_factory=_no_host_policy)
    certificate: ServerCertificate | None = None


def load_access_files(config: Config, environ: Mapping[str, str] | Any) -> AccessFiles:
    """Every file and variable the config's access fields name, read once; one
    ConfigError listing every error (each naming its file, variable or field,
    never a value) when any is bad."""
    upstream_keys, errors = secrets_of(config.hosts, environ)
    keys = policy = certificate = None
    try:
        keys = load_keys(config.keys_file) if config.keys_file is not None else None
    except ConfigError as e:
        errors += e.errors
    try:
        policy = HostTLSPolicy(config.hosts)
    except ConfigError as e:
        errors += e.errors
    try:
        certificate = ServerCertificate(config.tls) if config.tls is not None else None
    except ConfigError as e:
        errors += e.errors
    if errors or policy is None:
        raise ConfigError(errors)
    return AccessFiles(keys, upstream_keys, policy, certificate)


def load_startup(path: str, environ: Mapping[str, str] | Any) -> tuple[Config, AccessFiles]:
    """What `twistd llmproxy -c PATH` loads before anything starts: the config and
    its access files. One ConfigError naming each field, file or variable when
    either is bad; the one loader of twistd and of `llmproxy check`."""
    config = load_config(path)
    return config, load_access_files(config, environ)
