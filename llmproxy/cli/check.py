"""``llmproxy check``: validate a config file and everything it names (the keys
file, each `api_key_env`, the TLS files) without starting anything, through the
loader `twistd llmproxy` runs (lifecycle/accessfiles.load_startup): what twistd
refuses, check refuses with the same messages; exit 78 (EX_CONFIG, as the proxy)."""

from __future__ import annotations

import argparse
import sys

from llmproxy.cli.proxyclient import Subparsers
from llmproxy.config import ConfigError, summary

EXIT_CONFIG = 78   # sysexits.h EX_CONFIG, as the proxy exits on a bad config


def _check(args: argparse.Namespace) -> int:
    """Load and validate a config file; print its summary or every error."""
    import os

    from llmproxy.lifecycle.accessfiles import load_startup

    path: str = args.config
    try:
        config, _ = load_startup(path, os.environ)
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
