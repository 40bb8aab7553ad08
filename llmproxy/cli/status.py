"""``llmproxy status``: what the running proxy is doing, for a person
(`describe_status`) or as JSON. Exit 0 ready, 1 up but not ready, 2 unreachable."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmproxy.cli.proxyclient import (
    Subparsers,
    Unreachable,
    add_proxy_arguments,
    ask,
    client_key,
    proxy_url,
)


def _status(args: argparse.Namespace) -> int:
    """What the running proxy is doing; exit 0 ready, 1 up but not ready, 2 unreachable."""
    import json

    try:
        doc = ask("status", proxy_url(args) + "/status", args.timeout,
                   key=client_key(args), ca_file=args.ca_file)
    except Unreachable as e:
        print(e, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(describe_status(doc, proxy_url(args)))
    return 0 if doc.get("ready") else 1


def add(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "status", help="show what the running proxy is doing",
        description="Show the running proxy's state, hosts, engines, requests in flight and "
                    "last reload and upgrade. Exit 0 when it is ready, 1 when it is up but not "
                    "ready (starting, draining), 2 when it could not be asked.")
    add_proxy_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print /status as JSON")
    parser.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait (default: %(default)g)")
    parser.set_defaults(run=_status)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def plain(text: object, limit: int = 200) -> str:
    """An engine's or agent's text as one terminal line: bounded, and every
    character that is not printable (escape sequences, line breaks) escaped."""
    value = str(text)[:limit]
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in value)


def _figures(gpu: dict[str, Any]) -> str:
    """One GPU's figures, those the agent could read."""
    said = []
    used, total = gpu.get("memory_used_bytes"), gpu.get("memory_total_bytes")
    if isinstance(used, int | float) and isinstance(total, int | float) and total:
        said.append(f"{used / 2**30:.1f} of {total / 2**30:.1f} GiB")
    for key, fmt in (("utilization_ratio", "{:.0%}"), ("temperature_celsius", "{:.0f} C"),
                     ("power_watts", "{:.0f} W")):
        value = gpu.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            said.append(fmt.format(value))
    return ", ".join(said)


def watched_lines(engine: dict[str, Any]) -> list[str]:
    """A managed host's watch when it is down, each engine that crashed (its state,
    last exit and log line), and one line per GPU."""
    lines = []
    watch = engine.get("watch")
    if isinstance(watch, dict) and not watch.get("connected"):
        why = f": {plain(watch['last_error'])}" if watch.get("last_error") else ""
        lines.append(f"    unreachable: the watch is down for "
                     f"{watch.get('down_seconds') or 0:.0f}s{why}")
    for name, rec in sorted((engine.get("supervision") or {}).items()):
        state = rec.get("state")
        then = (f" (restart in {rec['restart_in_seconds']:.0f}s)"
                if state == "restarting" and rec.get("restart_in_seconds") is not None else "")
        lines.append(f"    engine {name} {state}{then}: {rec.get('crashes')} crash(es) in 10 "
                     f"min, last {rec.get('last_exit')}"
                     + (f": {plain(rec['last_line'])}" if rec.get("last_line") else ""))
    for gpu in (watch or {}).get("gpus") or []:
        if isinstance(gpu, dict):
            lines.append(f"    gpu {plain(gpu.get('index'))} {plain(gpu.get('name'), 80)}: "
                         f"{_figures(gpu) or 'no figures'}")
    return lines


def _joules(figures: dict[str, Any]) -> str:
    return ", ".join(f"{plain(k, 80)} {v:.0f} J" for k, v in sorted(figures.items())
                     if isinstance(v, int | float)) or "none"


def energy_lines(doc: dict[str, Any]) -> list[str]:
    """Each measured host's power and where its energy went; the requests' energy by model
    and key (docs/energy.md)."""
    energy = doc.get("energy") or {}
    lines = []
    for name, host in sorted((energy.get("hosts") or {}).items()):
        watts = host.get("power_watts")
        lines.append(f"energy {plain(name, 80)}: "
                     + (f"{watts:.0f} W now, " if isinstance(watts, int | float) else "")
                     + f"{host.get('measured_joules', 0):.0f} J measured: requests "
                     f"{host.get('requests_joules', 0):.0f} J, idle "
                     f"{_joules(host.get('idle_joules') or {})}, loading "
                     f"{_joules(host.get('loading_joules') or {})}")
    lines += [f"  {plain(use.get('model'), 80)} key {plain(use.get('key'), 80)}: "
              f"{use.get('joules', 0):.1f} J ({use.get('joules', 0) / 3600:.3f} Wh)"
              for use in energy.get("requests") or []]
    return lines


def describe_status(doc: dict[str, Any], url: str) -> str:
    """A few lines a person reads: what `llmproxy status` prints."""
    lines = [f"llmproxy {doc.get('version')} at {url}: {doc.get('state')} (pid "
             f"{doc.get('pid')}, generation {doc.get('generation')}, up "
             f"{doc.get('uptime_seconds', 0):.0f}s)"]
    for host in doc.get("hosts", []):
        roster = host.get("roster", {})
        read = (f"roster failed: {roster.get('last_error')}" if roster.get("generation") == 0
                else f"{len(roster.get('models', []))} model(s), read "
                     f"{_ago(roster.get('fetched_seconds_ago'))}")
        engine = host.get("engine")
        running = "" if engine is None else (
            f"; engine {engine.get('running') or 'none'}"
            + (f" -> {engine['switching_to']}" if engine.get("switching_to") else "")
            + f", {engine.get('in_flight', 0)} in flight, {engine.get('queued', 0)} queued")
        cap = host.get("capacity") or {}
        if cap.get("max_concurrent"):
            running += (f"; {cap.get('in_flight', 0)} of {cap['max_concurrent']} slots, "
                        f"{cap.get('queued', 0)} queued")
        if cap.get("cordoned"):
            running += "; cordoned"
        sleep = (engine or {}).get("sleep") or {}
        if sleep.get("state") not in (None, "awake"):
            running += f"; {sleep['state']}"
        lines.append(f"  {host.get('name')}  {host.get('url')}  {read}{running}")
        lines += watched_lines(engine or {})
    lines += energy_lines(doc)
    api = [r for r in doc.get("in_flight", []) if r.get("model")]
    lines.append(f"requests in flight: {len(api)}")
    lines += [f"  {r['id']}  {r['model']} -> {r.get('host')}  {r.get('age_seconds', 0):.1f}s  "
              f"{r.get('bytes', 0)} bytes" for r in api]
    reload = (doc.get("config") or {}).get("last_reload")
    lines.append("last reload: " + (reload["message"] if reload else "none"))
    upgrade = doc.get("last_upgrade")
    lines.append("last upgrade: " + (
        "none" if not upgrade else
        f"{upgrade.get('outcome')}: {upgrade.get('old_version')} (pid {upgrade.get('old_pid')})"
        f" -> {upgrade.get('new_version')} (pid {upgrade.get('new_pid')})"
        + (f": {upgrade['reason']}" if upgrade.get("reason") else "")))
    return "\n".join(lines)
