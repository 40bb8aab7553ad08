"""The ``llmproxy`` command's parser: every subcommand, and `main`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from llmproxy import __version__
from llmproxy.cli import capture, check, control, doctor, hosts, logs, sleepwake, status
from llmproxy.cli.proxyclient import EXIT_UNNAMED, Subparsers, resolve_proxy

# To add a subcommand: write `add(subparsers)` in its module, setting `run`, and list it here.
SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    check.add, control.add_reload, status.add, control.add_upgrade, hosts.add, logs.add,
    doctor.add, capture.add, sleepwake.add)


def make_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand in `SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="llmproxy", description="One OpenAI-compatible URL in front of a LAN's GPU hosts.",
        epilog="The proxy itself is the twistd plugin: `twistd llmproxy -c hosts.json` "
               "(`twistd -n --pidfile= llmproxy -c hosts.json` in the foreground; "
               "`twistd llmproxy --help` for its options). These commands validate its "
               "config and talk to the running proxy.")
    parser.add_argument("--version", action="version", version=f"llmproxy {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand and return its exit status (argparse exits 2 on usage
    errors, and so does a command whose arguments name no proxy)."""
    args = make_parser().parse_args(argv)
    if hasattr(args, "url"):      # a command that asks a running proxy
        error = resolve_proxy(args)
        if error is not None:
            print(error, file=sys.stderr)
            return EXIT_UNNAMED
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)

