"""What Twisted has no public API for at all, where a feature needs it.

The reference path stands on public Twisted; the few features it cannot have
that way rest on a private name here, and nowhere else outside
llmproxy/speedups/. Unlike a speedup, an entry is not about speed: it is on
whenever its guard passes, whatever LLMPROXY_SPEEDUPS says. Each entry module
defines `COMPAT`, a `Compat`: its name, what it gives, the public API it waits
for (the day Twisted has it, the entry goes), a guard that checks the installed
Twisted is the one whose code it rests on (a digest of that code's source, as
llmproxy.speedups.guards records it), and the class it mixes into the HTTP
channel. `select()` runs every guard and says which entries are on; one that is
off is reported (start-up log, `/status`, `/metrics`), and its feature falls
back to Twisted's own behaviour.

Modules:

- `badrequest`: the answer to a malformed request is the channel's own (the
  proxy's JSON 400), not Twisted's bare 400.
- `acceptguard`: a listening port told when accept() fails for want of file
  descriptors (lifecycle/openfiles.py then pauses accepting).
- `goaway`: Twisted's HTTP/2 connection (by ALPN on the TLS listener),
  known to the site and drained with a two-phase GOAWAY at a stop or an
  upgrade; off, one GOAWAY once no request is in flight.
- `h2limits`: that connection bounded against one client (nothing buffered
  after an error, no spin on a shut window, a cut stream reset with
  INTERNAL_ERROR, the HTTP/1.1 header limits, no traceback from its frames);
  off, HTTP/2 is not offered.
- `streamhooks`: an HTTP/2 stream known to the site from its headers (the door,
  the body limit and timer before its body is read); off, no HTTP/2.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmproxy.core.sourcedigest import changed_sources

__all__ = ["Compat", "CompatSelection", "changed_sources", "channel_mixins", "known", "select"]

# The entry modules, each with its `COMPAT`, in the order they are reported.
MODULES: tuple[str, ...] = ("llmproxy.compat.badrequest", "llmproxy.compat.acceptguard",
                            "llmproxy.compat.goaway", "llmproxy.compat.h2limits",
                            "llmproxy.compat.streamhooks")


@dataclass(frozen=True)
class Compat:
    """One entry: `guard()` is None when the installed Twisted is the one the
    entry was written against, else the reason it cannot be on; `mixin`, if
    any, goes into the HTTP channel's bases (before it) while it is on."""

    name: str
    summary: str
    waits_for: str
    guard: Callable[[], str | None]
    mixin: type | None


@dataclass(frozen=True)
class CompatSelection:
    """Which entries this process runs (`active`), and every other one with
    the reason it is off."""

    active: tuple[str, ...] = ()
    off: Mapping[str, str] = field(default_factory=dict)

    def on(self, name: str) -> bool:
        return name in self.active

    def as_json(self) -> dict[str, Any]:
        """The `/status` document's `compat` field."""
        return {"active": list(self.active), "off": dict(self.off)}


def known() -> tuple[Compat, ...]:
    """Every entry this package has (importing an entry module has no side effect)."""
    return tuple(importlib.import_module(name).COMPAT for name in MODULES)


def select() -> CompatSelection:
    """The entries whose guard passes; the others, with why."""
    active, off = [], {}
    for entry in known():
        try:
            why = entry.guard()
        except Exception as e:        # a guard that cannot tell says so, never crashes
            why = f"its guard failed: {type(e).__name__}: {e}"
        if why is None:
            active.append(entry.name)
        else:
            off[entry.name] = why
    return CompatSelection(tuple(active), off)


def channel_mixins(selection: CompatSelection) -> tuple[type, ...]:
    """The classes the active entries mix into the HTTP channel."""
    return tuple(entry.mixin for entry in known()
                 if entry.mixin is not None and selection.on(entry.name))
