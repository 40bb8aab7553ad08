"""Inbound API keys: the keys file as a frozen value, and the lookup of a
presented secret.

The file holds no secret, only each key's SHA-256 (`printf %s SECRET |
sha256sum`): ``{"keys": [{"name": "alice", "sha256": "<hex>", "models":
["qwen*"], "admin": false, "priority": "high", "rpm": 60, "tpm": 100000,
"wh_per_day": 50}]}`` (`priority`: its requests' class in a host's queue;
`rpm`, `tpm`: its limits of requests and of tokens per minute; `wh_per_day`:
its budget of GPU energy in watt-hours per UTC day; none by default). A presented secret is
hashed and compared with every key's digest in constant time
(`hmac.compare_digest`, no early exit), so neither the timing nor any message
says which key came close. Errors name the file and the field, never a value.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from llmproxy.config.files import read_text
from llmproxy.config.values import ConfigError
from llmproxy.core.text import did_you_mean

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]*")
_HEX = re.compile(r"[0-9a-fA-F]{64}")
_KEY_KEYS = ("name", "sha256", "models", "admin", "priority", "rpm", "tpm", "wh_per_day")
PRIORITIES = ("high", "normal", "low")      # a queue serves them in this order


@dataclass(frozen=True)
class ApiKey:
    """One client key: its name (what logs, events and metrics carry), the
    SHA-256 of its secret, the model globs it may use (None: every model) and
    whether it may read and run the admin endpoints; its requests' priority
    class, and its limits per minute (None: no limit)."""

    name: str
    digest: bytes
    models: tuple[str, ...] | None = None
    admin: bool = False
    priority: str = "normal"
    rpm: int | None = None
    tpm: int | None = None
    wh_per_day: float | None = None     # its energy budget (web/energybudget.py)

    def __repr__(self) -> str:            # the digest is not a secret, but it stays home
        return (f"ApiKey(name={self.name!r}, models={self.models!r}, admin={self.admin!r}, "
                f"priority={self.priority!r}, rpm={self.rpm!r}, tpm={self.tpm!r}, "
                f"wh_per_day={self.wh_per_day!r})")

    def allows(self, names: Iterable[str]) -> bool:
        """Whether any of a model's public spellings matches one of the globs."""
        if self.models is None:
            return True
        return any(fnmatchcase(name, glob) for name in names for glob in self.models)


@dataclass(frozen=True)
class KeyRing:
    """Every key of the keys file."""

    keys: tuple[ApiKey, ...] = ()

    def find(self, secret: bytes) -> ApiKey | None:
        """The key whose secret this is, or None; the same work for every key."""
        digest = hashlib.sha256(secret).digest()
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    def names(self) -> list[str]:
        return [k.name for k in self.keys]

    def changes_from(self, old: KeyRing | None) -> list[str]:
        """`+name`, `-name`, `~name` (its secret, scope, admin, priority or limits changed)."""
        before = {k.name: k for k in old.keys} if old is not None else {}
        after = {k.name: k for k in self.keys}
        return ([f"+{n}" for n in after if n not in before]
                + [f"-{n}" for n in before if n not in after]
                + [f"~{n}" for n in after if n in before and after[n] != before[n]])


def parse_keys(obj: object, where: str) -> KeyRing:
    """Validate a decoded keys file; ConfigError naming `where` and each field."""
    errors: list[str] = []

    def error(field: str, message: str) -> None:
        errors.append(f"{where}: {field}: {message}")

    if not isinstance(obj, dict) or "keys" not in obj:
        raise ConfigError([f'{where}: must be a JSON object with a "keys" list'])
    for key in obj:
        if key != "keys":
            error(key, "unknown key" + did_you_mean(key, ("keys",)))
    if not isinstance(obj["keys"], list):
        raise ConfigError([*errors, f"{where}: keys: must be a list"])
    keys: list[ApiKey] = []
    seen_names: dict[str, int] = {}
    seen_digests: dict[bytes, int] = {}
    for i, item in enumerate(obj["keys"]):
        key = _key(item, f"keys[{i}]", error)
        if key is None:
            continue
        if key.name in seen_names:
            error(f"keys[{i}].name", f"duplicate of keys[{seen_names[key.name]}]")
        if key.digest in seen_digests:
            error(f"keys[{i}].sha256", f"the same secret as keys[{seen_digests[key.digest]}]")
        seen_names.setdefault(key.name, i)
        seen_digests.setdefault(key.digest, i)
        keys.append(key)
    if errors:
        raise ConfigError(errors)
    return KeyRing(tuple(keys))


def _key(item: object, path: str, error: Any) -> ApiKey | None:
    if not isinstance(item, dict):
        error(path, "must be a JSON object")
        return None
    for k in item:
        if k not in _KEY_KEYS:
            error(f"{path}.{k}", "unknown key" + did_you_mean(k, _KEY_KEYS))
    name, digest = item.get("name"), item.get("sha256")
    ok = True
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        error(f"{path}.name", "required: a name matching [A-Za-z0-9][A-Za-z0-9._@-]*")
        ok = False
    if not isinstance(digest, str) or not _HEX.fullmatch(digest):
        error(f"{path}.sha256", "required: 64 hex digits, the SHA-256 of the secret "
              "(printf %s SECRET | sha256sum)")
        ok = False
    models = item.get("models")
    if "models" in item and not (isinstance(models, list) and all(
            isinstance(m, str) and m for m in models)):
        error(f"{path}.models", "must be a list of non-empty model name globs")
        ok = False
    admin = item.get("admin", False)
    if not isinstance(admin, bool):
        error(f"{path}.admin", "must be true or false")
        ok = False
    priority = item.get("priority", "normal")
    if priority not in PRIORITIES:
        error(f"{path}.priority", 'must be "high", "normal" or "low"')
        ok = False
    limits = {}
    for field in ("rpm", "tpm"):
        value = item.get(field)
        if field in item and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
            error(f"{path}.{field}", "must be a whole number of at least 1 (per minute)")
            ok = False
        limits[field] = value
    budget = item.get("wh_per_day")
    if "wh_per_day" in item and (not isinstance(budget, (int, float)) or isinstance(
            budget, bool) or not 0 < budget < 1e12):
        error(f"{path}.wh_per_day", "must be a number above 0 (watt-hours per day)")
        ok = False
    if not ok:
        return None
    return ApiKey(str(name), bytes.fromhex(str(digest)),
                  tuple(models) if isinstance(models, list) else None, admin, str(priority),
                  limits["rpm"], limits["tpm"],
                  None if budget is None else float(budget))


def load_keys(path: str) -> KeyRing:
    """Read and validate the keys file at `path`."""
    text = read_text(path)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        # Line and column only: the message never quotes the file.
        raise ConfigError([f"{path}: not valid JSON: line {e.lineno} column {e.colno}"]) \
            from None
    except RecursionError:
        raise ConfigError([f"{path}: not valid JSON: nested too deeply"]) from None
    return parse_keys(obj, path)
