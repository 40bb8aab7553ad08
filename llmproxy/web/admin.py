"""The operator's actions (`llmproxy reload`, `upgrade`, `cordon`, `uncordon`,
`engine`): who may ask them from where, and the answers on hosts.

Who may ask at all is the door's rule (`access`: loopback, or an admin key).
Besides, a state-changing admin request (any method but GET and HEAD) is
refused (403) when a web page may have sent it (`cross_site_refusal`): its
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
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Collection
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from llmproxy.hosts.fleet import Fleet
from llmproxy.observe.inflight import CLIENT_GONE, COMPLETED

ADMIN_PATHS = ("/admin/cordon", "/admin/uncordon", "/admin/engine")
CROSS_SITE = "cross_site_request"        # the error codes of the two refusals
HOST_NOT_ALLOWED = "host_not_allowed"
_AUTHORITY = re.compile(r"(\[[0-9a-f:.]+\]|[^\s\[\]/\\:@?#%]+)(?::([0-9]{1,5}))?")
_ORIGIN = re.compile(r"(https?)://(.+)")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_SHOWN = 80         # at most this much of a header value is quoted back


def _authority(text: str, scheme: str) -> tuple[str, int] | None:
    """The (host, port) of a Host value or an origin's authority: lower case, an
    IPv6 literal without brackets in its canonical spelling, the scheme's default
    port when none is given; None when `text` is not one."""
    m = _AUTHORITY.fullmatch(text.lower())
    if m is None:
        return None
    host, port = m.group(1), int(m.group(2) or _DEFAULT_PORTS[scheme])
    if host.startswith("["):
        try:
            host = str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            return None
    return (host, port) if 0 < port < 65536 else None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _one(headers: Headers, name: bytes) -> str | None:
    """The header's one value (stripped); None when it is absent or repeated."""
    values = headers.getRawHeaders(name) or []
    return values[0].decode("latin-1").strip() if len(values) == 1 else None


def _shown(value: str) -> str:
    return repr(value if len(value) <= _SHOWN else value[:_SHOWN] + "...")


def cross_site_refusal(headers: Headers, secure: bool, keyed: bool,
                       server_names: Collection[str]) -> tuple[str, str] | None:
    """Why a state-changing admin request with these headers must be refused, as
    (error code, reason), or None when it may go on. `secure`: it came over the
    TLS listener; `keyed`: it carries a valid key (then any Host will do)."""
    scheme = "https" if secure else "http"
    host = _one(headers, b"host")
    own = _authority(host, scheme) if host is not None else None
    if headers.hasHeader(b"origin"):
        origin = _one(headers, b"origin") or ""
        m = _ORIGIN.fullmatch(origin.lower())
        theirs = _authority(m.group(2), m.group(1)) if m is not None else None
        if own is None or m is None or (m.group(1), theirs) != (scheme, own):
            mine = f"{scheme}://{host}" if own is not None else "unknown: no single valid Host"
            return CROSS_SITE, (f"Origin {_shown(origin)} is not this proxy's own ({mine}): "
                                "admin actions are never taken for another web site's page")
    for value in headers.getRawHeaders(b"sec-fetch-site") or []:
        if value.strip().lower() in (b"cross-site", b"same-site"):
            return CROSS_SITE, (f"Sec-Fetch-Site: {value.strip().decode('latin-1')} (the "
                                "browser says another site's page sent it)")
    if keyed:
        return None
    if own is None:
        shown = "several Host headers" if host is None and headers.hasHeader(b"host") \
            else f"Host {_shown(host or '')}"
        return HOST_NOT_ALLOWED, (f"{shown}: a request without a key must name the proxy "
                                  "in one valid Host header")
    if not (_is_ip(own[0]) or own[0] == "localhost" or own[0] in server_names):
        return HOST_NOT_ALLOWED, (f"Host {_shown(host or '')} is not an IP address, "
                                  "localhost or one of server_names: without a key, admin "
                                  "actions answer only those (a guard against DNS rebinding)")
    return None


def _answer(request: Request, status: int, doc: dict[str, Any]) -> str:
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
        return _answer(request, 404, {"outcome": "failed", "host": host,
                                      "reason": f"no host named {host!r}"})
    if path == "/admin/engine":
        return await _engine(request, fleet, host)
    cordoned = path == "/admin/cordon"
    try:
        fleet.cordon(host, cordoned)
    except OSError as e:
        return _answer(request, 500, {"outcome": "failed", "host": host,
                                      "reason": f"cannot write the cordon file: {e}"})
    return _answer(request, 200, {"outcome": "cordoned" if cordoned else "uncordoned",
                                  "host": host, "in_flight": gate.in_flight(),
                                  "queued": gate.queued()})


async def _engine(request: Request, fleet: Fleet, host: str) -> str:
    op, engine = _arg(request, "op"), _arg(request, "engine")
    if op not in ("start", "stop") or (op == "start" and engine is None):
        return _answer(request, 400, {"outcome": "failed", "host": host, "reason":
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
    return _answer(request, 200 if reason is None else 409, doc)
