"""Property tests of the two small parsers that keep client input bounded:
`core.text.shown` (what a client chose, as events, log lines and error bodies
show it) and `web.bodylimit.ChunkSizes` (a chunked body's declared sizes,
watched before Twisted's decoder reads them), the latter against Twisted's own
chunked decoder."""

from __future__ import annotations

import itertools
import re
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st
from twisted.web.http import _ChunkedTransferDecoder

from llmproxy.core.text import MARKER, shown
from llmproxy.web.bodylimit import MAX_SIZE_LINE, ChunkSizes, chunk_size

MiB = 1 << 20


def unescape(text: str) -> str:
    """What `shown` escaped, read back."""
    return re.sub(r"\\(\\|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})",
                  lambda m: "\\" if m[1] == "\\" else chr(int(m[1][1:], 16)), text)


# -- shown ------------------------------------------------------------------------
@given(st.text(), st.integers(min_value=1, max_value=300))
@example("a\nb\r\x85\u2028\u2029\x00\ud800\\", 5)
@example("x" * 1000, 256)
def test_shown_is_bounded_one_line_and_reads_back(value: str, limit: int) -> None:
    """For any string: no unprintable character (so no line break of any kind),
    UTF-8-encodable, at most `limit` characters plus the marker; uncut, it
    reads back as the value; cut, as a prefix of it."""
    out = shown(value, limit)
    assert out.isprintable() and len(out.splitlines()) <= 1
    out.encode("utf-8")
    assert len(out) <= limit + len(MARKER)
    if out.endswith(MARKER) and out != value:
        assert value.startswith(unescape(out[:-len(MARKER)]))
        assert len(unescape(out[:-len(MARKER)])) < len(value)
    else:
        assert unescape(out) == value


def test_shown_reads_a_prefix_only() -> None:
    """A 100 MB string is shown from its first characters (no copy of it all)."""
    huge = "\n" * (100 * MiB)
    assert shown(huge, 8) == "\\x0a\\x0a" + MARKER


# -- ChunkSizes ----------------------------------------------------------------------
@st.composite
def chunked_bodies(draw: Any) -> tuple[bytes, list[int], list[int]]:
    """A valid chunked body (sizes as hex of either case, with leading zeros
    and extensions; data that looks like size lines; trailers; the start of a
    next request after it), its chunk sizes, and where each size line's LF is."""
    sizes = draw(st.lists(st.integers(min_value=1, max_value=300), max_size=8))
    body, ends = b"", []
    for size in sizes:
        digits = draw(st.sampled_from(["{:x}", "{:X}", "00{:x}"])).format(size).encode()
        ext = draw(st.sampled_from([b"", b";a=b", b";name", b';q="x y"']))
        body += digits + ext + b"\r"
        ends.append(len(body))
        body += b"\n" + draw(st.one_of(
            st.binary(min_size=size, max_size=size),
            st.just((b"\r\nfffffff\r\n" * size)[:size]))) + b"\r\n"
    body += b"0\r\n" + b"".join(draw(st.lists(st.sampled_from([b"X-T: 1\r\n", b"A: b\r\n"]),
                                               max_size=2))) + b"\r\n"
    return body, sizes, ends


def pieces_of(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` split at `cuts` (positions, any order, repeats allowed)."""
    at = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(at)] or [b""]


@given(chunked_bodies(), st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
       st.integers(min_value=0, max_value=2500))
def test_chunk_sizes_refuses_exactly_where_a_declared_size_crosses_the_limit(
        made: tuple[bytes, list[int], list[int]], cuts: list[int], limit: int) -> None:
    """Fed a valid chunked body (and a next request's start after it) in any
    pieces, beside Twisted's decoder: within the limit it never refuses and
    counts what the decoder delivers; past it, it refuses at the piece holding
    the LF of the size line that crosses the limit, and the decoder, fed the
    pieces before, has delivered no byte past the limit."""
    body, sizes, ends = made
    pieces = pieces_of(body + b"POST / HTTP/1.1\r\n", cuts)
    scanner = ChunkSizes(limit)
    delivered: list[bytes] = []
    finished: list[bytes] = []
    decoder = _ChunkedTransferDecoder(delivered.append, finished.append)
    refused_at, start = None, 0
    for i, piece in enumerate(pieces):
        if not scanner.fits(piece):
            refused_at = i
            break
        if not finished:
            decoder.dataReceived(piece)
        start += len(piece)
    if sum(sizes) <= limit:
        assert refused_at is None and finished and scanner.done
        assert scanner.declared == sum(map(len, delivered)) == sum(sizes)
        return
    crossing = next(k for k in range(len(sizes)) if sum(sizes[:k + 1]) > limit)
    assert refused_at is not None
    assert start <= ends[crossing] < start + len(pieces[refused_at])
    assert sum(map(len, delivered)) <= limit and not finished


@given(st.binary(max_size=5000), st.lists(st.integers(min_value=0, max_value=5000),
                                          max_size=10))
@example(b"f" * 5000, [])
@example(b"1\r\nx\r\n" + b"9" * 2000, [1000])
def test_chunk_sizes_holds_one_size_line_at_most_whatever_it_is_fed(
        data: bytes, cuts: list[int]) -> None:
    """Any bytes, in any pieces: it never raises, and holds at most one size
    line (Twisted's bound) however long a line it is sent."""
    scanner = ChunkSizes(1000)
    for piece in pieces_of(data, cuts):
        scanner.fits(piece)
        assert len(scanner._line) <= MAX_SIZE_LINE + 1


def test_a_size_line_is_read_as_twisted_reads_it() -> None:
    """Hex digits of either case before any extension; nothing else is a size."""
    assert not ChunkSizes(10).fits(b"0" * (MAX_SIZE_LINE - 2) + b"b\r\n")     # 1023 bytes: read
    assert ChunkSizes(10).fits(b"0" * (MAX_SIZE_LINE - 1) + b"b\r\n")         # 1024: Twisted's 400
    assert [chunk_size(line) for line in (
        b"1f\r\n", b"00A;x=y\r\n", b"0\r\n", b"\r\n", b"+1\r\n", b"1 \r\n", b"0x1\r\n",
        b"1\n")] == [31, 10, 0, None, None, None, None, None]
