"""llmproxy as the bench starts it: in each mode, checked by its own /status.

The same twistd llmproxy runs as up to three kinds of target:

- `llmproxy`: with its speedups (llmproxy/speedups/), `LLMPROXY_SPEEDUPS=1`;
- `llmproxy-reference`: the reference path alone, `LLMPROXY_SPEEDUPS=0`;
- `llmproxy-without-NAME` (`--without NAME`): the speedups but the one named,
  `LLMPROXY_SPEEDUPS=1 LLMPROXY_SPEEDUPS_OFF=NAME`, to show that speedup's gain;
- `llmproxy-capture`, `llmproxy-reference-capture`: either mode with capture on (a
  `"capture": {}` block: the defaults), to show what the capture costs beside it
  (`--capture` turns it on in every llmproxy target instead, budgets and all).

Each gets the variables explicitly (whatever the bench's own environment holds),
and once it listens its `/status` must say it runs the mode asked for: a bench
that measured the wrong path would report figures of the wrong code, so a
mismatch stops the run (StartError) instead.
"""

from __future__ import annotations

import http.client
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.targets import HOST, StartError, Target, child_env, start_listening

# llmproxy.speedups.SWITCH and .OFF (tests/test_bench_modes.py holds them equal).
SWITCH = "LLMPROXY_SPEEDUPS"
OFF = "LLMPROXY_SPEEDUPS_OFF"

PROXY = "llmproxy"
REFERENCE = "llmproxy-reference"
WITHOUT = "llmproxy-without-"
CAPTURE = "-capture"          # a target name's suffix: that target with capture on
SPEEDUP_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Mode:
    """What a llmproxy target runs: the speedups on or not, and which are left off."""

    speedups: bool = True
    off: tuple[str, ...] = ()
    capture: bool = False          # a `capture` block in its config

    def describe(self) -> str:
        also = ", capture on" if self.capture else ""
        if not self.speedups:
            return f"the reference path alone ({SWITCH}=0){also}"
        if self.off:
            return f"speedups on but {', '.join(self.off)} ({OFF}={','.join(self.off)}){also}"
        return f"speedups on ({SWITCH}=1){also}"


def mode_of(name: str) -> Mode | None:
    """The mode a target name asks for; None when it is no llmproxy target."""
    if name in (PROXY + CAPTURE, REFERENCE + CAPTURE):
        base = mode_of(name.removesuffix(CAPTURE))
        return None if base is None else replace(base, capture=True)
    if name == PROXY:
        return Mode()
    if name == REFERENCE:
        return Mode(speedups=False)
    if name.startswith(WITHOUT) and SPEEDUP_NAME.fullmatch(name[len(WITHOUT):]):
        return Mode(off=(name[len(WITHOUT):],))
    return None


def without_targets(names: Iterable[str]) -> list[str]:
    """The target measuring llmproxy without each named speedup."""
    return [WITHOUT + name for name in names]


def proxy_env(mode: Mode, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a llmproxy target: the children's (`base`, else
    `child_env()`) with the switch set explicitly and LLMPROXY_SPEEDUPS_OFF
    holding exactly the speedups this mode leaves off (none: not set at all)."""
    env = dict(child_env() if base is None else base)
    env[SWITCH] = "1" if mode.speedups else "0"
    env.pop(OFF, None)
    if mode.off:
        env[OFF] = ",".join(mode.off)
    return env


def mismatch(name: str, mode: Mode, status: Mapping[str, Any]) -> str | None:
    """Why the `/status` document of target `name` says it does not run `mode`;
    None when it does."""
    found = status.get("speedups")
    if not isinstance(found, Mapping) or not isinstance(found.get("enabled"), bool):
        return (f"{name}: its /status has no speedups.enabled, so it cannot say which path "
                f"it runs (asked for {mode.describe()})")
    enabled = found["enabled"]
    active = list(found.get("active") or [])
    off = dict(found.get("off") or {})
    if enabled is not mode.speedups:
        return (f"{name} was started with {SWITCH}={'1' if mode.speedups else '0'} but its "
                f"/status says speedups.enabled is {str(enabled).lower()}: it would measure "
                "the wrong path")
    if not mode.speedups and active:
        return (f"{name} runs the reference path but its /status lists speedups active: "
                f"{', '.join(active)}")
    for speedup in mode.off:
        if speedup in active:
            return (f"{name} was started with {OFF}={','.join(mode.off)} but its /status "
                    f"lists {speedup} active: it would measure that speedup too")
        if speedup not in off:
            known = sorted({*active, *off})
            return (f"{name}: llmproxy has no speedup named {speedup!r} (it has: "
                    f"{', '.join(known) or 'none'})")
    return None


def read_status(port: int, timeout: float = 10.0) -> dict[str, Any]:
    """GET /status from a llmproxy on this machine (no keys file: open on loopback)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", "/status")
        response = conn.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException) as e:
        raise StartError(f"GET /status on port {port} failed: {e}") from e
    finally:
        conn.close()
    if response.status != 200:
        raise StartError(f"GET /status on port {port} answered {response.status}: "
                         f"{body[:200]!r}")
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise StartError(f"GET /status on port {port} is not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise StartError(f"GET /status on port {port} is not a JSON object")
    return doc


def _capturing(name: str, port: int) -> None:
    """StartError unless the target's GET /api/captures says capture is on."""
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        conn.request("GET", "/api/captures?limit=1")
        doc = json.loads(conn.getresponse().read())
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise StartError(f"{name}: GET /api/captures failed: {e}") from e
    finally:
        conn.close()
    if not isinstance(doc, dict) or doc.get("enabled") is not True:
        raise StartError(f"{name} was started with capture on, but its /api/captures says "
                         "it is off: it would measure the wrong thing")


def twistd_path() -> Path:
    """The twistd beside the interpreter running the bench (the worktree's .venv)."""
    return Path(sys.executable).parent / "twistd"


def start_llmproxy(workdir: Path, engine_port: int, name: str = PROXY,
                   mode: Mode | None = None) -> Target:
    """`twistd -n --pidfile= llmproxy -c CONFIG` in front of the engine, on a free port,
    in `mode` (by default the one its name asks for); stopped again and StartError when
    its /status says otherwise."""
    mode = mode if mode is not None else mode_of(name)
    if mode is None:
        raise StartError(f"{name} is no llmproxy target")
    config = {
        "listen": f"{HOST}:0",
        "hosts": [{"name": "bench", "url": f"http://{HOST}:{engine_port}"}],
        "models": {"bench": {"host": "bench"}},
        **({"capture": {}} if mode.capture else {}),
    }
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(config, indent=2))
    twistd = twistd_path()
    if not twistd.exists():
        raise StartError(f"no twistd at {twistd}: run `make install` first")
    proc, port = start_listening(
        name, [str(twistd), "-n", "--pidfile=", "llmproxy", "-c", str(path)], workdir,
        r"ready: listening on http://127\.0\.0\.1:(\d+)", 30, proxy_env(mode))
    try:
        speedups = read_status(port).get("speedups")
        wrong = mismatch(name, mode, {"speedups": speedups})
        if wrong is not None:
            raise StartError(wrong)
        if mode.capture:
            _capturing(name, port)
    except BaseException:
        proc.stop()
        raise
    assert isinstance(speedups, dict)
    return Target(name, port, proc, speedups=speedups)


def speedups_off_notes(target: Target) -> list[str]:
    """For a target with its speedups on: each speedup its guard (not the bench) turned
    off, and why (its figures are then not those of every speedup)."""
    doc = target.speedups or {}
    mode = mode_of(target.name)
    if mode is None or not mode.speedups:
        return []
    return [f"{target.name}: speedup {name} is off: {why}"
            for name, why in sorted(dict(doc.get("off") or {}).items())
            if name not in mode.off]
