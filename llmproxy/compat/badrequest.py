"""The answer to a malformed request: the channel's own, not Twisted's bare 400.

Waits for a public hook for the answer to a malformed request. Twisted 26.10's
HTTPChannel answers a request it cannot parse (a bad request line, header or
Content-Length, a malformed chunk, too many headers) by calling its private
`_respondToBadRequestAndDisconnect`, which writes `HTTP/1.1 400 Bad Request`
with no body and closes the connection. The mixin here overrides that one
method: the channel's `malformed_request_answer()` is written instead (the
proxy's OpenAI-style JSON 400), then the connection closes as Twisted's does.
The guard holds the source of that method and of every Twisted caller of it;
when it fails, Twisted's bare 400 stands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmproxy.compat import Compat, changed_sources

# The method overridden and its callers, as Twisted 26.10 has them.
SOURCES = {
    "twisted.web.http.HTTPChannel._respondToBadRequestAndDisconnect": "c7ccc0f4450a7d6b",
    "twisted.web.http.HTTPChannel.lineReceived": "b77ec6f21116e827",
    "twisted.web.http.HTTPChannel.headerReceived": "c5cb8e0dd2fe0b44",
    "twisted.web.http.HTTPChannel._failChooseTransferDecoder": "060b99b5f9f9cefd",
    "twisted.web.http.HTTPChannel.rawDataReceived": "e31f4ed81196fab0",
    "twisted.web.http.Request.requestReceived": "99ca6c5e24305de4",
}


def guard() -> str | None:
    """None when Twisted answers a malformed request as this follows (26.10)."""
    return changed_sources(SOURCES)


class MalformedRequestAnswer:
    """Mixed into an HTTPChannel subclass, before it in the bases: a malformed
    request is answered with the channel's `malformed_request_answer()` (the
    whole response, as bytes), then the connection closes. A channel without
    that method keeps Twisted's answer."""

    transport: Any
    loseConnection: Callable[[], None]

    def _respondToBadRequestAndDisconnect(self) -> None:
        answer = getattr(self, "malformed_request_answer", None)
        if answer is None:
            super()._respondToBadRequestAndDisconnect()  # type: ignore[misc]
            return
        self.transport.write(answer())
        self.loseConnection()


COMPAT = Compat(
    "bad_request_json", "a malformed request is answered with the proxy's JSON 400",
    "a public hook for the answer to a malformed request", guard, MalformedRequestAnswer)
