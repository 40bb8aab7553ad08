"""Multipart bodies routed by their `model` field (`/v1/audio/transcriptions`,
`/v1/audio/translations`).

The body is already in the request's file (Twisted keeps a large one on disk;
the site refused it past max_body_bytes). python-multipart's streaming parser
reads it in chunks and every part is written again, unchanged, to a spooled
temporary file, except the `model` field's value, whose place is remembered:
the upstream body is that file with the upstream model name spliced in,
streamed to the engine under backpressure by a `FileBodyProducer`. Nothing holds
the whole body in memory.

The fields the proxy reads (`model`, `stream`) must each come once: a form
that repeats one (as a field or a file part) is refused, since an engine that
reads the other one would serve what the proxy never routed or authorized.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import IO, Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import Cooperator
from twisted.web.client import FileBodyProducer
from twisted.web.iweb import IBodyProducer
from twisted.web.server import Request

from llmproxy.core.text import shown

READ_SIZE = 1 << 16
IN_MEMORY = 1 << 20         # past this, the rewritten body spills to disk
MAX_MODEL = 1024            # what the parser holds of a field it reads; a longer one is refused
READ = (b"model", b"stream")  # the fields the proxy reads: each may come once


def is_multipart(request: Request) -> bool:
    """Whether the request's body is multipart/form-data."""
    values = request.requestHeaders.getRawHeaders(b"Content-Type")   # as getHeader: the last
    ctype = values[-1] if values else b""
    return ctype.split(b";")[0].strip().lower() == b"multipart/form-data"


class FormError(Exception):
    """The body cannot be routed; `code` for the error answer."""

    def __init__(self, message: str, code: str = "invalid_multipart") -> None:
        super().__init__(message)
        self.code = code


class Form:
    """A multipart body without its model's value, and where that value goes."""

    def __init__(self, rest: IO[bytes], at: int, model: str, streaming: bool,
                 name: str | None = None) -> None:
        self._rest = rest          # every byte of the body except the model's value
        self._at = at              # where the model's value goes in it
        self.model = model         # the value the client sent
        self.streaming = streaming
        self._name = model if name is None else name

    @classmethod
    def read(cls, request: Request) -> Form:
        """Parse the request's body; FormError if it is not a usable form."""
        _, params = parse_options_header(request.getHeader(b"content-type") or b"")
        boundary = params.get(b"boundary")
        if not boundary:
            raise FormError("multipart/form-data without a boundary")
        writer = _Rewriter(boundary)
        parser = MultipartParser(boundary, writer.callbacks())  # type: ignore[arg-type]
        content = request.content
        if content is not None:
            content.seek(0)
            try:
                while chunk := content.read(READ_SIZE):
                    parser.write(chunk)
                parser.finalize()
            except MultipartParseError as e:
                raise FormError("request body is not valid multipart/form-data: "
                                f"{shown(str(e))}") from None
        return writer.form()

    def renamed(self, name: str) -> Form:
        """The same form naming `name` as its model (the upstream's name)."""
        return Form(self._rest, self._at, self.model, self.streaming, name)

    def producer(self, clock: IReactorTime) -> IBodyProducer:
        """A fresh producer of the whole body, paced by `clock`."""
        self._rest.seek(0, os.SEEK_END)
        size = self._rest.tell()
        value = io.BytesIO(self._name.encode("utf-8"))
        joined = _Joined([(self._rest, 0, self._at), (value, 0, len(value.getvalue())),
                          (self._rest, self._at, size - self._at)])
        cooperator = Cooperator(scheduler=lambda work: clock.callLater(0, work))
        return FileBodyProducer(joined, cooperator=cooperator, readSize=READ_SIZE)


class _Rewriter:
    """python-multipart callbacks that write each part again, minus the model's value."""

    def __init__(self, boundary: bytes) -> None:
        self._boundary = boundary
        # Lives as long as the request (closed when collected).
        self._out: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=IN_MEMORY)  # noqa: SIM115
        self._field = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._name: bytes | None = None
        self._value: bytearray | None = None   # the model's, or `stream`'s
        self._values: dict[bytes, bytes] = {}
        self._at: int | None = None

    def callbacks(self) -> dict[str, Any]:
        return {"on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_headers_finished": self._headers_done,
                "on_part_data": self._data, "on_part_end": self._end}

    def _begin(self) -> None:
        self._headers, self._name, self._value = [], None, None

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._headers.append((data[start:end], b""))

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        field, value = self._headers[-1]
        self._headers[-1] = (field, value + data[start:end])

    def _headers_done(self) -> None:
        out = self._out
        out.write(b"--" + self._boundary + b"\r\n")
        for field, value in self._headers:
            out.write(field + b": " + value + b"\r\n")
            if field.lower() == b"content-disposition":
                _, params = parse_options_header(value)
                self._name = params.get(b"name")
        out.write(b"\r\n")
        name = self._name
        if name is not None and name in READ:
            if name in self._values:
                raise FormError(f'the form has more than one "{name.decode()}" field',
                                "duplicate_field")
            self._value = bytearray()
            if name == b"model":
                self._at = out.tell()

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._value is None:
            self._out.write(data[start:end])
            return
        self._value += data[start:end]
        if len(self._value) > MAX_MODEL:
            raise MultipartParseError(f"the {self._name!r} field is over {MAX_MODEL} bytes")
        if self._name != b"model":
            self._out.write(data[start:end])

    def _end(self) -> None:
        if self._value is not None and self._name is not None:
            self._values[self._name] = bytes(self._value)
        self._out.write(b"\r\n")

    def form(self) -> Form:
        model = self._values.get(b"model", b"").decode("utf-8", "replace").strip()
        if self._at is None or not model:
            raise FormError('the form has no "model" field naming the model', "missing_model")
        self._out.write(b"--" + self._boundary + b"--\r\n")
        stream = self._values.get(b"stream", b"").strip().lower() == b"true"
        return Form(self._out, self._at, model, stream)


class _Joined(io.RawIOBase):
    """Read-only, seekable view of segments (file, offset, length) one after another."""

    def __init__(self, segments: list[tuple[IO[bytes], int, int]]) -> None:
        super().__init__()
        self._segments = segments
        self._size = sum(length for _, _, length in segments)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        want = self._size - self._pos if size is None or size < 0 else size
        out = bytearray()
        start = 0
        for f, offset, length in self._segments:
            if want <= 0:
                break
            if self._pos < start + length:
                skip = self._pos - start
                n = min(length - skip, want)
                f.seek(offset + skip)
                out += f.read(n)
                self._pos += n
                want -= n
            start += length
        return bytes(out)
