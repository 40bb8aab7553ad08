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


def _proxy_url(args: argparse.Namespace) -> str:
    """The running proxy's URL: --url, or the `listen` of the config file (read
    leniently: the point of a reload may be a file that no longer validates)."""
    if args.url:
        return str(args.url).rstrip("/")
    listen = "127.0.0.1:8080"
    if args.config:
        import json

        try:
            with open(args.config, encoding="utf-8") as f:
                value = json.load(f).get("listen", listen)
            listen = value if isinstance(value, str) else listen
        except (OSError, ValueError, AttributeError):
            pass
    host, _, port = listen.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}.get(host, host)
    return f"http://{host}:{port}"


def _reload(args: argparse.Namespace) -> int:
    """Ask the running proxy to reload; exit 0 only if it applied the file."""
    import json
    import urllib.error
    import urllib.request

    url = _proxy_url(args) + "/admin/reload"
    request = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            doc = json.load(response)
    except urllib.error.HTTPError as e:
        try:
            doc = json.load(e)
        except ValueError:
            doc = {}
        if "outcome" not in doc:
            message = doc.get("error", {}).get("message", e.reason)
            print(f"llmproxy reload: {url}: {e.code} {message}", file=sys.stderr)
            return 2
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        print(f"llmproxy reload: cannot reach {url}: {reason}", file=sys.stderr)
        return 2
    applied = doc.get("outcome") == "applied"
    print(doc.get("message", doc), file=sys.stdout if applied else sys.stderr)
    return 0 if applied else 1


def _add_reload(subparsers: Subparsers) -> None:
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
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait")
    parser.set_defaults(run=_reload)


# To add a subcommand: write `_add_<name>(subparsers)` that sets `run`, and list it here.
SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (_add_check, _add_reload)


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
