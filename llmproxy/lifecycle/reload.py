"""SIGHUP reload that tells the truth.

Only `models`, `aliases` and `naming` can change while running; any other
difference refuses the whole reload and names every offending field. A file
that cannot be read or validated keeps the running config. Reloadable parts
kept in files of their own (the keys file, the TLS certificate) are re-read on
every reload, all or nothing with the config: one bad file keeps everything
running as it was, and the log line names what was re-read. Reloads that
arrive while one runs are coalesced: one more read follows, of the file as it
is then (the last file wins); two reloads never interleave.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from llmproxy.config import Config, ConfigError, HostConfig
from llmproxy.core.events import ReloadDone
from llmproxy.core.hub import Hub, Publish

RELOADABLE = ("models", "aliases", "naming")
APPLIED = "applied"
KEPT = "kept"


@dataclass(frozen=True)
class ReloadResult:
    """What one reload did, in the words the log and STATUS= use."""

    outcome: str          # APPLIED or KEPT
    message: str          # "reload: applied ..." / "reload: kept the running config: ..."
    at: float
    generation: int       # the config generation after it

    @property
    def applied(self) -> bool:
        return self.outcome == APPLIED

    def as_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "message": self.message, "at": self.at,
                "generation": self.generation}


@dataclass(frozen=True)
class Staged:
    """A reloadable part read and validated, not yet in force."""

    label: str                  # what was re-read: "keys file /etc/keys.json (3 keys)"
    changes: list[str]          # in the reload's words: ["keys (+bob)"]; [] if unchanged
    commit: Callable[[], None]  # put it in force


class Reloadable(Protocol):
    """A part re-read on every reload besides the config file."""

    name: str                   # "keys file", "tls certificate"

    def stage(self, config: Config) -> Staged:
        """Read and validate it for `config`; ConfigError if it is bad."""


def refused_changes(old: Config, new: Config) -> list[str]:
    """Every difference outside the reloadable fields, by field name."""
    refused = []
    for f in fields(Config):
        if f.name in RELOADABLE:
            continue
        before, after = getattr(old, f.name), getattr(new, f.name)
        if before == after:
            continue
        if f.name == "hosts":
            refused += _host_changes(before, after)
        else:
            refused.append(f"{f.name} changed: restart to apply")
    return refused


def _host_changes(old: tuple[HostConfig, ...], new: tuple[HostConfig, ...]) -> list[str]:
    if len(old) != len(new):
        return [f"hosts changed ({len(old)} -> {len(new)} hosts): restart to apply"]
    out = []
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        for f in fields(HostConfig):
            if getattr(a, f.name) != getattr(b, f.name):
                out.append(f"hosts[{i}].{f.name} changed: restart to apply")
    return out


def applied_changes(old: Config, new: Config) -> list[str]:
    """The reloadable differences, in words: `models (+a, -b, ~c)`, `aliases (...)`, `naming`."""
    out = []
    for name in ("models", "aliases"):
        before, after = getattr(old, name), getattr(new, name)
        added = [k for k in after if k not in before]
        removed = [k for k in before if k not in after]
        changed = [k for k in after if k in before and after[k] != before[k]]
        parts = [f"+{k}" for k in added] + [f"-{k}" for k in removed] + [f"~{k}" for k in changed]
        if parts:
            out.append(f"{name} ({', '.join(parts)})")
    if old.naming != new.naming:
        out.append(f"naming ({old.naming} -> {new.naming})")
    return out


class Reloader:
    """Runs reloads one at a time, coalescing requests that arrive meanwhile; each
    reload's outcome is published (`ReloadDone`)."""

    def __init__(self, *, load: Callable[[], Config], current: Callable[[], Config],
                 apply: Callable[[Config, list[str]], Awaitable[None]],
                 clock: IReactorTime, on_begin: Callable[[], None] = lambda: None,
                 on_end: Callable[[ReloadResult], None] = lambda r: None,
                 engine_models: Callable[[], set[str]] = set,
                 publish: Publish | None = None, parts: Sequence[Reloadable] = ()) -> None:
        self._load = load
        self._current = current
        self._apply = apply
        self._clock = clock
        self._on_begin = on_begin
        self._on_end = on_end
        self._engine_models = engine_models
        self._publish = publish or Hub.logging().publish
        self._parts = tuple(parts)
        self.generation = 1
        self.last: ReloadResult | None = None
        self._busy = False
        self._again = False
        self._waiters: list[Deferred[ReloadResult]] = []

    @property
    def busy(self) -> bool:
        """A reload is running."""
        return self._busy

    def request(self) -> Deferred[ReloadResult]:
        """Ask for a reload; fires with the result of the reload that read the
        file after this request."""
        d: Deferred[ReloadResult] = Deferred()
        self._waiters.append(d)
        if self._busy:
            self._again = True      # one more pass after the running one
        else:
            # The flag, not the Deferred: a reload that needs no waiting has
            # already finished when fromCoroutine returns.
            self._busy = True
            Deferred.fromCoroutine(self._loop())
        return d

    async def _loop(self) -> ReloadResult:
        while True:
            self._again = False
            waiters, self._waiters = self._waiters, []
            result = await self._once()
            for d in waiters:
                d.callback(result)
            if not self._again:
                self._busy = False
                return result

    async def _once(self) -> ReloadResult:
        self._on_begin()
        running = self._current()
        try:
            new = self._load()
        except ConfigError as e:
            return self._end(KEPT, "reload: kept the running config: the file is invalid: "
                             + "; ".join(e.errors))
        refused = refused_changes(running, new)
        if refused:
            return self._end(KEPT, "reload: kept the running config: " + "; ".join(refused))
        staged: list[Staged] = []
        for part in self._parts:
            try:
                staged.append(part.stage(new))
            except ConfigError as e:
                return self._end(KEPT, "reload: kept the running config: the "
                                 f"{part.name} is invalid: " + "; ".join(e.errors))
        reread = ("; re-read " + ", ".join(s.label for s in staged)) if staged else ""
        changes = applied_changes(running, new)
        extra = [c for s in staged for c in s.changes]
        if not changes and not extra:
            return self._end(APPLIED, "reload: applied nothing: the file has not changed"
                             + reread)
        self.generation += 1
        for s in staged:
            s.commit()
        if changes:
            await self._apply(new, changes)
        message = "reload: applied " + ", ".join(changes + extra)
        touched = _touched_models(running, new) & self._engine_models()
        if touched:
            message += ("; a running engine keeps its old preset (ctx, options) until it next "
                        f"starts ({', '.join(sorted(touched))})")
        return self._end(APPLIED, message + reread)

    def _end(self, outcome: str, message: str) -> ReloadResult:
        result = ReloadResult(outcome, message, self._clock.seconds(), self.generation)
        self.last = result
        self._publish(ReloadDone(result.at, outcome, message, self.generation))
        self._on_end(result)
        return result


def _touched_models(old: Config, new: Config) -> set[str]:
    return {k for k in new.models if k in old.models and new.models[k] != old.models[k]}
