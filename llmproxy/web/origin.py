"""Which names and pages the proxy answers: its Host allow-list and the
cross-site refusals.

- **Host** (`host_refusal`): a request let in without a key (keys off, a
  keyless admin action from a trusted peer, a `public_status` read) must name
  the proxy in one valid `Host` that is an IP literal, `localhost` or one of
  `server_names`; anything else is 403 `host_not_allowed`. A page of
  evil.example whose DNS name was rebound to the proxy's address is then
  same-origin to the browser, but its requests name evil.example: this is what
  keeps such a page from reading `/status` or running models. `/healthz` and
  `/readyz` answer any name (probes). A request with a valid key may use any
  name: a page cannot present a key across sites.
- **Cross-site admin actions** (`cross_site_refusal`): a state-changing admin
  request whose `Origin` is not the proxy's own (the listener's scheme, the
  request's Host), or whose `Sec-Fetch-Site` is `cross-site` or `same-site`.
- **Cross-site API requests** (`api_cross_site_refusal`): a POST to a model path
  from another site's page (its `Origin` not the proxy's own and not allowed by
  `cors.origins`, or `Sec-Fetch-Site: cross-site`) is refused, keys or not: a
  `text/plain` POST needs no preflight, and without this any page could run
  models blind. Clients that are not browsers send no `Origin` and pass.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection

from twisted.web.http_headers import Headers

CROSS_SITE = "cross_site_request"        # the error codes of the refusals
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


def _foreign_origin(headers: Headers, secure: bool) -> str | None:
    """Why the request's `Origin` is not the proxy's own, or None (no Origin, or
    the proxy's own: the listener's scheme and the request's one Host)."""
    if not headers.hasHeader(b"origin"):
        return None
    scheme = "https" if secure else "http"
    host = _one(headers, b"host")
    own = _authority(host, scheme) if host is not None else None
    origin = _one(headers, b"origin") or ""
    m = _ORIGIN.fullmatch(origin.lower())
    theirs = _authority(m.group(2), m.group(1)) if m is not None else None
    if own is not None and m is not None and (m.group(1), theirs) == (scheme, own):
        return None
    mine = f"{scheme}://{host}" if own is not None else "unknown: no single valid Host"
    return f"Origin {_shown(origin)} is not this proxy's own ({mine})"


def _fetch_site(headers: Headers, refused: tuple[bytes, ...]) -> str | None:
    for value in headers.getRawHeaders(b"sec-fetch-site") or []:
        if value.strip().lower() in refused:
            return (f"Sec-Fetch-Site: {value.strip().decode('latin-1')} (the browser says "
                    "another site's page sent it)")
    return None


def host_refusal(headers: Headers, server_names: Collection[str]) -> str | None:
    """Why a request let in without a key must be refused for its Host (error code
    HOST_NOT_ALLOWED), or None when it names the proxy as it may."""
    host = _one(headers, b"host")
    own = _authority(host, "http") if host is not None else None
    if own is None:
        shown = "several Host headers" if host is None and headers.hasHeader(b"host") \
            else f"Host {_shown(host or '')}"
        return f"{shown}: a request without a key must name the proxy in one valid Host header"
    if not (_is_ip(own[0]) or own[0] == "localhost" or own[0] in server_names):
        return (f"Host {_shown(host or '')} is not an IP address, localhost or one of "
                "server_names: without a key, the proxy answers only those (a guard "
                "against DNS rebinding; list the proxy's DNS names in server_names)")
    return None


def cross_site_refusal(headers: Headers, secure: bool, keyed: bool,
                       server_names: Collection[str]) -> tuple[str, str] | None:
    """Why a state-changing admin request with these headers must be refused, as
    (error code, reason), or None when it may go on. `secure`: it came over the
    TLS listener; `keyed`: it carries a valid key (then any Host will do)."""
    foreign = _foreign_origin(headers, secure)
    if foreign is not None:
        return CROSS_SITE, f"{foreign}: admin actions are never taken for another web site's page"
    fetch_site = _fetch_site(headers, (b"cross-site", b"same-site"))
    if fetch_site is not None:
        return CROSS_SITE, fetch_site
    if keyed:
        return None
    reason = host_refusal(headers, server_names)
    return None if reason is None else (HOST_NOT_ALLOWED, reason)


def api_cross_site_refusal(headers: Headers, secure: bool, cors_allowed: bool) -> str | None:
    """Why an API POST must be refused as another site's (error code CROSS_SITE),
    or None. `cors_allowed`: its Origin is one `cors.origins` allows for its path."""
    if cors_allowed:
        return None
    foreign = _foreign_origin(headers, secure)
    if foreign is not None:
        return (f"{foreign} and not in cors.origins: the API answers another web site's "
                "page only when the config allows its origin")
    return _fetch_site(headers, (b"cross-site",))
