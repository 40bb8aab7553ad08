"""``llmproxy check``: validate a config file (and the keys file it names)
without starting anything; exit 78 (EX_CONFIG, as the proxy) on an error."""

from __future__ import annotations

import argparse
import sys

from llmproxy.cli.proxyclient import Subparsers
from llmproxy.config import ConfigError, load_config, summary

EXIT_CONFIG = 78   # sysexits.h EX_CONFIG, as the proxy exits on a bad config


def _check(args: argparse.Namespace) -> int:
    """Load and validate a config file; print its summary or every error."""
    path: str = args.config
    try:
        config = load_config(path)
        if config.keys_file is not None:
            from llmproxy.config.keys import load_keys

            load_keys(config.keys_file)
    except ConfigError as e:
        for error in e.errors:
            print(error, file=sys.stderr)
        n = len(e.errors)
        print(f"llmproxy check: {path}: {n} error{'' if n == 1 else 's'}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"ok: {path}: {summary(config)}")
    return 0


def add(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "check",
        help="validate a config file without starting anything",
        description="Validate a config file (hosts.json) without starting anything.",
    )
    parser.add_argument("-c", "--config", required=True, metavar="PATH", help="the config file")
    parser.set_defaults(run=_check)
