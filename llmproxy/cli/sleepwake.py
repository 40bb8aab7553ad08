"""``llmproxy wake HOST`` and ``llmproxy sleep HOST``: an operator wakes a host that
sleeps (a Wake-on-LAN magic packet, then its agent answering) or tells it to sleep now,
through the running proxy's loopback-only admin endpoints (``/admin/wake``,
``/admin/sleep``). Exit status: 0 done, 1 refused or failed (the reason is printed), 2 the
proxy could not be asked. Nothing here imports the reactor."""

from __future__ import annotations

import argparse

from llmproxy.cli.hosts import act
from llmproxy.cli.proxyclient import Subparsers, add_proxy_arguments


def _run(args: argparse.Namespace) -> int:
    doc = act(args.command, args, "done", args.timeout, host=args.host)
    if isinstance(doc, int):
        return doc
    print(f"{args.host}: {doc.get('state')}")
    return 0


# name, help, description, default seconds to wait for the proxy's answer
_COMMANDS = (
    ("wake", "wake a host that sleeps (Wake-on-LAN)",
     "Send HOST's magic packet (its `wake` block) and wait until its agent answers, within "
     "its wake.timeout_seconds. Exit 0 once it is awake, 1 when it did not wake (or has no "
     "wake block), 2 when the proxy could not be asked.", 660.0),
    ("sleep", "put an idle host to sleep now",
     "Tell HOST's agent to run its sleep command now, without waiting for its "
     "sleep.after_seconds; refused (exit 1, saying why) while an engine runs there, a "
     "request is in flight or queued, an agent call is in progress, or another proxy holds "
     "its lease. Exit 2 when the proxy could not be asked.", 60.0),
)


def add(subparsers: Subparsers) -> None:
    """The wake and sleep subcommands."""
    for name, summary, description, timeout in _COMMANDS:
        p = subparsers.add_parser(name, help=summary, description=description)
        p.add_argument("host", metavar="HOST")
        add_proxy_arguments(p)
        p.add_argument("--timeout", type=float, default=timeout,
                       help="seconds to wait for the proxy's answer (default: %(default)g)")
        p.set_defaults(run=_run)
