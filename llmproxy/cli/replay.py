"""``llmproxy capture replay ID [--model M] [--host H]``: a captured request sent
again through the running proxy (to the same model, another one, or the model on
one host: `H/MODEL`), with the command's own key (a capture never holds the
client's), and both answers printed side by side with their status and timings.

A body the capture redacted is sent as kept (its redacted values say so: a
warning names them); a capture without its body (`bodies: false`) or with a
body cut short cannot be replayed."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

from llmproxy.cli.proxyclient import client_key

REDACTED = "[redacted]"
WIDTH = 38     # of each column


class Refused(Exception):
    """The capture cannot be replayed; the message says why."""


def request_of(capture: dict[str, Any], model: str | None, host: str | None) -> bytes:
    """The body to send again, its model changed as asked."""
    request = capture.get("request") or {}
    body = request.get("body")
    if body is None:
        raise Refused("the capture holds no body (capture.bodies is false)")
    if request.get("truncated"):
        raise Refused("the capture holds only the start of the body (capture.max_record_kb)")
    try:
        doc = json.loads(body)
    except ValueError:
        raise Refused("the captured body is not JSON (a form upload cannot be replayed)") \
            from None
    if not isinstance(doc, dict):
        raise Refused("the captured body is not a JSON object")
    name = model or doc.get("model") or capture.get("model")
    if host:
        name = f"{host}/{str(name).split('/')[-1]}"
    doc["model"] = name
    return json.dumps(doc).encode("utf-8")


def answer_text(body: str) -> str:
    """What the model said: a stream's deltas joined, else the answer's message (or
    text), else the body itself (an error's JSON)."""
    pieces: list[str] = []
    for line in body.split("\n"):
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                event = json.loads(line[5:])
            except ValueError:
                continue
            for choice in event.get("choices") or [] if isinstance(event, dict) else []:
                delta = choice.get("delta") or {}
                pieces.append(str(delta.get("content") or choice.get("text") or ""))
    if pieces:
        return "".join(pieces)
    try:
        doc = json.loads(body)
        choice = doc["choices"][0]
        return str((choice.get("message") or {}).get("content") or choice.get("text") or "")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return body


def send(args: argparse.Namespace, path: str, body: bytes) -> dict[str, Any]:
    """POST it; what came back, with its timings as the client saw them."""
    import ssl
    import urllib.error
    import urllib.request

    key = client_key(args)
    headers = {"Content-Type": "application/json"} | (
        {"Authorization": f"Bearer {key}"} if key else {})
    context = ssl.create_default_context(cafile=args.ca_file) if args.ca_file else None
    started = time.monotonic()
    request = urllib.request.Request(args.url + path, data=body, headers=headers,
                                     method="POST")
    try:
        response = urllib.request.urlopen(request, timeout=args.timeout, context=context)
    except urllib.error.HTTPError as e:
        response = e
    with response:
        first = response.read(1)
        ttfb = time.monotonic() - started
        data = first + response.read()
    return {"status": response.status, "ttfb": ttfb, "duration": time.monotonic() - started,
            "id": response.headers.get("x-request-id"), "body": data.decode("utf-8", "replace"),
            "model": json.loads(body).get("model")}


def columns(left: list[str], right: list[str]) -> list[str]:
    """Two texts side by side, each wrapped to WIDTH."""
    def wrapped(lines: list[str]) -> list[str]:
        return [w for line in lines for w in (textwrap.wrap(line, WIDTH) or [""])]
    a, b = wrapped(left), wrapped(right)
    a += [""] * (len(b) - len(a))
    b += [""] * (len(a) - len(b))
    return [f"{x:<{WIDTH}} | {y}" for x, y in zip(a, b, strict=True)]


def side(title: str, doc: dict[str, Any], body: str) -> list[str]:
    def s(v: object) -> str:
        return f"{v:.3f}s" if isinstance(v, (int, float)) else "-"
    return [title, f"model {doc.get('model') or '-'} on {doc.get('host') or '-'}",
            f"status {doc.get('status')}, ttfb {s(doc.get('ttfb'))}, "
            f"took {s(doc.get('duration'))}", "-" * WIDTH, *answer_text(body).split("\n")]


def run(args: argparse.Namespace, capture: dict[str, Any],
        lookup: Callable[[str], Any]) -> int:
    """Replay `capture`; print both answers (or, with --json, both records). The
    replay's host is its own capture's (`lookup`: a capture by id), when kept."""
    try:
        body = request_of(capture, args.model, args.host)
    except Refused as e:
        print(f"llmproxy capture replay: {capture.get('id')}: {e}", file=sys.stderr)
        return 1
    if REDACTED.encode() in body:
        print(f"llmproxy capture replay: warning: the body holds values the capture "
              f"redacted; they are sent as {REDACTED!r}", file=sys.stderr)
    try:
        again = send(args, capture.get("path") or "/v1/chat/completions", body)
    except OSError as e:
        print(f"llmproxy capture replay: cannot reach {args.url}: {e}", file=sys.stderr)
        return 2
    for _ in range(5 if again["id"] else 0):   # a large capture is kept a moment later
        with contextlib.suppress(Exception):
            again["host"] = lookup(again["id"]).get("host")
            break
        time.sleep(0.2)
    before = (capture.get("response") or {}).get("body") or ""
    if args.json:
        print(json.dumps({"captured": {k: capture.get(k) for k in (
            "id", "model", "host", "status", "ttfb", "duration")} | {
            "answer": answer_text(before)}, "replayed": {
            k: again.get(k) for k in ("id", "model", "host", "status", "ttfb", "duration")} | {
            "answer": answer_text(again["body"])}}, indent=2))
    else:
        print("\n".join(columns(side(f"captured {capture.get('id')}", capture, before),
                                side(f"replayed {again['id'] or ''}", again, again["body"]))))
    return 0
