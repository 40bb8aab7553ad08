"""The request_head speedup: a request head that arrives whole in one read,
parsed in one pass and handed over in one step.

Twisted's HTTPChannel reads a head line by line (LineReceiver), each header
through several calls. A head that arrives in one read (what a client sends,
nearly always) and is plainly valid is parsed at once (headparser.py), into
the state the line-by-line path leaves: the same request, headers, length and
body decoder, and the same calls after it (`allHeadersReceived`, then
`allContentReceived` or the body in raw mode). A body that came whole in the
same read, exactly as long as its Content-Length says, goes to the request at
once, as the decoder would pass it, and what Twisted's calls after the head do
with such a request (allHeadersReceived, the body, allContentReceived,
requestReceived) is done in one step (`_whole`; a target with a query or a
request that asks for form parsing still gets those calls). The request is
made as Twisted's constructors make it, in one call (`made_request`; checked
once per class by `new_request`), and processed as Twisted's
`Request.process` processes it (`HeadRequest.serve`).

Anything else takes Twisted's path unchanged, which answers it as before: a
head split over reads, a request after a non-persistent one, a folded header,
an empty line before the request line, a limit crossed (431,
web/headerlimits.py), a second Host header or anything malformed (400). A
chunked body goes to raw mode as on Twisted's path, where the channel's body
limit (web/bodylimit.py) reads its size lines before the decoder does. This follows Twisted 26.10;
the guard compares the source of every Twisted function it copies or whose
effect it reproduces (SOURCES), and tests/test_headfast.py feeds the same
bytes both ways and compares.
"""

from __future__ import annotations

from io import BytesIO
from typing import Any, TypeVar
from urllib.parse import unquote_to_bytes as unquote

from twisted.protocols.basic import LineReceiver
from twisted.python.failure import Failure
from twisted.web import resource as web_resource
from twisted.web.http import datetimeToString
from twisted.web.http_headers import Headers
from twisted.web.iweb import INonQueuedRequestFactory
from twisted.web.server import Request
from twisted.web.server import version as server_version

from llmproxy.speedups import Speedup
from llmproxy.speedups.guards import changed_sources
from llmproxy.speedups.headparser import LENGTH, Head, parse_head
from llmproxy.web.site import ProxyChannel, ProxyRequest, ProxySite

_R = TypeVar("_R", bound=Request)

# What this copies, or does in place of, as Twisted 26.10 has it.
SOURCES = {
    # The channel's reading and parsing of a head (dataReceived, _take, headparser).
    "twisted.protocols.basic.LineReceiver.dataReceived": "6f773dd6b423a279",
    "twisted.web.http.HTTPChannel.__init__": "3c799fc1cbf9818b",
    "twisted.web.http.HTTPChannel.lineReceived": "b77ec6f21116e827",
    "twisted.web.http.HTTPChannel.headerReceived": "c5cb8e0dd2fe0b44",
    "twisted.web.http.HTTPChannel._maybeChooseTransferDecoder": "3b92d266a3c7bd2c",
    "twisted.web.http._parseRequestLine": "68e108b4b5825cac",
    "twisted.web.http_headers._NameEncoder": "bc4cb5fc115811cd",
    "twisted.web.http_headers.Headers.__init__": "0cfb7db0d329777e",
    "twisted.web.http_headers.Headers.getRawHeaders": "72248d917adfe3b6",
    # A whole body and what follows it (_take, _whole).
    "twisted.web.http._IdentityTransferDecoder.dataReceived": "177b7cf3be44dbf4",
    "twisted.web.http.HTTPChannel._finishRequestBody": "42d008b78aff699a",
    "twisted.web.http.HTTPChannel.allHeadersReceived": "979a9a8410f41ad9",
    "twisted.web.http.HTTPChannel.allContentReceived": "9f7c990696871a92",
    "twisted.web.http.HTTPChannel.checkPersistence": "3f0cb5b5a40e1109",
    "twisted.web.http.Request.requestReceived": "99ca6c5e24305de4",
    # The request: made (made_request), its body taken (take_body), processed (serve).
    "twisted.web.http.Request.__init__": "2d3f7dbd28d0ce02",
    "twisted.web.server.Request.__init__": "f79aac5ec350503e",
    "twisted.python.components.Componentized.__init__": "31cb3de9ee79eae2",
    "twisted.web.http.Request.gotLength": "1c389b99da50b0ae",
    "twisted.web.http.Request.handleContentChunk": "6e942756afb787b4",
    "twisted.web.http._getContentFile": "79881ec06e895b14",
    "twisted.web.server.Request.gotLength": "b3489674dd1fb878",
    "twisted.web.server.Request.process": "f75c1431d226a229",
    "twisted.web.server.Site.getResourceFor": "2792b72c98f59ce2",
}
IN_MEMORY = 100_000   # a body shorter than this is kept in memory (Twisted's _getContentFile)


def guard() -> str | None:
    """None when the installed Twisted's request parsing is the one this
    follows (Twisted 26.10)."""
    return changed_sources(SOURCES)


SPEEDUP = Speedup(
    "request_head", "a request head (and a body that came with it) in one read is "
    "parsed and handed to the resource in one pass", guard)


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
    ways had the same attributes (a class whose constructors set others gets
    its own way from then on)."""
    same = _SAME_AS_TWISTEDS.get(cls)
    if same:
        return made_request(cls, channel)
    request = cls(channel)
    if same is None:
        _SAME_AS_TWISTEDS[cls] = vars(made_request(cls, channel)).keys() == vars(request).keys()
    return request


class HeadRequest(ProxyRequest):
    """The request: its body taken in one step, and processed as Twisted's
    Request.process does, with fewer calls."""

    def take_body(self, body: bytes) -> bool:
        """`body`, which came whole with the head, as the request's content in
        one step (what gotLength, handleContentChunk and the seek before
        process() make of it), when it is within the limit and kept in memory;
        False, nothing done, for any other (those steps take it)."""
        size = len(body)
        if size >= IN_MEMORY or size > self.body_limit():
            return False
        self._received = size
        self.content = BytesIO(body)
        return True

    def serve(self) -> None:
        """twisted.web.server.Request.process (26.10), with its Server and Date
        headers stored as they are (setHeader costs an encode and a sanitize
        per header, every request), the site's Date (ProxyRequest.render's:
        Twisted's for `*`, which is not rendered), and the path unquoted only
        when it has something to unquote. On an HTTP/2 stream (not a
        HeadChannel's request) it steps aside: Twisted's own process()."""
        if not isinstance(self.channel, HeadChannel):
            super().serve()
            return
        site = self.site = self.channel.site
        path = self.path
        raw = self.responseHeaders._rawHeaders
        raw[b"Server"] = [server_version]
        # Twisted's own Date for `*`, which is answered without a render.
        raw[b"Date"] = [site.date() if isinstance(site, ProxySite) and path != b"*"
                        else datetimeToString()]
        self.prepath = []
        segments = path[1:].split(b"/")
        self.postpath = [unquote(s) for s in segments] if path.find(b"%") >= 0 else segments
        if path == b"*":
            self._handleStar()
            return
        try:
            root = site.resource
            if root.isLeaf:            # getResourceFor, for a root that takes every path
                self.sitepath = self.prepath[:]
                resrc = root
            else:
                resrc = site.getResourceFor(self)
            if web_resource._IEncodingResource.providedBy(resrc):
                encoder = resrc.getEncoder(self)
                if encoder is not None:
                    self._encoder = encoder
            Request.render(self, resrc)     # the Date is set: ProxyRequest.render's part
        except BaseException:
            self.processingFailed(Failure())


class HeadChannel(ProxyChannel):
    """The channel: a head that arrives whole in one read parsed at once (see
    the module)."""

    def dataReceived(self, data: bytes) -> None:
        if self.line_mode and not self._buffer and not self._busyReceiving and \
                not self.paused and not self._handlingRequest and self.persistent and \
                self._HTTPChannel__first_line == 1 and not self._head_refused and \
                not self.timeOut:
            end = data.find(b"\r\n\r\n")
            if end > 0:
                head = parse_head(data[:end], self.MAX_LENGTH, self.totalHeadersSize,
                                  self.maxHeaders)
                if head is not None:
                    self._take(head, data[end + 4:])
                    return
        super().dataReceived(data)

    def checkPersistence(self, request: Any, version: bytes) -> bool:
        if version == b"HTTP/1.1" and not self.site.closing and \
                b"Connection" not in request.requestHeaders._rawHeaders:
            return True             # Twisted's answer, without its look for the header
        return super().checkPersistence(request, version)

    def _new_request(self) -> Any:
        """A request for this channel, as HTTPChannel.lineReceived makes it."""
        factory: Any = self.requestFactory
        if isinstance(factory, type) and issubclass(factory, ProxyRequest) and \
                factory.__init__ is Request.__init__:
            return new_request(factory, self)
        if INonQueuedRequestFactory.providedBy(factory):
            return factory(self)
        return factory(self, len(self.requests))

    def _take(self, head: Head, rest: bytes) -> None:
        """What HTTPChannel.lineReceived does over the head's lines, at once; and
        when exactly the body its Content-Length says came with the head (what
        a client's small POST is), what the body decoder would do with it."""
        request = self._new_request()
        self.requests.append(request)
        self._HTTPChannel__first_line = 0
        self._command, self._path, self._version = head.command, head.path, head.version
        request.requestHeaders._rawHeaders = head.headers
        framing = head.framing
        whole = framing is not None and framing[0] == LENGTH and len(rest) > 0 and \
            int(framing[1]) == len(rest) and b"Expect" not in head.headers
        if whole:
            self.length = len(rest)     # no decoder: the body is all here
        elif framing is not None:
            self._maybeChooseTransferDecoder(*framing)
        self._receivedHeaderCount = head.count
        self._receivedHeaderSize = head.size
        self._busyReceiving = True
        try:
            if whole and self._plain(request, head) and \
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
                    self.setRawMode()
        finally:
            self._busyReceiving = False
        if (rest or self._buffer) and not (self.transport and self.transport.disconnecting):
            LineReceiver.dataReceived(self, rest)

    def _plain(self, request: Any, head: Head) -> bool:
        """Whether what Twisted does once a head is in comes, for this request, to
        what _whole does: the channel's methods are ProxyChannel's, the request's
        requestReceived Twisted's, the request asks for no form parsing and its
        target has no query."""
        cls = type(self)
        return cls.allHeadersReceived is ProxyChannel.allHeadersReceived and \
            cls.allContentReceived is ProxyChannel.allContentReceived and \
            type(request).requestReceived is Request.requestReceived and \
            not request._parsePOSTFormSubmission and head.path.find(b"?") < 0

    def _whole(self, request: Any, head: Head, body: bytes) -> bool:
        """A request whose whole body came with its head (no Expect): what
        allHeadersReceived, the identity decoder, allContentReceived and
        requestReceived do with it, in one step; False if the request's own
        gotLength refused the body (over its limit: it is answered without it,
        as Twisted's calls answer it)."""
        self.head_size = self.head_count = 0        # HeaderLimits.allHeadersReceived's
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
