"""How the commands reach a running proxy: its URL (from --url or the config's
`listen`), the key to send, one JSON request (`ask`), and the arguments every
command that asks shares (`add_proxy_arguments`). Nothing here imports the reactor."""

from __future__ import annotations

import argparse
from typing import Any, TypeAlias

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


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
