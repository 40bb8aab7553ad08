"""Fast paths that rest on Twisted's internals, kept apart from the reference path.

The reference path (stock `twisted.web.server.Site`/`Request`, treq over
`twisted.web.client.Agent`, the stock reactor) keeps every promise on its own.
A speedup only makes it cheaper. Every use of a private Twisted name, every
method swapped on a Twisted object, every socket read by hand lives in this
package and nowhere else (tests/test_public_ground.py holds that rule).

Each speedup module defines `SPEEDUP`, a `Speedup`: its name, what it makes
cheaper, and a guard that checks the installed Twisted is the one whose code
the speedup copies or rests on (and that a library it uses is there).
`select(environ)` runs every guard once at start-up and says which speedups are
on; a guard that fails turns its speedup off, and the start-up log, `/status`,
the page and `/metrics` say which one and why. `LLMPROXY_SPEEDUPS=0` turns them
all off: the reference path alone.

Modules:

- `guards`: the guard helpers (a digest of the Twisted source a speedup follows).
- `socketwrites`: writing to a TCP socket in the turn the bytes are ready (a
  helper of the speedups that write; its `guard` is part of theirs).
- `responsewrites` (speedup `response_writes`): a response's head, chunks and
  end sent in one send each, in the turn they are written (through `socketwrites`);
  the write stall sees a slow reader's progress.
- `site`: the Site class a selection runs (`site_class`), the one above mixed in.
- `engineclient` (speedup `engine_client`): the HTTP/1.1 client to the engines,
  its pool of checked idle connections that learns each engine's idle close;
  `engineconnection` is one connection (the socket read straight to the
  parser), `enginemessage` the pieces around it (the responses read by
  httptools, llhttp, behind web.enginehead's rules), and `relaychunks` the
  relay that frames each read's data as one chunk of its own and the headers
  that pass each way (`relay_class`). Its guard also wants httptools (>= 0.6).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SWITCH = "LLMPROXY_SPEEDUPS"
# Names of speedups to leave off, comma-separated (what `make bench` uses to
# measure each one's gain): each is reported off with this as its reason.
OFF = "LLMPROXY_SPEEDUPS_OFF"

# The speedup modules, each with its `SPEEDUP`, in the order they are reported.
MODULES: tuple[str, ...] = (
    "llmproxy.speedups.responsewrites",
    "llmproxy.speedups.engineclient",
)


@dataclass(frozen=True)
class Speedup:
    """One fast path: `guard()` is None when the installed Twisted is the one
    the speedup was written against, else the reason it cannot be on."""

    name: str
    summary: str
    guard: Callable[[], str | None]


@dataclass(frozen=True)
class Selection:
    """Which speedups this process runs: `enabled` is the switch; `active` the
    speedups on; `off` every other one, with the reason it is off."""

    enabled: bool
    active: tuple[str, ...] = ()
    off: Mapping[str, str] = field(default_factory=dict)

    def on(self, name: str) -> bool:
        return name in self.active

    def as_json(self) -> dict[str, Any]:
        """The `/status` document's `speedups` field."""
        return {"enabled": self.enabled, "active": list(self.active), "off": dict(self.off)}


REFERENCE = Selection(enabled=False)


def known() -> tuple[Speedup, ...]:
    """Every speedup this package has (importing a speedup module has no side effect)."""
    return tuple(importlib.import_module(name).SPEEDUP for name in MODULES)


def switched_on(environ: Mapping[str, str]) -> bool:
    """The switch: on unless LLMPROXY_SPEEDUPS is 0 (or off, false, no)."""
    return environ.get(SWITCH, "1").strip().lower() not in {"0", "off", "false", "no"}


def run_guard(speedup: Speedup) -> str | None:
    """`speedup`'s guard, which may not raise: an exception is a reason too."""
    try:
        return speedup.guard()
    except Exception as e:           # a guard that cannot tell says so, never crashes
        return f"its guard failed: {type(e).__name__}: {e}"


def select(environ: Mapping[str, str]) -> Selection:
    """The speedups to run, by the switch and each guard."""
    speedups = known()
    if not switched_on(environ):
        return Selection(False, (), {s.name: f"{SWITCH}=0" for s in speedups})
    active, off = [], {}
    unwanted = {n.strip() for n in environ.get(OFF, "").split(",") if n.strip()}
    for speedup in speedups:
        why = f"{OFF} names it" if speedup.name in unwanted else run_guard(speedup)
        if why is None:
            active.append(speedup.name)
        else:
            off[speedup.name] = why
    return Selection(True, tuple(active), off)
