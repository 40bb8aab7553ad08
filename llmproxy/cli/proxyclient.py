"""How the commands reach a running proxy: its URL (from --url or the config's
`listen`), the key to send, one JSON request (`ask`), and the arguments every
command that asks shares (`add_proxy_arguments`). Nothing here imports the reactor."""

from __future__ import annotations

import argparse
from typing import Any, TypeAlias

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


DEFAULT_URL = "http://127.0.0.1:8080"     # the proxy's own default `listen`
EXIT_UNNAMED = 2     # a usage error, as argparse's: the arguments name no proxy


class NotNamed(Exception):
    """The arguments name no proxy: the -c file cannot say where it listens."""


def proxy_url(args: argparse.Namespace) -> str:
    """The running proxy's URL: --url, else the `listen` (and `tls`) of the -c
    file, else the proxy's default. The file is read leniently (the point of a
    reload may be a file that no longer validates), but a file that cannot be
    read, is not JSON or has no usable `listen` is NotNamed: never a guess."""
    if args.url:
        return str(args.url).rstrip("/")
    if not args.config:
        return DEFAULT_URL
    import json

    from llmproxy.config.parse import LISTEN_ERROR, parse_listen

    path = str(args.config)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise NotNamed(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:
        raise NotNamed(f"{path}: not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise NotNamed(f"{path}: not a JSON object")
    listen = doc.get("listen", "127.0.0.1:8080")
    address = parse_listen(listen) if isinstance(listen, str) else None
    if address is None:
        raise NotNamed(f"{path}: listen: {LISTEN_ERROR}")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(address.host, address.host)
    scheme = "https" if isinstance(doc.get("tls"), dict) else "http"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{address.port}"


def resolve_proxy(args: argparse.Namespace) -> str | None:
    """Fix `args.url` to the proxy the arguments name, once, before a command
    runs; the error to print (exit EXIT_UNNAMED) when they name none."""
    try:
        args.url = proxy_url(args)
    except NotNamed as e:
        return (f"llmproxy {args.command}: {e}\n"
                f"llmproxy {args.command}: cannot tell which proxy to ask: fix -c, or name "
                "the proxy with --url URL")
    return None


KEY_HINT = ("\nllmproxy: this proxy wants an API key: give --key-file PATH (a file whose "
            "first line is the key) or set $LLMPROXY_KEY")


def refusal_hint(status: int) -> str:
    """What to do about a refusal the proxy answered with `status` ("" if nothing to add)."""
    return KEY_HINT if status == 401 else ""


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
        raise Unreachable(f"llmproxy {command}: {url}: {e.code} {message}"
                          f"{refusal_hint(e.code)}") from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"llmproxy {command}: cannot reach {url}: {reason}") from None


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", metavar="PATH",
                        help="the config file, to find the proxy's listen address")
    parser.add_argument("--url", help="the proxy's URL (default: from --config, else "
                                      "http://127.0.0.1:8080)")
    add_key_argument(parser)


def add_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--key-file", metavar="PATH",
                        help="a file whose first line is an API key to send (with keys on, "
                             "/status needs an admin key); default: $LLMPROXY_KEY")
    parser.add_argument("--ca-file", metavar="PATH",
                        help="with a TLS listener: the PEM CA that signed its certificate "
                             "(default: the system's)")
