"""The ``llmproxy`` command: small tools around a running or configured proxy.

Nothing here imports the reactor: ``check`` validates a config without starting anything.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeAlias

from llmproxy import __version__
from llmproxy.config import ConfigError, load_config, summary

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _check(args: argparse.Namespace) -> int:
    """Load and validate a config file; print its summary or every error."""
    path: str = args.config
    try:
        config = load_config(path)
    except ConfigError as e:
        for error in e.errors:
            print(error, file=sys.stderr)
        n = len(e.errors)
        print(f"llmproxy check: {path}: {n} error{'' if n == 1 else 's'}", file=sys.stderr)
        return 1
    print(f"ok: {path}: {summary(config)}")
    return 0


def _add_check(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "check",
        help="validate a config file without starting anything",
        description="Validate a config file (hosts.json) without starting anything.",
    )
    parser.add_argument("-c", "--config", required=True, metavar="PATH", help="the config file")
    parser.set_defaults(run=_check)


# To add a subcommand: write `_add_<name>(subparsers)` that sets `run`, and list it here.
SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (_add_check,)


def make_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand in `SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="llmproxy", description="One OpenAI-compatible URL in front of a LAN's GPU hosts."
    )
    parser.add_argument("--version", action="version", version=f"llmproxy {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand and return its exit status (argparse exits 2 on usage errors)."""
    args = make_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
