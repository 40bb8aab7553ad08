"""Request headers over the limits are a 431 (RFC 6585), not Twisted's bare 400.

Twisted's channel refuses more than `totalHeadersSize` bytes of request line
and headers, more than `maxHeaders` headers, or one line over `MAX_LENGTH`;
this mixin answers each with `431 Request Header Fields Too Large` and an
OpenAI-style body, then closes the connection. Nothing of the headers is
echoed (they may carry a key)."""

from __future__ import annotations

from typing import Any

from llmproxy.web.errors import error_body


def header_fields_too_large(message: str) -> bytes:
    """The whole 431 response, closing its connection."""
    body = error_body(431, message, "request_header_fields_too_large",
                      "invalid_request_error")
    head = ("HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class HeaderLimits:
    """Mixed into the HTTP channel, before `http.HTTPChannel`. It counts the
    head as Twisted counts it (the bytes of its lines without their line
    breaks, and its headers), to answer first."""

    totalHeadersSize: int
    maxHeaders: int
    transport: Any
    head_size = 0       # of the request line and headers so far
    head_count = 0      # headers so far
    _too_large = False

    def _refuse_headers(self, message: str) -> None:
        if not self._too_large:
            self._too_large = True
            self.transport.write(header_fields_too_large(message))
            self.transport.loseConnection()

    def lineReceived(self, line: bytes) -> None:
        if self._too_large:
            return
        if self.head_size + len(line) > self.totalHeadersSize:
            self._refuse_headers(f"request headers over {self.totalHeadersSize} bytes")
            return
        self.head_size += len(line)
        super().lineReceived(line)  # type: ignore[misc]

    def headerReceived(self, line: bytes) -> bool:
        if self.head_count + 1 > self.maxHeaders:
            self._refuse_headers(f"more than {self.maxHeaders} request headers")
            return False
        ok = bool(super().headerReceived(line))  # type: ignore[misc]
        if ok:
            self.head_count += 1
        return ok

    def allHeadersReceived(self) -> None:
        # The head is in: the next request's is counted from nothing.
        self.head_size = self.head_count = 0
        super().allHeadersReceived()  # type: ignore[misc]

    def lineLengthExceeded(self, line: bytes) -> None:
        self._refuse_headers("a request line or header over the line length limit")
