"""Requests refused before the door for what they are, not who sent them: a body
over `max_body_bytes`, a path with a dot segment, an HTTP/2 body that stalled."""

from __future__ import annotations

import re
from urllib.parse import unquote_to_bytes

from llmproxy.core.text import shown
from llmproxy.web.errors import write_error
from llmproxy.web.site import ProxyRequest

_SEGMENT_END = re.compile(rb"[/\\]")


def dotted(path: bytes) -> bool:
    """Whether `path` has a `.` or `..` segment, raw or once percent-decoded."""
    return any(segment in (b".", b"..")
               for segment in _SEGMENT_END.split(unquote_to_bytes(path)))


def refused_unread(request: ProxyRequest, path: str, max_body_bytes: int) -> bool:
    """Answer `request` (and say so) when it is refused before the door."""
    state = request.state
    if state.body_too_large:
        # Answered as soon as the body passed the limit; the channel reads
        # no more of it and closes (see channel.ProxyChannel.body_refused).
        request.setHeader(b"connection", b"close")
        write_error(request, 413, f"request body is larger than {max_body_bytes} bytes "
                    "(max_body_bytes)", "request_too_large")
    elif dotted(request.path):
        write_error(request, 400, f"{shown(path)}: a path with a '.' or '..' segment "
                    "(raw or percent-encoded) is never forwarded", "invalid_path")
    elif state.body_timeout is not None:
        # An HTTP/2 stream whose body stalled (web/streams.py).
        write_error(request, 408, f"request body not received within "
                    f"{state.body_timeout:g}s (client_body_timeout_seconds)",
                    "request_timeout")
    else:
        return False
    return True
