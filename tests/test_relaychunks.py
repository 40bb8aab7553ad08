"""The engine_client speedup's relay (speedups/relaychunks.py) next to the plain
one (web/relay.py): the headers that pass each way come out the same from both,
for any headers a parser hands on (canonical names, no CR or LF in values);
and which relay a selection of speedups runs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH

from llmproxy.speedups import REFERENCE, Selection
from llmproxy.speedups.relaychunks import (
    ChunkRelay,
    raw_request_headers,
    raw_response_headers,
    relay_class,
)
from llmproxy.web.relay import Relay, client_response_headers, upstream_request_headers

TOKEN = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12)
NAMES = st.one_of(TOKEN, st.sampled_from([
    "connection", "keep-alive", "host", "content-length", "x-forwarded-for", "te",
    "transfer-encoding", "content-type", "content-encoding", "upgrade", "x-request-id"]))
VALUE = st.binary(max_size=20).map(lambda v: v.replace(b"\r", b" ").replace(b"\n", b" "))
HEADERS = st.lists(st.tuples(NAMES, st.lists(st.one_of(VALUE, st.sampled_from(
    [b"close, x-secret", b"text/event-stream", b"", b"gzip", b"10.0.0.1"])),
    min_size=1, max_size=3)), max_size=8)


def _headers(pairs: list[tuple[str, list[bytes]]]) -> Headers:
    """Headers as a parser leaves them: canonical names, sanitized values."""
    headers = Headers()
    for name, values in pairs:
        headers.setRawHeaders(name.encode(), values)
    return headers


def _all(headers: Headers) -> list[tuple[bytes, list[bytes]]]:
    return [(name, list(values)) for name, values in headers.getAllRawHeaders()]


@given(HEADERS, st.sampled_from(["127.0.0.1", "::1"]), st.one_of(st.none(), TOKEN))
def test_request_headers_are_the_same_either_way(
        pairs: list[tuple[str, list[bytes]]], ip: str, request_id: str | None) -> None:
    """The headers sent upstream, in order: the raw-dict copy is the public one."""
    incoming = _headers(pairs)
    assert _all(raw_request_headers(incoming, ip, request_id)) == \
        _all(upstream_request_headers(incoming, ip, request_id))


@given(HEADERS, HEADERS, st.one_of(st.integers(0, 10**6), st.just(UNKNOWN_LENGTH)),
       st.booleans())
def test_response_headers_are_the_same_either_way(
        pairs: list[tuple[str, list[bytes]]], already: list[tuple[str, list[bytes]]],
        length: object, streaming: bool) -> None:
    """The client's response headers (on top of what it already had), in order:
    the raw-dict copy is the public one."""
    upstream = _headers(pairs)
    fast, plain = _headers(already), _headers(already)
    raw_response_headers(upstream, length, fast, streaming)
    client_response_headers(upstream, length, plain, streaming)
    assert _all(fast) == _all(plain)


def test_the_chunk_relay_runs_with_the_engine_client_only() -> None:
    """engine_client on: ChunkRelay (its engine connections hand it each
    read's data in one piece, which it frames itself); off, or on the
    reference path: the plain Relay."""
    assert relay_class(Selection(True, ("engine_client",))) is ChunkRelay
    assert relay_class(Selection(True, ("response_writes",))) is Relay
    assert relay_class(REFERENCE) is Relay
    assert Relay.request_headers is upstream_request_headers
    assert ChunkRelay.request_headers is raw_request_headers
