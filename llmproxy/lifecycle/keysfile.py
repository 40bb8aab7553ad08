"""The keys file as a reloadable part: re-read on every reload, put in force
only when it validates (a bad file keeps the running keys; the reload's line
names the file and the field, never a value)."""

from __future__ import annotations

from typing import Any

from llmproxy.config import Config, ConfigError
from llmproxy.config.keys import load_keys
from llmproxy.lifecycle.components import Parts
from llmproxy.lifecycle.reload import Reloadable, Staged
from llmproxy.observe.keyusage import KeyUsage
from llmproxy.web.access import Access


class KeysFile:
    """Re-reads `config.keys_file` into `access`."""

    name = "keys file"

    def __init__(self, access: Access) -> None:
        self._access = access

    def stage(self, config: Config) -> Staged:
        if config.keys_file is None:        # a change of keys_file is refused anyway
            raise ConfigError(["keys_file: no longer set: restart to apply"])
        ring = load_keys(config.keys_file)
        changed = ring.changes_from(self._access.keys)
        n = len(ring.keys)

        def commit() -> None:
            self._access.keys = ring

        return Staged(f"keys file {config.keys_file} ({n} key{'' if n == 1 else 's'})",
                      [f"keys ({', '.join(changed)})"] if changed else [], commit)


def reloadable_parts(parts: Parts) -> list[Reloadable]:
    """The parts a reload re-reads besides the config file."""
    found: list[Reloadable] = []
    if parts.access.on:
        found.append(KeysFile(parts.access))
    if parts.certificate is not None:
        found.append(parts.certificate)
    return found


def access_status(access: Access, usage: KeyUsage, now: float) -> dict[str, Any]:
    """What /status says of access: whether keys are on, the CORS origins, and
    per key (by name) its requests and tokens, its priority, and its limits
    with what is left of them (`limits`, None: it has none)."""
    cors = sorted(access.cors.origins)
    if access.keys is None:
        return {"access": {"keys": False, "cors": cors}}
    per_key = usage.snapshot(access.keys.names(), now)
    keys = {k.name: k for k in access.keys.keys}
    for entry in per_key:
        key = keys.get(entry["name"])
        entry["priority"] = key.priority if key is not None else None
        entry["limits"] = (access.limits.snapshot(key)
                           if key is not None and access.limits is not None else None)
        entry["energy_budget"] = (access.energy.snapshot(key)
                                  if key is not None and access.energy is not None else None)
    return {"access": {"keys": True, "public_status": access.public_status, "cors": cors,
                       "per_key": per_key}}
