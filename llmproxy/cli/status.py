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
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait")
    parser.set_defaults(run=_status)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


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
        lines.append(f"  {host.get('name')}  {host.get('url')}  {read}{running}")
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
