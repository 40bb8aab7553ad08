"""Who may ask what: inbound API keys at the door.

Without a keys file everything is as it always was (admin actions from
loopback only). With one, every request but `/healthz` and `/readyz` names a
key (`Authorization: Bearer SECRET`, `x-api-key: SECRET`, or HTTP Basic with
the secret as the password, which is how a browser sends it to the page and
its event stream); the key's scope filters the models it sees and may use (a
model out of scope reads exactly as one that does not exist); `/status`,
`/api/events`, `/metrics` and the page need an admin key unless
`public_status`; admin actions and the engine logs (`/api/hosts/H/log`) need
loopback or an admin key (without keys: loopback only). Once a request
is let in, the client's credentials are removed from it: they never travel
upstream (only to the proxy's own successor, when an upgrade re-sends a request
that waited, so that the successor's door lets it in as this one did). No
answer, log line or event ever carries a secret, and a refusal quotes the
client's path only as `core.text.shown` makes it.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from twisted.web.server import Request

from llmproxy.config.keys import ApiKey, KeyRing
from llmproxy.core.text import shown
from llmproxy.hosts.catalog import Catalog, Route
from llmproxy.web.cors import Cors
from llmproxy.web.ratelimit import RateLimits

OPEN = frozenset({"/healthz", "/readyz"})
WATCH = frozenset({"/", "/status", "/api/events", "/metrics"})
CREDENTIALS = (b"authorization", b"x-api-key")
ADMIN_PREFIXES = ("/admin/", "/api/hosts/")     # the admin actions, and the engine logs


def is_loopback(host: str) -> bool:
    """Whether a peer address is a loopback one (IPv4-mapped included)."""
    try:
        return ipaddress.ip_address(host.removeprefix("::ffff:")).is_loopback
    except ValueError:
        return False


class Malformed(Exception):
    """The credentials cannot be read (the message says how, never what)."""


def presented_secret(request: Request) -> bytes | None:
    """The secret the request carries, if any; Malformed if its credential
    headers are broken or disagree."""
    found: list[bytes] = []
    auth = request.requestHeaders.getRawHeaders(b"authorization") or []
    if len(auth) > 1:
        raise Malformed("more than one Authorization header")
    if auth:
        scheme, _, value = auth[0].strip().partition(b" ")
        value = value.strip()
        if scheme.lower() == b"bearer" and value and b" " not in value:
            found.append(value)
        elif scheme.lower() == b"basic" and value:
            try:
                decoded = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise Malformed("Authorization: Basic is not valid base64") from None
            _user, colon, password = decoded.partition(b":")
            if not colon or not password:
                raise Malformed("Authorization: Basic needs the key as its password")
            found.append(password)
        else:
            raise Malformed('Authorization must be "Bearer <key>"')
    api_key = request.requestHeaders.getRawHeaders(b"x-api-key") or []
    if len(api_key) > 1 or (api_key and not api_key[0].strip()):
        raise Malformed("x-api-key must be one non-empty value")
    found += [v.strip() for v in api_key]
    if len(set(found)) > 1:
        raise Malformed("Authorization and x-api-key name different keys")
    return found[0] if found else None


@dataclass(frozen=True)
class Refusal:
    """A request turned away at the door."""

    status: int
    message: str
    code: str
    type_: str
    challenge: bool = False     # ask a browser for credentials (WWW-Authenticate)


def _unauthorized(message: str, challenge: bool) -> Refusal:
    return Refusal(401, message, "invalid_api_key", "invalid_request_error", challenge)


@dataclass(frozen=True)
class Admitted:
    """A request let in: its key (None when keys are off or for a keyless
    loopback admin action)."""

    key: ApiKey | None
    # The credential headers the door removed (name, values): sent again only
    # to this proxy's own successor, when an upgrade re-sends the request.
    credentials: tuple[tuple[bytes, tuple[bytes, ...]], ...] = ()

    def scoped(self, catalog: Catalog) -> Catalog:
        """The catalog as this key sees it."""
        if self.key is None or self.key.models is None:
            return catalog
        return ScopedCatalog(catalog, self.key)


class Access:
    """The keys in force (None: keys are off) and the door's rules; the keys'
    rate limits (`limits`, None: not counted) and the origins whose pages may
    call the API (`cors`)."""

    def __init__(self, keys: KeyRing | None = None, public_status: bool = False,
                 limits: RateLimits | None = None, cors: Cors | None = None) -> None:
        self.keys = keys
        self.public_status = public_status
        self.limits = limits
        self.cors = cors or Cors()

    @property
    def on(self) -> bool:
        return self.keys is not None

    def check(self, request: Request, path: str) -> Admitted | Refusal:
        """Let `request` in or refuse it; a request let in loses its credentials."""
        verdict = self.judge(request, path)
        if isinstance(verdict, Refusal) or verdict.key is None:
            return verdict
        removed = tuple((name, tuple(values)) for name in CREDENTIALS
                        if (values := request.requestHeaders.getRawHeaders(name)))
        for name in CREDENTIALS:
            request.requestHeaders.removeHeader(name)
        return Admitted(verdict.key, removed)

    def judge(self, request: Request, path: str) -> Admitted | Refusal:
        """The door's verdict on `request` from its headers and peer alone
        (its body is not needed, nor read: an HTTP/2 stream is judged when its
        headers arrive); it changes nothing on the request."""
        peer = getattr(request.getClientAddress(), "host", "")
        admin_path = path.startswith(ADMIN_PREFIXES)
        if self.keys is None:
            if admin_path and not is_loopback(peer):
                return Refusal(403, f"{shown(path)} answers loopback only", "forbidden",
                               "permission_error")
            return Admitted(None)
        if path in OPEN:
            return Admitted(None)
        watch = path in WATCH or path.startswith("/page/")
        try:
            secret = presented_secret(request)
        except Malformed as e:
            return _unauthorized(f"malformed credentials: {e}", watch)
        if secret is None:
            if admin_path and is_loopback(peer):
                return Admitted(None)
            if watch and self.public_status:
                return Admitted(None)
            return _unauthorized("no API key: send Authorization: Bearer <key> or "
                                 "x-api-key: <key>", watch)
        key = self.keys.find(secret)
        if key is None:
            return _unauthorized("invalid API key", watch)
        needs_admin = (watch and not self.public_status) or (admin_path and not is_loopback(peer))
        if needs_admin and not key.admin:
            return Refusal(403, f"{shown(path)} needs an admin key", "forbidden",
                           "permission_error")
        return Admitted(key)


def spellings(route: Route) -> Iterable[str]:
    """The public names a route answers to, for scope globs: its listed name,
    and without the `host/` prefix of `naming: host`."""
    yield route.name
    prefix = route.host.name + "/"
    if route.name.startswith(prefix):
        yield route.name[len(prefix):]


class ScopedCatalog(Catalog):
    """A catalog as one key sees it: the models out of its scope do not exist."""

    def __init__(self, inner: Catalog, key: ApiKey) -> None:  # no super(): a view
        self.config = inner.config
        self._inner = inner
        self._key = key

    def _allowed(self, route: Route) -> bool:
        return self._key.allows(spellings(route))

    def resolve(self, name: str) -> Route | None:
        route = self._inner.resolve(name)
        return route if route is not None and self._allowed(route) else None

    def routes(self) -> list[Route]:
        return [r for r in self._inner.routes() if self._allowed(r)]

    def model_list(self, state: Callable[[Route], str] | None = None) -> dict[str, Any]:
        return {"object": "list", "data": [r.describe(state(r) if state else None)
                                           for r in self.routes()]}
