"""Credentials upstream: each host's own key, never the client's.

A host with `api_key_env` (an engine started with `--api-key`) gets
`Authorization: Bearer <the variable's value>` on every request the proxy sends
it, roster reads included; whatever Authorization the client sent is replaced.
The value is read from the environment once, at start, and lives only here: it
is never in the config, a log line, an event or `/status`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.internet.defer import Deferred
from twisted.web.http_headers import Headers

from llmproxy.config import HostConfig
from llmproxy.web.forward import HTTPClient


class UpstreamCredentials:
    """An HTTP client that adds each host's key to the requests bound for it."""

    def __init__(self, inner: HTTPClient, hosts: tuple[HostConfig, ...],
                 secrets: Mapping[str, str]) -> None:
        self._inner = inner
        # Longest URL first: a host whose URL extends another's wins.
        self._bases = sorted(
            ((h.url, f"Bearer {secrets[h.name]}".encode()) for h in hosts if h.name in secrets),
            key=lambda item: -len(item[0]))

    def _key_for(self, url: str) -> bytes | None:
        for base, value in self._bases:
            if url == base or url.startswith((base + "/", base + "?")):
                return value
        return None

    def request(self, method: str, url: str, *, data: Any, headers: Headers,
                unbuffered: bool, allow_redirects: bool) -> Deferred[Any]:
        value = self._key_for(url)
        if value is not None:
            headers = headers.copy()
            headers.setRawHeaders(b"authorization", [value])
        return self._inner.request(method, url, data=data, headers=headers,
                                   unbuffered=unbuffered, allow_redirects=allow_redirects)

    def get(self, url: str) -> Deferred[Any]:
        value = self._key_for(url)
        if value is None:
            return self._inner.get(url)
        return self._inner.request("GET", url, data=b"", headers=Headers(
            {b"authorization": [value]}), unbuffered=True, allow_redirects=False)
