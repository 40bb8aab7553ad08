"""A request head that arrives whole in one read, parsed in one pass.

Twisted's HTTPChannel reads a head line by line (LineReceiver), each header
through several calls; on a small completion that was a fifth of the proxy's
own work between a request's arrival and its forwarding. A head that arrives in
one read (what a client sends, nearly always) and is plainly valid is parsed
here at once, into the state the line-by-line path leaves: the same request,
headers, length and body decoder, and the same calls after it
(`allHeadersReceived`, then `allContentReceived` or the body in raw mode). A
body that came whole in the same read, exactly as long as its Content-Length
says, goes to the request at once, as the decoder would pass it, without the
decoder and the channel's raw mode in between, and what Twisted's calls
after the head do with such a request (allHeadersReceived, the body,
allContentReceived, requestReceived) is done in one step (`_whole`; a target
with a query or a request that asks for form parsing still gets those calls).
`made_request` makes the request as Twisted's constructors would, in one call
(`new_request` checks once that they still do).

Anything else takes Twisted's path unchanged, which answers it as before: a
head split over reads, a request after a non-persistent one, a folded header,
an empty line before the request line, a limit crossed (431, headerlimits.py) or
anything malformed (400). This rests on HTTPChannel's internals as of Twisted
26.10, checked at import (without them every head goes Twisted's way);
tests/test_headfast.py feeds the same bytes both ways and compares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from twisted.protocols.basic import LineReceiver
from twisted.web.http import HTTPChannel
from twisted.web.http_headers import Headers, InvalidHeaderName, _nameEncoder
from twisted.web.iweb import INonQueuedRequestFactory
from twisted.web.server import Request

_R = TypeVar("_R", bound=Request)

# What this rests on in HTTPChannel; a Twisted without it gets its own path only.
_TWISTED_AS_KNOWN = all(hasattr(HTTPChannel, name) for name in (
    "_HTTPChannel__first_line", "_maybeChooseTransferDecoder", "_finishRequestBody"))

# What _whole does in their place, as they are in Twisted 26.10: the channel's
# allHeadersReceived and allContentReceived, and the request's requestReceived
# (a Twisted whose code differs gets them called, as before).
_WHOLE_AS_KNOWN = _TWISTED_AS_KNOWN and \
    HTTPChannel.allHeadersReceived.__code__.co_names == (
        "requests", "parseCookies", "checkPersistence", "_version", "persistent",
        "gotLength", "length", "requestHeaders", "getRawHeaders", "lower",
        "_send100Continue") and \
    HTTPChannel.allContentReceived.__code__.co_names == (
        "_command", "_path", "_version", "length", "_receivedHeaderCount",
        "_receivedHeaderSize", "_HTTPChannel__first_line", "_transferDecoder", "timeOut",
        "setTimeout", "_savedTimeOut", "_handlingRequest", "setRawMode", "requests",
        "requestReceived") and \
    Request.requestReceived.__code__.co_names == (
        "content", "tell", "seek", "args", "method", "uri", "clientproto", "split", "len",
        "path", "parse_qs", "requestHeaders", "getRawHeaders", "_parsePOSTFormSubmission",
        "_parseContentType", "update", "read", "_getMultiPartArgs", "_MultiPartParseException",
        "channel", "_respondToBadRequestAndDisconnect", "process")

# The names Headers has canonicalized so far (its own bounded cache), looked up
# before asking it: one call less per header.
_canonical = getattr(_nameEncoder, "_canonicalHeaderCache", {}).get

_LENGTH, _ENCODING = b"Content-Length", b"Transfer-Encoding"
_FRAMING = (_LENGTH, _ENCODING)


class _Head:
    """A parsed head: request line, headers as Headers keeps them, the one
    header that sets the body's length (if any), and the figures the limits
    count."""

    __slots__ = ("command", "count", "framing", "headers", "path", "size", "version")

    def __init__(self, command: bytes, path: bytes, version: bytes,
                 headers: dict[bytes, list[bytes]], framing: tuple[bytes, bytes] | None,
                 count: int, size: int) -> None:
        self.command, self.path, self.version = command, path, version
        self.headers, self.framing, self.count, self.size = headers, framing, count, size


def _framing(name: bytes, value: bytes) -> tuple[bytes, bytes] | bool | None:
    """What a Content-Length or Transfer-Encoding header does to the body: sets
    its framing (the header), nothing (identity, as Twisted ignores it: None), or
    makes the request bad (False)."""
    if name == _ENCODING:
        kind = value.lower()
        return None if kind == b"identity" else (name, value) if kind == b"chunked" else False
    return (name, value) if value.isdigit() else False


# The bytes Twisted's _parseRequestLine takes in a request target (33 to 176).
_TARGET_BYTES = bytes(range(33, 177))
_VERSIONS = frozenset({b"HTTP/1.1", b"HTTP/1.0"})


def request_line(line: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(method, target, version) of a plain request line, as Twisted's
    _parseRequestLine gives them, at C speed (it tests the target a byte at a
    time in Python); None for any line it does not take, or whose method is not
    letters alone (Twisted's path judges those)."""
    parts = line.split(b" ")
    if len(parts) != 3:
        return None
    method, target, version = parts
    if not method.isalpha() or not target or target.translate(None, _TARGET_BYTES) or \
            version not in _VERSIONS:
        return None
    return method, target, version


def parse_head(head: bytes, max_line: int, max_size: int, max_headers: int) -> _Head | None:
    """`head` (up to, not including, its blank line) parsed, or None when it is
    not plainly valid and within the limits (Twisted's path then answers it)."""
    lines = head.split(b"\r\n")
    size = len(head) - 2 * (len(lines) - 1)          # as Twisted counts: lines, no CRLFs
    first = lines[0]
    if size > max_size or len(lines) - 1 > max_headers or not first or len(first) > max_line:
        return None
    # No NUL, CR or LF within a line: the split took each line break's CR and
    # LF, so any other is a stray. Counted over the whole head at once (and
    # not with `in`: Python 3.11's `bytes in bytes` first tries its operand as
    # an integer, and raises and clears a TypeError on every test).
    breaks = len(lines) - 1
    if head.count(b"\r") != breaks or head.count(b"\n") != breaks or head.find(b"\x00") >= 0:
        return None
    parsed = request_line(first)
    if parsed is None:
        return None
    command, path, version = parsed
    headers: dict[bytes, list[bytes]] = {}
    framing: tuple[bytes, bytes] | None = None
    for line in lines[1:]:
        # Plain: not folded, a name, a colon; a name Headers takes (canonical,
        # as it stores it).
        name, colon, value = line.partition(b":")
        if not colon or len(line) > max_line or line[0] in b" \t":
            return None
        canonical = _canonical(name)
        if canonical is None:
            try:
                canonical = _nameEncoder.encode(name)
            except InvalidHeaderName:
                return None
        name, value = canonical, value.strip(b" \t")
        if name in _FRAMING:
            sets = _framing(name, value)
            if sets is False or (sets is not None and framing is not None):
                return None               # a bad one, or two: a 400
            if isinstance(sets, tuple):
                framing = sets
        values = headers.get(name)
        if values is None:
            headers[name] = [value]
        else:
            values.append(value)
    return _Head(command, path, version, headers, framing, len(lines) - 1, size)


def made_request(cls: type[_R], channel: Any) -> _R:
    """A `cls` (a twisted.web.server.Request that keeps its __init__) on
    `channel`, as Twisted's two __init__s (server.Request's, then http.Request's
    and Componentized's) make it, set at once: the same attributes, without
    three calls and the keyword juggling between them (tests/test_headfast.py
    compares the two)."""
    request = cls.__new__(cls)
    request.notifications = []
    request.channel = channel
    request.client = channel.getPeer()
    request.host = channel.getHost()
    request.requestHeaders = Headers()
    request.received_cookies = {}
    request.responseHeaders = Headers()
    request.cookies = []
    request.transport = channel.transport
    request.queued = False
    request._parsePOSTFormSubmission = channel.site._parsePOSTFormSubmission
    request._adapterCache = {}
    return request


_SAME_AS_TWISTEDS: dict[type, bool] = {}


def new_request(cls: type[_R], channel: Any) -> _R:
    """A `cls` on `channel`: made by `made_request` once the first one made both
    ways had the same attributes (a Twisted whose constructors set others gets
    its own way from then on)."""
    same = _SAME_AS_TWISTEDS.get(cls)
    if same:
        return made_request(cls, channel)
    request = cls(channel)
    if same is None:
        _SAME_AS_TWISTEDS[cls] = vars(made_request(cls, channel)).keys() == vars(request).keys()
    return request


class OneReadHead:
    """Mixed into the HTTP channel, before `http.HTTPChannel` (see the module)."""

    line_mode: int
    paused: bool
    persistent: int
    requests: list[Any]
    requestFactory: Any
    transport: Any
    length: int | None
    MAX_LENGTH: int
    totalHeadersSize: int
    maxHeaders: int
    _buffer: bytes
    _busyReceiving: bool
    _handlingRequest: bool
    _too_large: bool
    _HTTPChannel__first_line: int
    _command: bytes
    _path: bytes
    _version: bytes
    _receivedHeaderCount: int
    _receivedHeaderSize: int
    _dataBuffer: list[bytes]
    _transferDecoder: Any
    timeOut: Any
    checkPersistence: Callable[[Any, bytes], bool]

    def dataReceived(self, data: bytes) -> None:
        if _TWISTED_AS_KNOWN and self.line_mode and not self._buffer and \
                not self._busyReceiving and not self.paused and \
                not self._handlingRequest and self.persistent and \
                self._HTTPChannel__first_line == 1 and not self._too_large:
            end = data.find(b"\r\n\r\n")
            if end > 0:
                head = parse_head(data[:end], self.MAX_LENGTH, self.totalHeadersSize,
                                  self.maxHeaders)
                if head is not None:
                    self._take(head, data[end + 4:])
                    return
        self.bytes_arrived()
        super().dataReceived(data)  # type: ignore[misc]

    def allHeadersReceived(self) -> None:
        super().allHeadersReceived()  # type: ignore[misc]
        self.headers_received()

    def allContentReceived(self) -> None:
        self.content_received()
        super().allContentReceived()  # type: ignore[misc]

    def bytes_arrived(self) -> None:
        """A subclass's part when bytes arrive (a read), but for a read that is
        a whole request `_whole` takes: `request_in` says that."""

    def request_in(self) -> None:
        """A subclass's part when `_whole` takes a whole request (its head and
        body in one read), for what bytes_arrived, headers_received and
        content_received would say in turn."""

    def headers_received(self) -> None:
        """A subclass's part at the end of allHeadersReceived (_whole's too, for
        a body the request refused)."""

    def content_received(self) -> None:
        """A subclass's part at the start of allContentReceived."""

    def _new_request(self) -> Any:
        """A request for this channel, as HTTPChannel.lineReceived makes it."""
        if INonQueuedRequestFactory.providedBy(self.requestFactory):
            return self.requestFactory(self)
        return self.requestFactory(self, len(self.requests))

    def _take(self, head: _Head, rest: bytes) -> None:
        """What HTTPChannel.lineReceived does over the head's lines, at once; and
        when exactly the body its Content-Length says came with the head (what
        a client's small POST is), what the body decoder would do with it."""
        request = self._new_request()
        self.requests.append(request)
        self._HTTPChannel__first_line = 0
        self._command, self._path, self._version = head.command, head.path, head.version
        request.requestHeaders._rawHeaders = head.headers
        framing = head.framing
        whole = framing is not None and framing[0] == _LENGTH and len(rest) > 0 and \
            int(framing[1]) == len(rest) and b"Expect" not in head.headers
        if whole:
            self.length = len(rest)     # no decoder: the body is all here
        elif framing is not None:
            self._maybeChooseTransferDecoder(*framing)  # type: ignore[attr-defined]
        self._receivedHeaderCount = head.count
        self._receivedHeaderSize = head.size
        self._busyReceiving = True
        try:
            if whole and _WHOLE_AS_KNOWN and self._plain(request, head) and \
                    not (self.transport and self.transport.disconnecting):
                if self._whole(request, head, rest):
                    rest = b""
            else:
                self.bytes_arrived()
                self.allHeadersReceived()
                if self.length == 0:
                    self.allContentReceived()
                elif whole and not (self.transport and self.transport.disconnecting):
                    # What the identity decoder does with it: the body to the
                    # request, nothing left over after it, the request complete.
                    request.handleContentChunk(rest)
                    self._dataBuffer.append(b"")
                    self.allContentReceived()
                    rest = b""
                else:
                    self.setRawMode()  # type: ignore[attr-defined]
        finally:
            self._busyReceiving = False
        if (rest or self._buffer) and not (self.transport and self.transport.disconnecting):
            LineReceiver.dataReceived(self, rest)  # type: ignore[arg-type]

    def _plain(self, request: Any, head: _Head) -> bool:
        """Whether what Twisted does once a head is in comes, for this request, to
        what _whole does: its methods are Twisted's own, no timeout is set, the
        request asks for no form parsing and its target has no query."""
        cls = type(self)
        return cls.allHeadersReceived is OneReadHead.allHeadersReceived and \
            cls.allContentReceived is OneReadHead.allContentReceived and \
            type(request).requestReceived is Request.requestReceived and \
            not self.timeOut and not request._parsePOSTFormSubmission and \
            head.path.find(b"?") < 0

    def _whole(self, request: Any, head: _Head, body: bytes) -> bool:
        """A request whose whole body came with its head (no Expect): what
        allHeadersReceived, the identity decoder, allContentReceived and
        requestReceived do with it, in one step; False if the request's own
        gotLength refused the body (over its limit: it is answered without it,
        as Twisted's calls answer it)."""
        if b"Cookie" in head.headers:
            request.parseCookies()
        self.persistent = self.checkPersistence(request, head.version)
        take_body = getattr(request, "take_body", None)
        if take_body is None or not take_body(body):
            request.gotLength(len(body))
            if self.length == 0:
                self.bytes_arrived()
                self.headers_received()
                self.allContentReceived()
                return False
            request.handleContentChunk(body)
            request.content.seek(0, 0)
        self._dataBuffer.append(b"")
        # allContentReceived: the channel ready for the next request (it holds
        # what comes meanwhile until this one is done).
        self.request_in()
        self.length = 0
        self._receivedHeaderCount = self._receivedHeaderSize = 0
        self._HTTPChannel__first_line = 1
        self._transferDecoder = None
        del self._command, self._path, self._version
        self._handlingRequest = True
        self.line_mode = 0
        # requestReceived, for a target without a query and no form to parse.
        request.args = {}
        request.method, request.uri, request.clientproto = head.command, head.path, head.version
        request.path = head.path
        request.process()
        return True
