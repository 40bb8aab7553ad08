"""Who may ask what: inbound API keys at the door, and the names it answers.

Without a keys file everything is open but the operator's parts (admin actions
and the engine logs answer trusted peers only: `trusted_peers`, loopback by
default). With one, every request but `/healthz` and `/readyz` names a
key (`Authorization: Bearer SECRET`, `x-api-key: SECRET`, or HTTP Basic with
the secret as the password, which is how a browser sends it to the page and
its event stream); the key's scope filters the models it sees and may use (a
model out of scope reads exactly as one that does not exist); `/status`,
`/api/events`, `/metrics` and the page need an admin key unless
`public_status`; admin actions and the engine logs (`/api/hosts/H/log`) need
a trusted peer or an admin key. A request let in without a key must name
the proxy by a Host it answers (`origin.host_refusal`: a guard against DNS
rebinding), on every path but `/healthz` and `/readyz`. Engine log text and
client addresses (`core.redact`) are for those who may read the logs
(`sees_logs`). Once a request
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
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred
from twisted.web.server import Request

from llmproxy.config.keys import ApiKey, KeyRing
from llmproxy.core.text import shown
from llmproxy.hosts.catalog import Catalog, Route
from llmproxy.web.cors import Cors
from llmproxy.web.energybudget import EnergyBudgets
from llmproxy.web.origin import HOST_NOT_ALLOWED, host_refusal
from llmproxy.web.ratelimit import RateLimits
from llmproxy.web.requeststate import client_host

OPEN = frozenset({"/healthz", "/readyz"})
WATCH = frozenset({"/", "/status", "/api/events", "/metrics"})
CREDENTIALS = (b"authorization", b"x-api-key")
# The admin actions, the engine logs, and the captures (they quote prompts).
ADMIN_PREFIXES = ("/admin/", "/api/hosts/", "/api/captures")
LOOPBACK = ("127.0.0.0/8", "::1/128")             # the default trusted peers


def trusted_by(networks: Collection[str]) -> Callable[[str], bool]:
    """Whether a peer address (IPv4-mapped IPv6 read as IPv4) is in one of `networks`."""
    nets = [ipaddress.ip_network(n) for n in networks]

    def trusted(host: str) -> bool:
        try:
            address = ipaddress.ip_address(host.removeprefix("::ffff:"))
        except ValueError:
            return False
        return any(address in net for net in nets)
    return trusted


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
    rate limits (`limits`, None: not counted) and energy budgets (`energy`,
    None: not counted), the origins whose pages may
    call the API (`cors`), the Host names answered without a key besides IP
    literals and localhost (`server_names`) and the peers trusted as the
    operator's own (`trusted_peers`)."""

    def __init__(self, keys: KeyRing | None = None, public_status: bool = False,
                 limits: RateLimits | None = None, cors: Cors | None = None,
                 server_names: Collection[str] = (),
                 trusted_peers: Collection[str] = LOOPBACK,
                 energy: EnergyBudgets | None = None) -> None:
        self.keys = keys
        self.energy = energy
        self.public_status = public_status
        self.limits = limits
        self.cors = cors or Cors()
        self.server_names = frozenset(server_names)
        self.trusted = trusted_by(trusted_peers)
        self._inheriting: list[Deferred[None]] | None = None

    def inherit(self) -> Callable[[], None]:
        """The keys' use so far is on its way (an upgrade's successor, from its
        predecessor): until the function returned is called, a request of a
        key with limits waits (`settling`), so no key is judged on part of its
        use. The caller calls it once that use has come (or will not)."""
        self._inheriting = []
        return self._settle

    def _settle(self) -> None:
        waiting, self._inheriting = self._inheriting, None
        for d in waiting or ():
            if not d.called:        # (a waiter cancelled when its client left)
                d.callback(None)

    def settling(self, key: ApiKey) -> Deferred[None] | None:
        """What a request of `key` waits on before its limits are checked: None
        unless its use so far is still on its way and it has limits counted here."""
        if self._inheriting is None or not (
                (key.wh_per_day is not None and self.energy is not None)
                or ((key.rpm is not None or key.tpm is not None) and self.limits is not None)):
            return None
        waiter: Deferred[None] = Deferred()
        self._inheriting.append(waiter)
        return waiter

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
        headers arrive); it changes nothing on the request. A request let in
        without a key must name the proxy in its Host (web/origin.py)."""
        verdict = self._door(request, path)
        if isinstance(verdict, Admitted) and verdict.key is None and path not in OPEN:
            reason = host_refusal(request.requestHeaders, self.server_names)
            if reason is not None:
                return Refusal(403, reason, HOST_NOT_ALLOWED, "permission_error")
        return verdict

    def sees_logs(self, request: Request, verdict: Admitted) -> bool:
        """Whether the client of a request let in may read engine log text and
        client addresses: an admin key, or with keys off a trusted peer."""
        if self.keys is None:
            return self.trusted(client_host(request, ""))
        return verdict.key is not None and verdict.key.admin

    def _door(self, request: Request, path: str) -> Admitted | Refusal:
        peer = client_host(request, "")
        admin_path = path.startswith(ADMIN_PREFIXES)
        if self.keys is None:
            if admin_path and not self.trusted(peer):
                return Refusal(403, f"{shown(path)} answers trusted peers only "
                               "(trusted_peers; by default loopback only)", "forbidden",
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
            if admin_path and self.trusted(peer):
                return Admitted(None)
            if watch and self.public_status:
                return Admitted(None)
            return _unauthorized("no API key: send Authorization: Bearer <key> or "
                                 "x-api-key: <key>", watch)
        key = self.keys.find(secret)
        if key is None:
            return _unauthorized("invalid API key", watch)
        needs_admin = (watch and not self.public_status) or (admin_path and not self.trusted(peer))
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
