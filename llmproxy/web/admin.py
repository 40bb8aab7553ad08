"""The operator's actions (`llmproxy reload`, `upgrade`, `cordon`, `uncordon`,
`engine`): who may ask them from where, and the answers on hosts.

Who may ask at all is the door's rule (`access`: a trusted peer, loopback by
default, or an admin key).
Besides, a state-changing admin request (any method but GET and HEAD) is
refused (403) when a web page may have sent it (`origin.cross_site_refusal`): its
`Origin` is not the proxy's own (the scheme of the listener, and the host and
port of the request's `Host`), or `Sec-Fetch-Site` says `cross-site` or
`same-site`; and, without a key, when its `Host` is not an IP literal,
`localhost` or one of `server_names` (a rebound DNS name: a page of
evil.example whose name now points at 127.0.0.1). The `llmproxy` commands and
curl send no `Origin` and name the proxy by its address, so they pass.

The actions on hosts:

- ``POST /admin/cordon?host=H``, ``POST /admin/uncordon?host=H``: 200 with the
  host's requests in flight and queued, 404 for an unknown host, 500 when the
  cordon file cannot be written (then nothing changed);
- ``POST /admin/engine?host=H&op=start&engine=E``, ``...&op=stop[&engine=E]``: answered
  once done (200) or failed (409, with the reason); a stop waits for the
  requests on the engine. A client that leaves withdraws a command still queued.
- ``POST /admin/wake?host=H``, ``POST /admin/sleep?host=H``: a host with a ``wake`` or
  ``sleep`` block woken (answered once it answers, or 409 when it did not within its
  timeout) or told to sleep (409 naming what keeps it awake); hosts/naps.py.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.web.server import Request

from llmproxy.hosts.fleet import Fleet
from llmproxy.observe.inflight import CLIENT_GONE, COMPLETED
from llmproxy.web.origin import CROSS_SITE, HOST_NOT_ALLOWED, cross_site_refusal

ADMIN_PATHS = ("/admin/cordon", "/admin/uncordon", "/admin/engine", "/admin/wake",
               "/admin/sleep")
__all__ = ["ADMIN_PATHS", "CROSS_SITE", "HOST_NOT_ALLOWED", "admin", "cross_site_refusal",
           "json_answer"]


def json_answer(request: Request, status: int, doc: Any) -> str:
    """Answer `doc` as JSON with `status`, never cached (the admin and capture paths)."""
    body = json.dumps(doc).encode("utf-8") + b"\n"
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"cache-control", b"no-store")
    request.write(body)
    request.finish()
    return COMPLETED


def _arg(request: Request, name: str) -> str | None:
    values = (request.args or {}).get(name.encode())
    return values[0].decode("utf-8", "replace") if values else None


async def admin(request: Request, path: str, fleet: Fleet) -> str:
    """Answer one of ADMIN_PATHS (already checked: POST, from loopback)."""
    host = _arg(request, "host") or ""
    gate = fleet.gates.get(host)
    if gate is None:
        return json_answer(request, 404, {"outcome": "failed", "host": host,
                                      "reason": f"no host named {host!r}"})
    if path == "/admin/engine":
        return await _engine(request, fleet, host)
    if path in ("/admin/wake", "/admin/sleep"):
        return await _sleep_wake(request, fleet, host, path.rsplit("/", 1)[1])
    cordoned = path == "/admin/cordon"
    try:
        fleet.cordon(host, cordoned)
    except OSError as e:
        return json_answer(request, 500, {"outcome": "failed", "host": host,
                                      "reason": f"cannot write the cordon file: {e}"})
    return json_answer(request, 200, {"outcome": "cordoned" if cordoned else "uncordoned",
                                  "host": host, "in_flight": gate.in_flight(),
                                  "queued": gate.queued()})


async def _engine(request: Request, fleet: Fleet, host: str) -> str:
    op, engine = _arg(request, "op"), _arg(request, "engine")
    if op not in ("start", "stop") or (op == "start" and engine is None):
        return json_answer(request, 400, {"outcome": "failed", "host": host, "reason":
                                      "op=start&engine=E, op=stop&engine=E or op=stop, "
                                      "please"})
    pending = Deferred.fromCoroutine(fleet.command(host, op, engine))
    request.notifyFinish().addErrback(lambda _: pending.cancel())
    try:
        reason = await pending
    except CancelledError:
        return CLIENT_GONE
    manager = fleet.managers.get(host)
    doc = {"outcome": "done" if reason is None else "failed", "host": host, "op": op,
           "engine": engine, "reason": reason,
           "running": manager.running if manager is not None else None,
           "resident": list(manager.running_engines()) if manager is not None else []}
    return json_answer(request, 200 if reason is None else 409, doc)


async def _sleep_wake(request: Request, fleet: Fleet, host: str, op: str) -> str:
    pending = Deferred.fromCoroutine(fleet.naps.command(host, op))
    if op == "wake":   # a client that leaves withdraws its wait; a sleep order runs its course
        request.notifyFinish().addErrback(lambda _: pending.cancel())
    try:
        reason = await pending
    except CancelledError:
        return CLIENT_GONE
    return json_answer(request, 200 if reason is None else 409, {
        "outcome": "done" if reason is None else "failed", "host": host, "op": op,
        "reason": reason, "state": fleet.naps.state(host)})
