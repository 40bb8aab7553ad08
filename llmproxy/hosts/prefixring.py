"""Automatic prefix affinity (`affinity: "prefix"`): which host a request's
stable prefix lands on, so that clients that send no session id still find
llama.cpp's prompt cache warm. Pure: no clock, no I/O.

`prefix_key` digests what stays the same across an agent's turns: the system
message(s) and the first user message of a chat (`messages`, with the
Anthropic API's top-level `system`), or the first PREFIX_BYTES of a
completion's `prompt`.

`pick` is consistent hashing with bounded loads (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018): each host has
VNODES points on a ring; a key goes to the first host clockwise from its own
point whose load is under ``ceil(BOUND * (total + 1) / hosts)``, so no host
takes more than BOUND times the average load before the next one on the ring
takes over. The ring of a set of hosts is the same wherever they appear: a
host that leaves the set moves only the keys that were its own.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

PREFIX_BYTES = 2048   # of a completion's prompt (UTF-8)
BOUND = 1.25          # a host's load may reach this much of the average (plus one)
VNODES = 100          # points per host on the ring: spreads keys evenly


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _bytes(value: Any) -> bytes:
    text = value if isinstance(value, str) else json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


def prefix_key(body: Mapping[str, Any]) -> str | None:
    """The digest of a request body's stable prefix; None when it has none (no
    `messages` with a system or user message, no `prompt`)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        head: list[Any] = []
        for message in messages:
            if not isinstance(message, dict):
                break
            head.append([message.get("role"), message.get("content")])
            if message.get("role") == "user":
                break
        system = body.get("system")
        if not head and system is None:
            return None
        data = _bytes([system, head])
    elif "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]          # a batch: its first prompt
        if prompt is None or prompt in ("", []):
            return None
        data = _bytes(prompt)[:PREFIX_BYTES]
    else:
        return None
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@lru_cache(maxsize=128)
def _ring(hosts: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The ring of a (sorted) set of hosts: its points in order, and their hosts."""
    points = sorted((_point(f"{host}#{i}".encode()), host) for host in hosts
                    for i in range(VNODES))
    return tuple(p for p, _ in points), tuple(h for _, h in points)


def order(key: str, hosts: Iterable[str]) -> list[str]:
    """Every one of `hosts`, once, in the ring's order from `key`'s point: the
    first is the key's own host."""
    members = tuple(sorted(set(hosts)))
    if not members:
        return []
    points, owners = _ring(members)
    start = bisect.bisect(points, _point(key.encode("utf-8", "surrogatepass")))
    found: list[str] = []
    for i in range(len(points)):
        host = owners[(start + i) % len(points)]
        if host not in found:
            found.append(host)
            if len(found) == len(members):
                break
    return found


def capacity(loads: Mapping[str, int], bound: float = BOUND) -> int:
    """The load under which a host still takes a key: ``ceil(bound * (total +
    1) / hosts)`` (the +1 is the key being placed)."""
    return math.ceil(bound * (sum(loads.values()) + 1) / len(loads))


def pick(key: str, loads: Mapping[str, int], bound: float = BOUND) -> str | None:
    """The host `key` goes to among `loads`' hosts (each one's requests in
    flight and queued): the first on the ring from the key whose load is under
    `capacity`. None when there is no host."""
    if not loads:
        return None
    limit = capacity(loads, bound)
    ranked = order(key, loads)
    return next((h for h in ranked if loads[h] < limit), ranked[0])
