"""CORS for browser chat UIs: the config's `cors.origins` may call the API
paths (`/v1/*`, the Anthropic Messages path among them) from their pages.

A response to a request whose `Origin` is allowed carries
`Access-Control-Allow-Origin` (that origin, or `*` when the config says `*`),
`Vary: Origin`, and `Access-Control-Expose-Headers` naming what a page may read
(the request id, Retry-After, the rate-limit headers); errors and streams too,
as the headers are set before anything else is written. A preflight
(`OPTIONS` with an allowed `Origin`) is answered 204 at once, before the door
(a browser sends no key with it), with the methods and headers a client may
use. Any other origin gets no CORS header, and nothing is allowed by default.

Only the API paths: `/status`, `/api/*`, `/metrics`, the page and the admin
actions stay same-origin (web/admin.py refuses a cross-site admin action
whatever this says). The engines' own CORS headers never reach a client
(web/relay.py drops them): what a page may call is the proxy's decision.
"""

from __future__ import annotations

import re

from twisted.web.server import Request

API_PREFIX = "/v1/"
METHODS = b"GET, POST, OPTIONS"
HEADERS = ("Authorization", "Content-Type", "x-api-key", "anthropic-version",
           "anthropic-beta", "OpenAI-Organization", "OpenAI-Project", "X-Request-Id")
EXPOSED = (b"X-Request-Id, Retry-After, x-ratelimit-limit-requests, "
           b"x-ratelimit-remaining-requests, x-ratelimit-reset-requests, "
           b"x-ratelimit-limit-tokens, x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens")
MAX_AGE = b"600"
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
_REQUESTED_MAX = 32     # request headers a preflight may name beyond HEADERS


class Cors:
    """The origins allowed to call the API paths (empty: none; ("*",): any)."""

    def __init__(self, origins: tuple[str, ...] = ()) -> None:
        self.origins = frozenset(origins)

    def allowed(self, request: Request, path: str) -> bytes | None:
        """The Access-Control-Allow-Origin value for `request` (None: none)."""
        if not self.origins or not path.startswith(API_PREFIX):
            return None
        origin = request.requestHeaders.getRawHeaders(b"origin")
        if origin is None or len(origin) != 1:
            return None
        if "*" in self.origins:
            return b"*"
        value = origin[0].strip()
        try:
            allowed = value.decode("ascii").lower() in self.origins
        except UnicodeDecodeError:
            return None
        return value if allowed else None

    def mark(self, request: Request, path: str) -> bool:
        """Set the CORS headers on the response to an allowed origin; whether it is one."""
        value = self.allowed(request, path)
        if value is None:
            return False
        headers = request.responseHeaders
        headers.setRawHeaders(b"access-control-allow-origin", [value])
        headers.setRawHeaders(b"vary", [b"Origin"])
        headers.setRawHeaders(b"access-control-expose-headers", [EXPOSED])
        return True

    def preflight(self, request: Request) -> None:
        """Answer a preflight of an allowed origin (after `mark`): 204, the methods
        and headers a page may use, cached for MAX_AGE seconds."""
        names = list(HEADERS)
        known = {n.lower() for n in names}
        asked = b",".join(request.requestHeaders.getRawHeaders(
            b"access-control-request-headers") or [])
        for raw in asked.split(b",")[:_REQUESTED_MAX]:
            name = raw.strip()
            if _TOKEN.fullmatch(name) and name.decode().lower() not in known:
                names.append(name.decode())
                known.add(name.decode().lower())
        headers = request.responseHeaders
        headers.setRawHeaders(b"access-control-allow-methods", [METHODS])
        headers.setRawHeaders(b"access-control-allow-headers", [", ".join(names).encode()])
        headers.setRawHeaders(b"access-control-max-age", [MAX_AGE])
        request.setResponseCode(204)
        request.finish()
