"""What each host can serve: its `GET /v1/models`, read in numbered generations.

Reads overlap (start-up, the periodic refresh, a reload, one host's read when
its engine becomes ready or its watch says hello): every read gets a
number, a result from an older read than the one stored is dropped, and only a
successful read moves a host's stored number forward, so a failed newer read
never discards an older good roster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime

from llmproxy.config import HostConfig
from llmproxy.core.events import RosterRead
from llmproxy.core.failures import describe
from llmproxy.core.hub import Hub, Publish


@dataclass(frozen=True)
class RosterEntry:
    """One model a host's engine reports."""

    id: str
    ctx: int | None = None


@dataclass(frozen=True)
class HostRoster:
    """The last good roster of a host, and the last trouble reading it."""

    generation: int = 0
    models: tuple[RosterEntry, ...] = ()
    fetched_at: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None


class RosterFetcher(Protocol):
    """Fetches one host's roster; fails with a readable reason."""

    def __call__(self, host: HostConfig) -> Deferred[tuple[RosterEntry, ...]]: ...


def parse_roster(doc: Any) -> tuple[RosterEntry, ...]:
    """The entries of an OpenAI-style model list; ValueError if it is not one."""
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ValueError('not an OpenAI model list (no "data" list)')
    entries = []
    for item in doc["data"]:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            raise ValueError('a model list entry has no string "id"')
        entries.append(RosterEntry(item["id"], _reported_ctx(item)))
    return tuple(entries)


def _reported_ctx(item: dict[str, Any]) -> int | None:
    # llama-server says meta.n_ctx_train; others say context_length or max_model_len.
    meta = item.get("meta")
    candidates = [item.get("context_length"), item.get("max_model_len")]
    if isinstance(meta, dict):
        candidates[:0] = [meta.get("n_ctx"), meta.get("n_ctx_train")]
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class Rosters:
    """Every host's roster, updated by numbered reads; each read's end is published."""

    def __init__(self, clock: IReactorTime, fetch: RosterFetcher, timeout: float,
                 on_change: Callable[[], None] = lambda: None,
                 publish: Publish | None = None) -> None:
        self._clock = clock
        self._publish = publish or Hub.logging().publish
        self._fetch = fetch
        self._timeout = timeout
        self._on_change = on_change
        self._last_read = 0
        self.by_host: dict[str, HostRoster] = {}

    def read_all(self, hosts: Iterable[HostConfig]) -> Deferred[None]:
        """Start one numbered read of every host; fires when all settled, never fails."""
        self._last_read += 1
        number = self._last_read
        reads = [self._read(host, number) for host in hosts]
        done: Deferred[Any] = DeferredList(reads, consumeErrors=True)
        return done.addCallback(lambda _: None)

    def read_one(self, host: HostConfig) -> Deferred[None]:
        """Start one numbered read of `host` alone (its engine just became ready, or its
        watch said hello); fires when it settled, never fails."""
        self._last_read += 1
        return self._read(host, self._last_read)

    def _read(self, host: HostConfig, number: int) -> Deferred[None]:
        d = self._fetch(host)
        d.addTimeout(self._timeout, self._clock)
        return d.addCallbacks(
            lambda entries: self.record_success(host.name, number, entries),
            lambda f: self.record_failure(host.name, number, _reason(f, self._timeout)),
        )

    def record_success(self, host: str, number: int, entries: tuple[RosterEntry, ...]) -> None:
        """Store a read's result unless a newer read already stored one."""
        current = self.by_host.get(host, HostRoster())
        now = self._clock.seconds()
        if number < current.generation:
            self._publish(RosterRead(now, host, "stale", number, len(entries),
                                     stored=current.generation))
            return
        self.by_host[host] = HostRoster(number, entries, now)
        self._on_change()
        self._publish(RosterRead(now, host, "ok", number, len(entries)))

    def record_failure(self, host: str, number: int, reason: str) -> None:
        """Note a failed read; the last good roster stays."""
        current = self.by_host.get(host, HostRoster())
        if number < current.generation:
            return
        now = self._clock.seconds()
        self.by_host[host] = replace(current, last_error=reason, last_error_at=now)
        self._on_change()
        self._publish(RosterRead(now, host, "failed", number, error=reason))


def _reason(failure: Any, timeout: float) -> str:
    from twisted.internet.defer import TimeoutError

    if failure.check(TimeoutError):
        return f"no answer within {timeout:g}s"
    return describe(failure.value)


class _HTTPGetter(Protocol):
    def get(self, url: str) -> Deferred[Any]: ...


def http_fetcher(http: _HTTPGetter) -> RosterFetcher:
    """A RosterFetcher that asks the host's own `GET /v1/models` (treq-like client)."""
    import json

    from twisted.web.client import readBody

    async def fetch(host: HostConfig) -> tuple[RosterEntry, ...]:
        response = await http.get(host.url + "/v1/models")
        body = await readBody(response)
        if response.code != 200:
            raise ValueError(f"GET /v1/models answered {response.code}")
        try:
            doc = json.loads(body)
        except ValueError:
            raise ValueError("GET /v1/models did not answer JSON") from None
        return parse_roster(doc)

    return lambda host: Deferred.fromCoroutine(fetch(host))
