"""A host's sleep and wake keys, validated like the rest (`parse`): ``wake`` (how a
Wake-on-LAN magic packet reaches it, and how long a wake may take) and ``sleep``
(after how long idle its agent runs which command). Every error names its field."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Protocol

HOST_KEYS = ("wake", "sleep")
WAKE_KEYS = ("mac", "broadcast", "port", "timeout_seconds")
SLEEP_KEYS = ("after_seconds", "command")
_MAC = re.compile(r"[0-9A-Fa-f]{2}([:-])[0-9A-Fa-f]{2}(?:\1[0-9A-Fa-f]{2}){4}")


@dataclass(frozen=True)
class WakeConfig:
    """Where a host's magic packet goes: its `mac` (12 hex digits, lower case), the
    IPv4 `broadcast` address and UDP `port`; a wake not done in `timeout_seconds` fails."""

    mac: str
    broadcast: str
    port: int = 9
    timeout_seconds: float = 120.0


@dataclass(frozen=True)
class SleepConfig:
    """A managed host with no engine and no request for `after_seconds` is put to sleep
    by its agent running `command`."""

    after_seconds: float
    command: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))


class Checks(Protocol):
    """What these checks use of the config parser."""

    def error(self, path: str, message: str) -> None: ...

    def mapping(self, value: object, path: str, keys: Any) -> dict[str, Any]: ...

    def seconds(self, value: object, path: str, positive: bool = True) -> float: ...

    def command(self, value: object, path: str) -> tuple[str, ...] | None: ...


def mac_digits(text: str) -> str | None:
    """The 12 lower-case hex digits of a MAC written ``aa:bb:cc:dd:ee:ff`` (or with
    ``-``), or None when it is not one."""
    if not _MAC.fullmatch(text):
        return None
    return re.sub(r"[:-]", "", text).lower()


def host_sleep_wake(p: Checks, d: dict[str, Any], path: str, managed: bool) -> dict[str, Any]:
    """The HostConfig fields `wake` and `sleep` when given."""
    out: dict[str, Any] = {}
    if "wake" in d:
        out["wake"] = _wake(p, p.mapping(d["wake"], f"{path}.wake", WAKE_KEYS), f"{path}.wake")
        if not managed:
            p.error(f"{path}.wake", "needs engines: only a managed host is woken")
    if "sleep" in d:
        out["sleep"] = _sleep(p, p.mapping(d["sleep"], f"{path}.sleep", SLEEP_KEYS),
                              f"{path}.sleep")
        if not managed:
            p.error(f"{path}.sleep", "needs engines: only a managed host's agent puts it "
                                     "to sleep")
    return out


def _wake(p: Checks, d: dict[str, Any], path: str) -> WakeConfig:
    mac = d.get("mac")
    digits = mac_digits(mac) if isinstance(mac, str) else None
    if "mac" not in d:
        p.error(f"{path}.mac", "required")
    elif digits is None:
        p.error(f"{path}.mac", 'must be a MAC address like "aa:bb:cc:dd:ee:ff"')
    broadcast = d.get("broadcast")
    if "broadcast" not in d:
        p.error(f"{path}.broadcast", "required")
        broadcast = None
    else:
        try:
            broadcast = str(ipaddress.IPv4Address(broadcast))
        except (ValueError, TypeError):
            p.error(f"{path}.broadcast", 'must be an IPv4 address like "10.0.0.255"')
            broadcast = None
    port = d.get("port", WakeConfig.port)
    if type(port) is not int or not 1 <= port <= 65535:
        p.error(f"{path}.port", "must be a port number, 1 to 65535")
        port = WakeConfig.port
    timeout = WakeConfig.timeout_seconds
    if "timeout_seconds" in d:
        timeout = p.seconds(d["timeout_seconds"], f"{path}.timeout_seconds")
    return WakeConfig(digits or "", broadcast or "", port, timeout)


def _sleep(p: Checks, d: dict[str, Any], path: str) -> SleepConfig:
    after = 0.0
    if "after_seconds" not in d:
        p.error(f"{path}.after_seconds", "required")
    else:
        after = p.seconds(d["after_seconds"], f"{path}.after_seconds")
    command: tuple[str, ...] | None = None
    if "command" not in d:
        p.error(f"{path}.command", "required")
    else:
        command = p.command(d["command"], f"{path}.command")
    return SleepConfig(after, command or ())
