"""``llmproxy logs HOST [ENGINE] [-n N] [-f]``: an engine's log, read from the running
proxy's ``GET /api/hosts/{host}/log`` (Server-Sent Events), each line printed as it comes;
with -f followed until Ctrl-C. Exit 0 once the lines were printed (and on Ctrl-C), 1 on an
error answer or a stream that ended in error, 2 when the proxy could not be asked."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from llmproxy.cli.proxyclient import (
    Subparsers,
    Unreachable,
    add_proxy_arguments,
    client_key,
    proxy_url,
    refusal_hint,
)


class Failed(Exception):
    """The proxy answered, with an error; the message says it."""


def log_url(base: str, host: str, engine: str | None, lines: int | None, follow: bool) -> str:
    """The log endpoint's URL for these arguments."""
    from urllib.parse import quote, urlencode

    query = {k: v for k, v in (("engine", engine), ("n", lines), ("follow", 1 if follow else None))
             if v is not None}
    return f"{base}/api/hosts/{quote(host, safe='')}/log" + (
        f"?{urlencode(query)}" if query else "")


def events(lines: Iterable[bytes]) -> Iterator[tuple[str, Any]]:
    """The (event, data) of each SSE message in `lines` (comments and ids skipped); data
    that is not JSON is given as text."""
    import json

    kind, data = "message", list[str]()
    for raw in lines:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                text = "\n".join(data)
                try:
                    yield kind, json.loads(text)
                except ValueError:
                    yield kind, text
            kind, data = "message", []
        elif line.startswith("event:"):
            kind = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].removeprefix(" "))


def _open(url: str, timeout: float, key: str | None, ca_file: str | None) -> Any:
    import json
    import ssl
    import urllib.error
    import urllib.request

    headers = {"Accept": "text/event-stream"} | ({"Authorization": f"Bearer {key}"} if key
                                                 else {})
    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                      timeout=timeout, context=context)
    except urllib.error.HTTPError as e:
        try:
            doc = json.load(e)
            message = doc["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise Failed(f"llmproxy logs: {e.code} {message}{refusal_hint(e.code)}") from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"llmproxy logs: cannot reach {url}: {reason}") from None


def _print(response: Any, out: Any) -> None:
    """Print each log line of the stream; Failed on an error event or a cut stream."""
    import http.client

    try:
        for kind, doc in events(response):
            if kind == "log" and isinstance(doc, dict):
                out.write(f"{doc.get('line', '')}\n")
                out.flush()
            elif kind in ("error", "end") and isinstance(doc, dict):
                raise Failed(f"llmproxy logs: {doc.get('error') or doc.get('reason')}")
    except (http.client.HTTPException, OSError) as e:
        raise Failed(f"llmproxy logs: the stream broke off: {e or type(e).__name__}") from None


def _logs(args: argparse.Namespace) -> int:
    """Print the engine's log lines (and follow them with -f)."""
    try:
        url = log_url(proxy_url(args), args.host, args.engine, args.lines, args.follow)
        with _open(url, args.timeout, client_key(args), args.ca_file) as response:
            _print(response, sys.stdout)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:          # `| head`: the reader has what it wanted
        return 0
    except Failed as e:
        print(e, file=sys.stderr)
        return 1
    except Unreachable as e:
        print(e, file=sys.stderr)
        return 2
    return 0


def add(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "logs", help="print a managed engine's log (-f: follow it)",
        description="Print the last lines of a managed engine's log, read on its GPU host by "
                    "the agent (GET /api/hosts/HOST/log: loopback, or an admin key); with -f, "
                    "then each new line as the engine writes it, until Ctrl-C. Exit 0 once "
                    "printed (and on Ctrl-C), 1 on an error answer, 2 when the proxy could not "
                    "be asked.")
    parser.add_argument("host", help="the managed host")
    parser.add_argument("engine", nargs="?", help="its engine (default: the one running, "
                                                  "else its only one)")
    parser.add_argument("-n", "--lines", type=int, metavar="N",
                        help="how many last lines (default 50, at most 10000)")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="then the new lines as they come, until Ctrl-C")
    add_proxy_arguments(parser)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for the proxy (and, with -f, for a keep-alive; "
                             "default: %(default)g)")
    parser.set_defaults(run=_logs)
