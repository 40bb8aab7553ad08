"""Reading and comparing what the differential tests' two paths gave
(tests/differential.py runs them): the client's replies, the requests the
engine received, the access events, each normalized where the paths differ
legitimately (each normalization says why), and the comparison itself.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

from llmproxy.core.events import RequestEnded
from tests.differential import Outcome


# -- reading what came out ----------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    """One response as the client read it: `body` de-chunked, `complete` when it
    reached its declared end (its last chunk, its Content-Length; a body
    delimited by the close is complete once the connection closed)."""

    code: int
    phrase: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    complete: bool


def dechunk(rest: bytes) -> tuple[bytes, bool, bytes]:
    """A chunked body's data, whether its last chunk and trailers came, and
    what follows it."""
    body, at = b"", 0
    while True:
        eol = rest.find(b"\r\n", at)
        if eol < 0:
            return body, False, b""
        try:
            size = int(rest[at:eol].split(b";")[0], 16)
        except ValueError:
            return body, False, b""
        if size == 0:
            end = rest.find(b"\r\n\r\n", eol)
            return (body, False, b"") if end < 0 else (body, True, rest[end + 4:])
        chunk = rest[eol + 2:eol + 2 + size]
        body += chunk
        if len(chunk) < size or rest[eol + 2 + size:eol + 4 + size] != b"\r\n":
            return body, False, b""
        at = eol + 4 + size


def replies(data: bytes) -> list[Reply]:
    """Every response in what a client received (the last one maybe cut
    short); bytes that are not a response end the list as code -1."""
    out: list[Reply] = []
    while data:
        head_end = data.find(b"\r\n\r\n")
        if not data.startswith(b"HTTP/1.") or head_end < 0:
            out.append(Reply(-1, b"", (), data, False))
            break
        status, *lines = data[:head_end].split(b"\r\n")
        _, code, phrase = [*status.split(b" ", 2), b""][:3]
        headers = tuple((n.strip(), v.strip()) for n, _, v in
                        (line.partition(b":") for line in lines))
        named = {n.lower(): v for n, v in headers}
        rest = data[head_end + 4:]
        if 100 <= int(code) < 200 or int(code) in (204, 304):
            body, complete, data = b"", True, rest
        elif named.get(b"transfer-encoding", b"").lower() == b"chunked":
            body, complete, data = dechunk(rest)
        elif b"content-length" in named:
            size = int(named[b"content-length"])
            body, complete, data = rest[:size], len(rest) >= size, rest[size:]
        else:
            body, complete, data = rest, True, b""
        out.append(Reply(int(code), phrase, headers, body, complete))
    return out


# -- what is compared ----------------------------------------------------------------
ID = re.compile(rb"[0-9a-f]{6}-[0-9]+")


def blank_id(value: bytes) -> bytes:
    """A request id (each proxy has its own random prefix), checked and blanked."""
    assert ID.fullmatch(value), f"not a request id: {value!r}"
    return b"<id>"


def upstream_failed(reply: Reply) -> bool:
    """The proxy's own 502 for an engine it could not read (its message quotes
    the engine client's exception)."""
    if reply.code != 502:
        return False
    try:
        error = json.loads(reply.body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return bool(error.get("code") == "upstream_failed" and
                error.get("message", "").startswith("upstream gpu1 failed: "))


def compared(received: bytes) -> list[Reply]:
    """The replies a client received, all of them compared: after the answer to a
    malformed request (which closes the connection) there is none, on either
    path (web/channel.py reads nothing more of a closing connection;
    test_differential_requests' test_a_malformed_request_is_answered_once)."""
    return replies(received)


def client_view(received: bytes) -> list[tuple[Any, ...]]:
    """The client's replies as they are compared: code, headers in order (Date
    dropped, X-Request-Id blanked), body de-chunked, complete or not; the
    proxy's own upstream_failed 502 with its message (and length) blanked."""
    out = []
    for reply in compared(received):
        headers = tuple((name, blank_id(value) if name.lower() == b"x-request-id" else value)
                        for name, value in reply.headers if name.lower() != b"date")
        body = reply.body
        if upstream_failed(reply):
            body = b"<upstream_failed>"
            headers = tuple((n, b"-" if n.lower() == b"content-length" else v)
                            for n, v in headers)
        out.append((reply.code, headers, body, reply.complete))
    return out


def ended_view(ended: list[RequestEnded]) -> list[tuple[Any, ...]]:
    """The access events as compared: in the order their requests arrived (by
    their ids; a request's end is published once its response is finished,
    which may be after the next pipelined request was answered, if that one
    was in already: a matter of timing, not of path), each with its status,
    outcome, bytes (not for the proxy's own upstream_failed 502, whose message
    differs), tokens, whether it was routed, whether it has a detail (whose
    words quote the engine client's exception)."""
    def arrival(event: RequestEnded) -> int:
        return int(event.request_id.rpartition("-")[2])

    return [(e.method, e.path, e.model, e.status, e.outcome,
             None if (e.status, e.outcome) == (502, "upstream-failed") else e.bytes,
             e.prompt_tokens, e.completion_tokens, e.routed, e.detail is None)
            for e in sorted(ended, key=arrival)]


_URI_ESCAPED = re.compile(rb"[^\x21-\x7e]|#")


def engine_view(raw: bytes) -> tuple[Any, ...]:
    """A request as the engine received it, as compared: the request line (its
    target percent-encoded as web.engineclient.request_target encodes it),
    Host and Content-Length by value, every other header in order (X-Request-Id
    blanked; Accept-Encoding: identity alone on both paths, web/treqlayers.py),
    and the body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    line, *lines = head.split(b"\r\n")
    method, target, version = line.split(b" ")
    target = _URI_ESCAPED.sub(lambda found: b"%%%02X" % found.group()[0], target)
    headers = [(name, value) for name, _, value in (h.partition(b": ") for h in lines)]
    assert [v for n, v in headers if n.lower() == b"accept-encoding"] == [b"identity"], headers
    framing: dict[bytes, list[tuple[bytes, bytes]]] = {b"host": [], b"content-length": []}
    rest = []
    for name, value in headers:
        if name.lower() in framing:
            framing[name.lower()].append((name, value))
        else:
            rest.append((name, blank_id(value) if name == b"X-Request-Id" else value))
    return (method, target, version, tuple(framing[b"host"]),
            tuple(framing[b"content-length"]), tuple(rest), body)


def phrases(out: Outcome) -> list[bytes]:
    return [reply.phrase for reply in compared(out.received)]


def answered(out: Outcome) -> list[RequestEnded]:
    """The access events compared: every one (a refused request is never
    dispatched after its 400: test_a_refused_request_is_not_dispatched)."""
    return out.ended


def views(reference: Outcome, fast: Outcome) -> tuple[Any, Any]:
    """Everything compared, for each path."""
    return tuple(  # type: ignore[return-value]
        (client_view(out.received), [engine_view(r) for r in out.engine],
         ended_view(answered(out)))
        for out in (reference, fast))


def assert_same(reference: Outcome, fast: Outcome) -> None:
    """Both paths gave the client, the engine and the access log the same
    (as `views` normalizes them); status phrases that differ are reported as
    a warning, not asserted (the engine's phrase is passed on as it came)."""
    expected, got = views(reference, fast)
    assert got == expected, (f"the paths differ:\n reference {reference.received[:800]!r}\n"
                             f" speedups  {fast.received[:800]!r}")
    if phrases(reference) != phrases(fast):
        warnings.warn(PhraseDiffers(f"reference {phrases(reference)!r} != "
                                    f"speedups {phrases(fast)!r}"), stacklevel=2)


class PhraseDiffers(UserWarning):
    """The status phrase differs between the paths (reported, not asserted)."""
