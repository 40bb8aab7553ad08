"""The Anthropic Messages API's face: `POST /v1/messages` and
`/v1/messages/count_tokens` are routed by `model` like any API request and
streamed unchanged (llama-server speaks them); what differs is the shape of
the proxy's own errors on these paths, which the `anthropic` SDK parses:
``{"type": "error", "error": {"type": "not_found_error", "message": ...}}``."""

from __future__ import annotations

import json

from twisted.web.server import Request

PATHS = (b"/v1/messages", b"/v1/messages/count_tokens")

# Anthropic names errors by status (https://docs.anthropic.com/en/api/errors).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def speaks_anthropic(request: Request) -> bool:
    """Whether the request is on an Anthropic path (its errors take that shape)."""
    return request.path in PATHS


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error")


def error_doc(status: int, message: str) -> dict[str, object]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_body(status: int, message: str) -> bytes:
    """The JSON bytes of an Anthropic-style error."""
    return json.dumps(error_doc(status, message)).encode("utf-8") + b"\n"


def error_event(status: int, message: str) -> bytes:
    """An error in an Anthropic event stream whose 200 is already sent."""
    return f"event: error\ndata: {json.dumps(error_doc(status, message))}\n\n".encode()
