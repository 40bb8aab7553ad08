"""ChunkWatch's fast path (whole chunks with a bare size, one scan each) gives
exactly what its line-by-line path gives: the same answer to every read, the
same reason, the same state after it, for well-formed and malformed framing
alike, however the reads cut the same bytes."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from llmproxy.web.enginewatch import _CRLF, _DATA, ChunkWatch
from tests.test_engine_chunks import FAULTS


class LineByLine(ChunkWatch):
    """ChunkWatch with its fast path taken out: never past a chunk at once."""

    @staticmethod
    def _whole_chunks(data: bytes, pos: int) -> int:
        return pos


def chunk(data: bytes, size: int | None = None, digits: str = "{:x}") -> bytes:
    return digits.format(len(data) if size is None else size).encode() + b"\r\n" + data + b"\r\n"


DATA = st.binary(max_size=12) | st.sampled_from([b"data: {}\n\n", b"\r\n", b"\r\n0\r\n\r\n"])
PIECES = st.one_of(
    DATA.map(chunk),                                                    # whole chunks
    DATA.map(lambda d: chunk(d, digits="{:X}")),
    DATA.map(lambda d: chunk(d, digits="{:018x}")),                     # over 16 digits
    st.tuples(DATA, st.integers(0, 20)).map(lambda t: chunk(t[0], t[1])),   # size off
    DATA.map(lambda d: b"%x;a=b\r\n" % len(d) + d + b"\r\n"),          # an extension
    DATA.map(lambda d: b"%x\n" % len(d) + d + b"\r\n"),                # a bare LF
    DATA.map(lambda d: b"%x\r\n" % len(d) + d + b"\n"),                # data's end without CR
    st.sampled_from([b"0\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n", b"ffffffffffffffff\r\n",
                     b"10000000000000000\r\n", b" 5\r\n", b"5 \r\n", b"\r\n", b"\n", b"g\r\n",
                     *FAULTS.values()]),
    st.binary(max_size=6),
)


def observed(watch: ChunkWatch, data: bytes) -> tuple[Any, ...]:
    at, state = watch.feed(data), watch._state
    left = watch._left if state in (_DATA, _CRLF) else None     # (meaningless elsewhere)
    return at, watch.why, watch.done, state, left, bytes(watch._line)


def read_all(watch: ChunkWatch, body: bytes, cuts: list[int]) -> list[tuple[Any, ...]]:
    seen, start = [], 0
    for end in [*sorted(cuts), len(body)]:
        seen.append(observed(watch, body[start:end]))
        start = max(start, end)
        if seen[-1][0] >= 0:      # refused: the connection reads no more
            break
    return seen


@settings(max_examples=1500, deadline=None)
@given(pieces=st.lists(PIECES, max_size=12), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_the_fast_path_answers_every_read_as_the_line_by_line_path(
        pieces: list[bytes], cuts: list[int]) -> None:
    body = b"".join(pieces)
    assert read_all(ChunkWatch(), body, cuts) == read_all(LineByLine(), body, cuts), body


def test_every_cut_of_a_stream_of_events_and_of_each_fault() -> None:
    """An engine's stream of events, then its last chunk or a fault, cut once
    and twice at every byte: both paths answer alike."""
    events = b"".join(chunk(b"data: {\"n\": %d}\n\n" % n) for n in range(3))
    for tail in [b"0\r\n\r\n", *FAULTS.values()]:
        body = events + tail
        for one in range(len(body) + 1):
            for two in range(one, len(body) + 1, 7):
                assert read_all(ChunkWatch(), body, [one, two]) == \
                    read_all(LineByLine(), body, [one, two]), (body, one, two)
