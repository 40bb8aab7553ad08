"""OpenAI-style JSON error bodies, the only error shape clients ever see.

An error body never quotes an engine's log (`core.redact`): a message that
quotes one (a failed engine's 424) reaches the client with the line withheld;
the access line and the operator's views keep it.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from twisted.web.http import RESPONSES
from twisted.web.server import Request

from llmproxy.core.redact import redact_text
from llmproxy.web import anthropic
from llmproxy.web.requeststate import WithState

# The OpenAI API names error types by class of trouble; clients (the openai SDK
# among them) map the status code to an exception and show `message`.
_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    424: "model_unavailable",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


# The reason phrase of every status the proxy may send: Twisted's table, and the
# IANA registry (Python's HTTPStatus) for what it lacks (424, 429, 431 among them),
# so no status line says `Unknown Status`.
REASONS: dict[int, bytes] = {
    **{s.value: s.phrase.encode("latin-1") for s in HTTPStatus}, **RESPONSES}


def reason(status: int) -> bytes:
    """The standard reason phrase of `status` (`Unknown Status` for an unregistered one)."""
    return REASONS.get(status, b"Unknown Status")


def error_body(status: int, message: str, code: str | int | None = None,
               type_: str | None = None) -> bytes:
    """The JSON bytes of an OpenAI-style error."""
    return json.dumps({
        "error": {
            "message": redact_text(message),
            "type": type_ or _TYPES.get(status, "server_error"),
            "code": code if code is not None else status,
        }
    }).encode("utf-8") + b"\n"


def raw_error(status: int, phrase: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response that closes its connection, for the
    channel to write when there is no request to answer through (a request
    whose headers never completed, a malformed one)."""
    body = error_body(status, message, code)
    head = (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


def write_error(request: Request, status: int, message: str,
                code: str | int | None = None, type_: str | None = None) -> None:
    """Answer `request` with an OpenAI-style error (Anthropic-style on the
    Anthropic paths) and finish it."""
    if anthropic.speaks_anthropic(request):
        body = anthropic.error_body(status, redact_text(message))
    else:
        body = error_body(status, message, code, type_)
    request.setResponseCode(status)
    request.responseHeaders.setRawHeaders(b"content-type", [b"application/json"])
    request.responseHeaders.setRawHeaders(b"content-length", [str(len(body)).encode()])
    if isinstance(request, WithState) and request.state.capture is not None:
        request.state.capture.feed(body)        # the answer a capture keeps
    request.write(body)
    request.finish()


def not_allowed(request: Request, what: str, allow: tuple[str, ...]) -> None:
    """Answer a method `what` does not take: 405 with `Allow` (RFC 9110 section
    15.5.6) listing the methods it does take; the message names the first."""
    request.setHeader(b"allow", ", ".join(allow).encode("latin-1"))
    write_error(request, 405, f"{what} takes {allow[0]}", "method_not_allowed")
