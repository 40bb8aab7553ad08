"""Request headers over the limits are a 431 (RFC 6585), not Twisted's bare 400;
a second Host header is a 400 (RFC 9112 section 3.2), which Twisted accepts.

Twisted's channel refuses more than `totalHeadersSize` bytes of request line
and headers, more than `maxHeaders` headers, or one line over `MAX_LENGTH`;
this mixin answers each with `431 Request Header Fields Too Large` and an
OpenAI-style body, then closes the connection. A request with two Host
headers is answered `400 Bad Request` the same way: its target would be
ambiguous (one part may route by one, another part by the other). Nothing of
the headers is echoed (they may carry a key)."""

from __future__ import annotations

from typing import Any

from llmproxy.web.errors import error_body, raw_error

TWO_HOSTS = raw_error(400, "Bad Request", "more than one Host header (RFC 9112 section 3.2)",
                      "bad_request")


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
    requests: list[Any]
    _head_refused = False   # answered: nothing more is read of this connection

    def _refuse_headers(self, message: str) -> None:
        self._refuse_head(header_fields_too_large(message))

    def _refuse_head(self, answer: bytes) -> None:
        if not self._head_refused:
            self._head_refused = True
            self.transport.write(answer)
            self.transport.loseConnection()

    def lineReceived(self, line: bytes) -> None:
        if self._head_refused:
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
            # A header name is a token (Twisted refused any other): "host:" starts
            # a Host header whatever its case, and only one.
            if line[:5].lower() == b"host:" and \
                    len(self.requests[-1].requestHeaders.getRawHeaders(b"host")) > 1:
                self._refuse_head(TWO_HOSTS)
                return False
        return ok

    def allHeadersReceived(self) -> None:
        # The head is in: the next request's is counted from nothing.
        self.head_size = self.head_count = 0
        super().allHeadersReceived()  # type: ignore[misc]

    def lineLengthExceeded(self, line: bytes) -> None:
        self._refuse_headers("a request line or header over the line length limit")
