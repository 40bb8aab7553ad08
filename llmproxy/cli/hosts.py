"""``llmproxy cordon``, ``uncordon`` and ``engine``: an operator's actions on one
host of the running proxy, asked through its loopback-only admin endpoints
(found like ``llmproxy reload`` finds the proxy: ``-c hosts.json`` or ``--url``).

Exit status: 0 done, 1 refused or failed (the reason is printed), 2 the proxy
could not be asked. Nothing here imports the reactor.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any
from urllib.parse import urlencode

from llmproxy.cli.proxyclient import (
    Subparsers,
    Unreachable,
    add_proxy_arguments,
    ask,
    client_key,
    proxy_url,
)

POLL = 0.2    # how often `cordon --wait` looks at /status


def act(command: str, args: argparse.Namespace, done: str, timeout: float,
         **params: str) -> dict[str, Any] | int:
    """Ask `/admin/<command>`: its answer when it says `done`, else the exit
    status (2 it could not be asked, 1 it refused or failed), said on stderr."""
    url = f"{proxy_url(args)}/admin/{command}?{urlencode(params)}"
    try:
        doc: dict[str, Any] = ask(command, url, timeout, post=True, key=client_key(args),
                                   ca_file=args.ca_file)
    except Unreachable as e:
        print(e, file=sys.stderr)
        return 2
    if doc.get("outcome") != done:
        print(f"llmproxy {command}: {doc.get('reason')}", file=sys.stderr)
        return 1
    return doc


def _host_entry(doc: dict[str, Any], host: str) -> dict[str, Any]:
    return next((h for h in doc.get("hosts", []) if h.get("name") == host), {})


def _still_running(doc: dict[str, Any], host: str) -> list[str]:
    return [f"{r.get('id')} {r.get('model')} ({r.get('age_seconds', 0):.0f}s)"
            for r in doc.get("in_flight", []) if r.get("host") == host and r.get("model")]


def _wait_idle(args: argparse.Namespace, host: str) -> int:
    """Until the host has nothing in flight or queued: 0, or 1 at the timeout."""
    deadline = time.monotonic() + args.timeout
    doc: dict[str, Any] = {}
    while True:
        try:
            doc = ask("cordon", proxy_url(args) + "/status", 10, key=client_key(args),
                       ca_file=args.ca_file)
        except Unreachable as e:
            print(e, file=sys.stderr)     # an upgrade's hand-over: ask again
            doc = {}
        capacity = _host_entry(doc, host).get("capacity") or {}
        # A predecessor still draining after an upgrade may stream there: wait for it.
        draining = (doc.get("predecessor") or {}).get("draining")
        if doc and not draining and capacity.get("in_flight", 1) + capacity.get("queued", 1) == 0:
            print(f"{host} has nothing in flight")
            return 0
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL)
    running = _still_running(doc, host) if doc else ["(the proxy could not be asked)"]
    print(f"llmproxy cordon: {host} still busy after {args.timeout:g}s: "
          + (", ".join(running) or "requests in flight"), file=sys.stderr)
    return 1


def _cordon(args: argparse.Namespace) -> int:
    """Cordon a host; with --wait, until nothing runs there; --stop-engine then."""
    doc = act("cordon", args, "cordoned", 30, host=args.host)
    if isinstance(doc, int):
        return doc
    print(f"cordoned {args.host}: {doc.get('in_flight', 0)} in flight, "
          f"{doc.get('queued', 0)} queued")
    if not (args.wait or args.stop_engine):
        return 0
    status = _wait_idle(args, args.host)
    if status != 0 or not args.stop_engine:
        return status
    args.op, args.engine = "stop", None
    return _engine(args)


def _uncordon(args: argparse.Namespace) -> int:
    doc = act("uncordon", args, "uncordoned", 30, host=args.host)
    if isinstance(doc, int):
        return doc
    print(f"uncordoned {args.host}")
    return 0


def _engine(args: argparse.Namespace) -> int:
    """Start or stop a managed host's engine; 0 done, 1 failed, 2 could not ask."""
    params = {"host": args.host, "op": args.op}
    if args.engine:
        params["engine"] = args.engine
    doc = act("engine", args, "done", args.timeout + 30, **params)
    if isinstance(doc, int):
        return doc
    what = (f"started {args.engine}" if args.op == "start" else
            f"stopped {args.engine}" if args.engine else "stopped its engine")
    running = ", ".join(doc.get("resident") or []) or doc.get("running") or "none"
    print(f"{args.host}: {what}; running: {running}")
    return 0


def add(subparsers: Subparsers) -> None:
    """The cordon, uncordon and engine subcommands."""
    p = subparsers.add_parser(
        "cordon", help="stop sending new requests to a host; its running streams finish",
        description="Cordon HOST on the running proxy: it gets no new request (its replicas "
                    "take them; a model with no other host answers 503 host_cordoned), and "
                    "what runs there finishes. The cordon survives reloads, upgrades and "
                    "restarts. Exit 0 when done (with --wait: once the host has nothing in "
                    "flight), 1 at the timeout naming what still runs or when refused, 2 when "
                    "the proxy could not be asked.")
    p.add_argument("host", metavar="HOST")
    add_proxy_arguments(p)
    p.add_argument("--wait", action="store_true",
                   help="wait until the host has nothing in flight")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds --wait waits (default: %(default)g)")
    p.add_argument("--stop-engine", action="store_true",
                   help="then stop its managed engine (implies --wait)")
    p.set_defaults(run=_cordon)
    p = subparsers.add_parser(
        "uncordon", help="let a cordoned host take new requests again",
        description="Lift HOST's cordon. Exit 0 when done, 1 when refused, 2 when the proxy "
                    "could not be asked.")
    p.add_argument("host", metavar="HOST")
    add_proxy_arguments(p)
    p.set_defaults(run=_uncordon)
    p = subparsers.add_parser(
        "engine", help="start or stop a managed host's engine",
        description="`engine HOST start ENGINE` switches HOST to ENGINE (waiting for the "
                    "requests on the running engine, like a request for it would); `engine "
                    "HOST stop` stops its engines once the requests on them are done (never "
                    "cuts them); `engine HOST stop ENGINE` stops that one alone (a host with "
                    "memory_gb runs several). Exit 0 when done, 1 with the agent's reason when "
                    "it failed, 2 when the proxy could not be asked.")
    p.add_argument("host", metavar="HOST")
    p.add_argument("op", choices=("start", "stop"))
    p.add_argument("engine", metavar="ENGINE", nargs="?",
                   help="the engine to start (required) or stop (optional)")
    add_proxy_arguments(p)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait (default: %(default)g)")
    p.set_defaults(run=_engine_checked, parser=p)


def _engine_checked(args: argparse.Namespace) -> int:
    if args.op == "start" and args.engine is None:
        args.parser.error("start takes ENGINE")
    return _engine(args)
