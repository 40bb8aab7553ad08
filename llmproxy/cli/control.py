"""``llmproxy reload`` and ``llmproxy upgrade``: ask the running proxy to
re-read its config, or to hand over to the installed code, and say how it went.
Exit status: 0 done, 1 refused or rolled back (the reason is printed), 2 the
proxy could not be asked."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmproxy.cli.proxyclient import (
    Subparsers,
    Unreachable,
    add_key_argument,
    add_proxy_arguments,
    ask,
    client_key,
    proxy_url,
)


def _reload(args: argparse.Namespace) -> int:
    """Ask the running proxy to reload; exit 0 only if it applied the file."""
    try:
        doc = ask("reload", proxy_url(args) + "/admin/reload", args.timeout, post=True,
                   key=client_key(args), ca_file=args.ca_file)
    except Unreachable as e:
        print(e, file=sys.stderr)
        return 2
    applied = doc.get("outcome") == "applied"
    print(doc.get("message", doc), file=sys.stdout if applied else sys.stderr)
    return 0 if applied else 1


def add_reload(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "reload",
        help="reload the running proxy's config; fail unless it was applied",
        description="Ask the running proxy (on loopback) to re-read its config file, as SIGHUP "
                    "does, and report what it did: exit 0 when applied, 1 when the running "
                    "config was kept (the reason is printed), 2 when the proxy could not be "
                    "asked.",
    )
    parser.add_argument("-c", "--config", metavar="PATH",
                        help="the config file, to find the proxy's listen address")
    parser.add_argument("--url", help="the proxy's URL (default: from --config, else "
                                      "http://127.0.0.1:8080)")
    parser.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait (default: %(default)g)")
    add_key_argument(parser)
    parser.set_defaults(run=_reload)


def _upgrade(args: argparse.Namespace) -> int:
    """Upgrade the running proxy and say how it went: 0 handed over, 1 rolled back
    or refused, 2 could not ask."""
    base = proxy_url(args)
    try:
        key = client_key(args)
        doc = ask("upgrade", base + "/admin/upgrade", args.timeout + 30, post=True, key=key,
                   ca_file=args.ca_file)
    except Unreachable as e:
        print(e, file=sys.stderr)
        return 2
    if doc.get("outcome") != "handed over":
        print(f"llmproxy upgrade: {doc.get('outcome', 'failed')}: {doc.get('reason')}; "
              f"pid {doc.get('old_pid')} keeps serving", file=sys.stderr)
        return 1
    old, new = doc.get("old_pid"), doc.get("new_pid")
    print(f"upgraded: {doc.get('old_version')} (pid {old}) -> {doc.get('new_version')} "
          f"(pid {new}), generation {doc.get('generation')}, ready in "
          f"{doc.get('elapsed') or 0:.1f}s", flush=True)
    why = _wait_exit(args, base, key, old)
    if why is None:
        print(f"pid {old} drained and exited; pid {new} serves")
    else:
        print(f"pid {new} serves; pid {old} was still draining: {why}")
    return 0


def _wait_exit(args: argparse.Namespace, base: str, key: str | None,
               old: object) -> str | None:
    """None once pid `old` has drained and exited, else why that is not known. The
    new process's event stream is opened first, then /status read once (the exit
    may be over already), then the stream read for `upgrade` predecessor_exited:
    one request each, never a poll."""
    import http.client
    import ssl
    import time
    import urllib.request

    from llmproxy.cli.logs import events

    deadline = time.monotonic() + args.timeout
    headers = {"Accept": "text/event-stream"} | ({"Authorization": f"Bearer {key}"} if key
                                                 else {})
    context = ssl.create_default_context(cafile=args.ca_file) if args.ca_file else None
    try:
        # Keep-alive comments come every 15 s: a read never waits longer than this.
        with urllib.request.urlopen(urllib.request.Request(base + "/api/events",
                                                           headers=headers),
                                    timeout=min(args.timeout, 30), context=context) as stream:
            now = ask("upgrade", base + "/status", 10, key=key, ca_file=args.ca_file)
            if not (now.get("predecessor") or {}).get("draining"):
                return None
            for kind, doc in events(_until(stream, deadline)):
                if kind == "upgrade" and isinstance(doc, dict) and \
                        doc.get("stage") == "predecessor_exited" and doc.get("pid") == old:
                    return None
                if kind == "stop":
                    return "the new process stops too"
    except (OSError, http.client.HTTPException, Unreachable) as e:
        return f"the event stream at {base}/api/events failed: {getattr(e, 'reason', e)}"
    if time.monotonic() > deadline:
        return f"after {args.timeout:g}s"
    return f"the event stream at {base}/api/events ended"


def _until(lines: Any, deadline: float) -> Any:
    """The lines of `lines` until `deadline` (time.monotonic) has passed."""
    import time

    for line in lines:
        yield line
        if time.monotonic() > deadline:
            return


def add_upgrade(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "upgrade", help="upgrade the running proxy to the installed code, without downtime",
        description="Ask the running proxy (on loopback) to start the installed code as its "
                    "successor (as SIGUSR1 does) and report the outcome: exit 0 once the new "
                    "process serves (waiting up to --timeout on its event stream for the old "
                    "one to drain and exit), 1 when "
                    "the candidate failed and was rolled back (the reason is printed), 2 when "
                    "the proxy could not be asked.")
    add_proxy_arguments(parser)
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds to wait for the old process to drain and exit "
                             "(default: %(default)g)")
    parser.set_defaults(run=_upgrade)
