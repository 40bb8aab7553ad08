"""``llmproxy capture list|show ID|replay ID``: the running proxy's captures (with
`capture` on in its config), read from ``GET /api/captures`` and
``GET /api/captures/{id}`` (a trusted peer, or an admin key). `replay` is
cli/replay.py's. Exit 0 once printed, 1 on an error answer (an unknown capture),
2 when the proxy could not be asked."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from llmproxy.cli import replay
from llmproxy.cli.proxyclient import Subparsers, Unreachable, add_proxy_arguments, ask, client_key


def _get(args: argparse.Namespace, path: str) -> Any:
    return ask(f"capture {args.verb}", args.url + path, args.timeout, key=client_key(args),
               ca_file=args.ca_file)


def seconds(value: object) -> str:
    return f"{value:.3f}s" if isinstance(value, (int, float)) else "-"


def list_lines(doc: dict[str, Any]) -> list[str]:
    """The listing as a table, newest first, and a line on the ring."""
    if not doc.get("enabled"):
        return ["capture is off: add a \"capture\" block to the config (and restart)"]
    lines = [f"{'ID':<16} {'TIME':<19} {'STATUS':>6} {'OUTCOME':<15} {'MODEL':<20} "
             f"{'HOST':<10} {'KEY':<10} {'TTFB':>8} {'TOOK':>8} {'BYTES':>8}"]
    for c in doc.get("captures", []):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.get("time") or 0))
        lines.append(f"{c['id']:<16} {when:<19} {c.get('status') or '-'!s:>6} "
                     f"{c.get('outcome') or '-':<15} {c.get('model') or '-':<20} "
                     f"{c.get('host') or '-':<10} {c.get('key') or '-':<10} "
                     f"{seconds(c.get('ttfb')):>8} {seconds(c.get('duration')):>8} "
                     f"{c.get('response_bytes', 0):>8}")
    lines.append(f"{doc.get('count', 0)} kept in {doc.get('bytes', 0)} of "
                 f"{doc.get('max_bytes', 0)} bytes, {doc.get('evicted', 0)} let go"
                 + (f"; older: --before {doc['next']}" if doc.get("next") else ""))
    return lines


def show_lines(doc: dict[str, Any]) -> list[str]:
    """One capture, readable: what it was, then each side's head and body."""
    lines = [f"{doc['id']}: {doc['method']} {doc['path']} model={doc.get('model') or '-'} "
             f"host={doc.get('host') or '-'} engine={doc.get('engine') or '-'} "
             f"key={doc.get('key') or '-'} status={doc.get('status')} "
             f"outcome={doc.get('outcome')} ttfb={seconds(doc.get('ttfb'))} "
             f"took={seconds(doc.get('duration'))}"]
    if doc.get("detail"):
        lines.append(f"detail: {doc['detail']}")
    for side in ("request", "response"):
        part = doc.get(side) or {}
        lines.append(f"--- {side}")
        for name, values in (part.get("headers") or {}).items():
            lines += [f"{name}: {v}" for v in values]
        lines.append("")
        body = part.get("body")
        lines.append("(bodies are not captured)" if body is None else body)
        if part.get("truncated"):
            lines.append("... (cut: the capture keeps the first bytes of each body)")
    return lines


def _run(args: argparse.Namespace) -> int:
    from urllib.parse import quote, urlencode

    try:
        if args.verb == "list":
            query = {k: v for k, v in (("limit", args.limit), ("before", args.before))
                     if v is not None}
            doc = _get(args, "/api/captures" + (f"?{urlencode(query)}" if query else ""))
            lines = [json.dumps(doc, indent=2)] if args.json else list_lines(doc)
        elif args.verb == "show":
            doc = _get(args, f"/api/captures/{quote(args.id, safe='')}")
            lines = [json.dumps(doc, indent=2)] if args.json else show_lines(doc)
        else:
            return replay.run(args, _get(args, f"/api/captures/{quote(args.id, safe='')}"),
                              lambda id: _get(args, f"/api/captures/{quote(id, safe='')}"))
    except Unreachable as e:
        print(e, file=sys.stderr)
        return 1 if ": 404 " in str(e) or ": 400 " in str(e) else 2
    print("\n".join(lines))
    return 0


def add(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "capture", help="list, show and replay the requests the proxy captured",
        description="The requests and answers the running proxy captured (its config's "
                    "`capture` block): list them, show one (redacted as kept), or replay "
                    "one to the same or another model and compare both answers. Exit 0 "
                    "once done, 1 on an error answer (an unknown capture), 2 when the "
                    "proxy could not be asked.")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    listing = verbs.add_parser("list", help="the newest captures first")
    listing.add_argument("--limit", type=int, metavar="N", help="how many (default 50, "
                                                                 "at most 200)")
    listing.add_argument("--before", type=int, metavar="SEQ",
                         help="the page older than this (the listing's `next`)")
    show = verbs.add_parser("show", help="one capture: its heads and bodies")
    show.add_argument("id", help="the capture's id (the request's X-Request-Id)")
    again = verbs.add_parser("replay", help="send a captured request again and compare")
    again.add_argument("id", help="the capture's id (the request's X-Request-Id)")
    again.add_argument("--model", metavar="M", help="to this model (default: the same)")
    again.add_argument("--host", metavar="H", help="to this host (asks for H/MODEL)")
    for verb in (listing, show, again):
        verb.add_argument("--json", action="store_true", help="print JSON")
        add_proxy_arguments(verb)
        verb.add_argument("--timeout", type=float, default=300.0,
                          help="seconds to wait for the proxy (default: %(default)g)")
    parser.set_defaults(run=_run)
