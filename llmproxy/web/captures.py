"""The web side of the capture (observe/capture.py): a recording started for each
API request when `capture` is on (`start`, at the door, before the credentials
are taken off the request), kept at its end (`finish`), and the two admin reads:

- ``GET /api/captures[?limit=N&before=SEQ]``: the newest captures first, at most
  observe.capture.PAGE_MAX a page; `next` is the `before` of the next page. With
  capture off: `{"enabled": false, "captures": []}`.
- ``GET /api/captures/{id}``: one capture (redacted as kept), 404 when it is
  unknown or was let go.

Who may read them is the door's rule for admin paths (`access.ADMIN_PREFIXES`:
a trusted peer or an admin key); besides, as for the engine logs (a capture
quotes prompts), never for another site's page or through a rebound DNS name
(`origin.cross_site_refusal`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import re

from twisted.web.server import Request

from llmproxy.observe.capture import PAGE_DEFAULT, CaptureRing
from llmproxy.observe.inflight import COMPLETED, Exchange
from llmproxy.web.admin import json_answer
from llmproxy.web.errors import write_error
from llmproxy.web.requeststate import WithState

LIST_PATH = "/api/captures"
PREFIX = "/api/captures/"
ONE = re.compile(r"/api/captures/([A-Za-z0-9._-]{1,64})")
_CREDENTIALS = (b"authorization", b"x-api-key", b"proxy-authorization")


def _credentials(request: Request) -> tuple[str, ...]:
    """The secrets the client presented (to blank them wherever they appear)."""
    found: list[str] = []
    for name in _CREDENTIALS:
        for value in request.requestHeaders.getRawHeaders(name) or ():
            text = value.decode("latin-1").strip()
            scheme, _, rest = text.partition(" ")
            found += [text, rest.strip()] if rest else [text]
            if scheme.lower() == "basic" and rest:
                with contextlib.suppress(binascii.Error, ValueError):
                    found.append(base64.b64decode(rest.strip(), validate=True)
                                 .decode("latin-1").partition(":")[2])
    return tuple(s for s in found if s)


def start(ring: CaptureRing, request: Request, method: str, path: str) -> None:
    """Start recording an API request (its whole body is in: it was dispatched)."""
    if not isinstance(request, WithState):
        return
    body, size = b"", 0
    content = request.content
    if content is not None and ring.config.bodies:
        try:
            content.seek(0, 2)
            size = content.tell()
            content.seek(0)
            body = content.read(ring.config.max_record_bytes)
            content.seek(0)
        except (OSError, ValueError):       # a body that cannot be read is not kept
            body = b""
    headers = [(name, list(values)) for name, values in request.requestHeaders.getAllRawHeaders()]
    request.state.capture = ring.recording(method, path, headers, body, size,
                                           _credentials(request))


def finish(ring: CaptureRing, request: Request, exchange: Exchange) -> None:
    """The request ended: keep its capture."""
    if not isinstance(request, WithState):
        return
    recording, request.state.capture = request.state.capture, None
    if recording is not None:
        headers = [(n, list(v)) for n, v in request.responseHeaders.getAllRawHeaders()]
        # The status the client was sent (None: nothing was, a client gone first).
        ring.keep(recording, exchange, exchange.status, headers)


def _number(request: Request, name: str) -> int | None:
    values = (request.args or {}).get(name.encode())
    if not values:
        return None
    text = values[0].decode("latin-1")
    if not text.isdigit() or len(text) > 12:
        raise ValueError(f"{name} must be a non-negative integer")
    return int(text)


def serve(request: Request, path: str, ring: CaptureRing | None) -> str:
    """Answer GET /api/captures or /api/captures/{id}."""
    if path == LIST_PATH:
        if ring is None:
            return json_answer(request, 200, {"enabled": False, "captures": [], "next": None})
        try:
            limit, before = _number(request, "limit"), _number(request, "before")
        except ValueError as e:
            write_error(request, 400, str(e), "invalid_query")
            return COMPLETED
        return json_answer(request, 200, ring.page(limit or PAGE_DEFAULT, before))
    m = ONE.fullmatch(path)
    doc = ring.get(m.group(1)) if ring is not None and m is not None else None
    if doc is None:
        why = ("capture is off (the config has no `capture` block)" if ring is None
               else f"no capture {path[len(PREFIX):][:64]!r} (unknown, or let go by the ring)")
        write_error(request, 404, why, "capture_not_found")
        return COMPLETED
    return json_answer(request, 200, doc)
