"""The ``llmproxy`` command: small tools around a running or configured proxy.

Nothing here imports the reactor: ``check`` validates a config without starting anything.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TypeAlias

from llmproxy import __version__
from llmproxy.config import ConfigError, load_config, summary

EXIT_CONFIG = 78   # sysexits.h EX_CONFIG, as the proxy exits on a bad config

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


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


def _add_check(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "check",
        help="validate a config file without starting anything",
        description="Validate a config file (hosts.json) without starting anything.",
    )
    parser.add_argument("-c", "--config", required=True, metavar="PATH", help="the config file")
    parser.set_defaults(run=_check)


def proxy_url(args: argparse.Namespace) -> str:
    """The running proxy's URL: --url, or the `listen` of the config file (read
    leniently: the point of a reload may be a file that no longer validates)."""
    if args.url:
        return str(args.url).rstrip("/")
    listen, scheme = "127.0.0.1:8080", "http"
    if args.config:
        import json

        try:
            with open(args.config, encoding="utf-8") as f:
                doc = json.load(f)
            value = doc.get("listen", listen)
            listen = value if isinstance(value, str) else listen
            scheme = "https" if isinstance(doc.get("tls"), dict) else "http"
        except (OSError, ValueError, AttributeError):
            pass
    host, _, port = listen.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}.get(host, host)
    return f"{scheme}://{host}:{port}"


class Unreachable(Exception):
    """The proxy could not be asked; the message says why."""


def client_key(args: argparse.Namespace) -> str | None:
    """The API key to send: the first line of --key-file, else $LLMPROXY_KEY."""
    import os

    path = getattr(args, "key_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.readline().strip() or None
        except OSError as e:
            raise Unreachable(f"llmproxy: --key-file {path}: {e.strerror or e}") from None
    return os.environ.get("LLMPROXY_KEY") or None


def ask(command: str, url: str, timeout: float, post: bool = False,
         key: str | None = None, ca_file: str | None = None) -> Any:
    """The JSON answer of the proxy at `url` (an admin refusal's JSON too, when it
    has an `outcome`); Unreachable when there is none."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url, data=b"" if post else None, headers=headers,
                                     method="POST" if post else "GET")
    try:
        import ssl

        context = ssl.create_default_context(cafile=ca_file) if ca_file else None
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        try:
            doc = json.load(e)
        except ValueError:
            doc = {}
        if isinstance(doc, dict) and "outcome" in doc:
            return doc
        message = doc.get("error", {}).get("message", e.reason) if isinstance(doc, dict) \
            else e.reason
        raise Unreachable(f"llmproxy {command}: {url}: {e.code} {message}") from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"llmproxy {command}: cannot reach {url}: {reason}") from None


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
    _add_key_argument(parser)
    parser.set_defaults(run=_reload)


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", metavar="PATH",
                        help="the config file, to find the proxy's listen address")
    parser.add_argument("--url", help="the proxy's URL (default: from --config, else "
                                      "http://127.0.0.1:8080)")
    _add_key_argument(parser)


def _add_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--key-file", metavar="PATH",
                        help="a file whose first line is an API key to send (with keys on, "
                             "/status needs an admin key); default: $LLMPROXY_KEY")
    parser.add_argument("--ca-file", metavar="PATH",
                        help="with a TLS listener: the PEM CA that signed its certificate "
                             "(default: the system's)")


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


def _add_status(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "status", help="show what the running proxy is doing",
        description="Show the running proxy's state, hosts, engines, requests in flight and "
                    "last reload and upgrade. Exit 0 when it is ready, 1 when it is up but not "
                    "ready (starting, draining), 2 when it could not be asked.")
    add_proxy_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print /status as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait")
    parser.set_defaults(run=_status)


def _upgrade(args: argparse.Namespace) -> int:
    """Upgrade the running proxy and say how it went: 0 handed over, 1 rolled back
    or refused, 2 could not ask."""
    import time

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
          f"{doc.get('elapsed') or 0:.1f}s")
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            now = ask("upgrade", base + "/status", 5, key=key, ca_file=args.ca_file)
        except Unreachable:
            now = {}
        predecessor = now.get("predecessor") or {}
        if now.get("pid") == new and not predecessor.get("draining"):
            print(f"pid {old} drained and exited; pid {new} serves")
            return 0
        time.sleep(0.2)
    print(f"pid {new} serves; pid {old} was still draining after {args.timeout:g}s")
    return 0


def _add_upgrade(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "upgrade", help="upgrade the running proxy to the installed code, without downtime",
        description="Ask the running proxy (on loopback) to start the installed code as its "
                    "successor (as SIGUSR1 does) and report the outcome: exit 0 once the new "
                    "process serves (waiting up to --timeout for the old one to drain), 1 when "
                    "the candidate failed and was rolled back (the reason is printed), 2 when "
                    "the proxy could not be asked.")
    add_proxy_arguments(parser)
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds to wait for the old process to drain")
    parser.set_defaults(run=_upgrade)


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


def _add_host_commands(subparsers: Subparsers) -> None:
    from llmproxy import cli_hosts  # cordon, uncordon, engine

    cli_hosts.add(subparsers)


# To add a subcommand: write `_add_<name>(subparsers)` that sets `run`, and list it here.
SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    _add_check, _add_reload, _add_status, _add_upgrade, _add_host_commands)


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
