"""Request headers over the limits are a 431 (RFC 6585), not Twisted's bare 400;
a second Host header is a 400 (RFC 9112 section 3.2), which Twisted accepts.

Twisted's channel refuses more than `totalHeadersSize` bytes of request line
and headers, more than `maxHeaders` headers, or one line over `MAX_LENGTH`;
the proxy's channel (web/channel.py) answers each with `431 Request Header Fields Too Large` and an
OpenAI-style body, then closes the connection. A request with two Host
headers is answered `400 Bad Request` the same way: its target would be
ambiguous (one part may route by one, another part by the other). Nothing of
the headers is echoed (they may carry a key).

An HTTP/2 request's headers come decoded, past every channel: `over_limits`
counts them as the HTTP/1.1 channel counts a head, so the same limits refuse
them (the HTTP/2 connection answers its 431, llmproxy.compat.h2limits)."""

from __future__ import annotations

from llmproxy.web.errors import error_body, raw_error

TWO_HOSTS = raw_error(400, "Bad Request", "more than one Host header (RFC 9112 section 3.2)",
                      "bad_request")


def header_fields_too_large(message: str) -> bytes:
    """The whole 431 response, closing its connection."""
    body = refusal_body(message)
    head = ("HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


def over_limits(headers: list[tuple[bytes, bytes]], max_headers: int,
                max_size: int) -> str | None:
    """Why an HTTP/2 request's `headers` (pseudo-headers included) are over
    the limits of an HTTP/1.1 head, counted as that head would be written:
    `:method` and `:path` in its request line, `:authority` as its Host
    header, each other header `name: value`; None when within them."""
    size, count = len(b"HTTP/1.1"), 0
    for name, value in headers:
        if name in (b":method", b":path"):
            size += len(value) + 1
        elif name == b":authority" or not name.startswith(b":"):
            size += len(name) + 2 + len(value)
            count += 1
    if count > max_headers:
        return f"more than {max_headers} request headers"
    if size > max_size:
        return f"request headers over {max_size} bytes"
    return None


def refusal_body(message: str) -> bytes:
    """The JSON body of the 431 for headers over the limits."""
    return error_body(431, message, "request_header_fields_too_large", "invalid_request_error")
