"""`GET /api/hosts/{host}/log`: an engine's log as Server-Sent Events (`llmproxy logs`).

Query: ``engine=E`` (default: the host's running engine, else its only one), ``n=N`` the
last lines (default 50, at most 10,000), ``follow=1`` then the new lines as the engine
writes them. Each line is one ``event: log`` with ``data: {"host", "engine", "line"}``; a
line over MAX_LINE_CHARS is cut (and says by how much), and JSON carries no control
character raw. An agent that fails once the stream began sends one ``event: error``
(``{"host", "engine", "error"}``) and the stream ends; one that fails before any line came
(within HEAD_WAIT) gets a JSON error instead (502 ``agent_error``). A followed log that the
proxy's stop ends gets ``event: end`` (``{"host", "engine", "reason"}``) and a clean end.

A log stream is not a request in flight: it never holds a drain open. A client that leaves
ends the agent's session at once (hosts/enginelogs.py); one that stops reading is dropped
once MAX_QUEUED waits for it; at most MAX_STREAMS run at once. No CORS header is ever sent,
so another site's page cannot read a log even where it could send the request.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.web.server import Request

if TYPE_CHECKING:
    from llmproxy.web.site import ProxyRequest

from llmproxy.core.pausedsend import PausedSend
from llmproxy.core.text import shown
from llmproxy.hosts.enginelogs import DEFAULT_LINES, MAX_LINES, EngineLog, LogRefused
from llmproxy.hosts.fleet import Fleet
from llmproxy.web.cutoff import abort_client
from llmproxy.web.errors import write_error

PATH = re.compile(r"/api/hosts/([^/]+)/log")
MAX_LINE_CHARS = 4096
MAX_QUEUED = 4 << 20
MAX_STREAMS = 16
RETRY_AFTER = 5
HEAD_WAIT = 2.0          # a stream's head waits this long for its first line (or its end)
KEEPALIVE_SECONDS = 15.0
KEEPALIVE = b": keepalive\n\n"
# LogRefused.kind -> (status, error code)
REFUSALS = {"unknown_host": (404, "host_not_found"), "unknown_engine": (404, "engine_not_found"),
            "not_managed": (409, "host_not_managed"), "engine_needed": (400, "engine_needed"),
            "no_ssh": (409, "no_agent_session")}


def frame(kind: str, doc: dict[str, Any]) -> bytes:
    """One SSE message."""
    return f"event: {kind}\ndata: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()


def bounded(line: str) -> str:
    """A log line as relayed: at most MAX_LINE_CHARS, and a cut one says so."""
    if len(line) <= MAX_LINE_CHARS:
        return line
    return f"{line[:MAX_LINE_CHARS]} [cut: {len(line) - MAX_LINE_CHARS} more characters]"


class BadQuery(Exception):
    """A query parameter that cannot be used; str() names it."""


def _one(request: Request, name: str) -> str | None:
    values = (request.args or {}).get(name.encode(), [])
    if len(values) > 1:
        raise BadQuery(f"{name} is given {len(values)} times: give it once")
    return values[0].decode("utf-8", "replace") if values else None


def parse_query(request: Request) -> tuple[str | None, int, bool]:
    """(engine, lines, follow) from the query; BadQuery naming the parameter if one is bad."""
    engine = _one(request, "engine") or None
    text = _one(request, "n")
    lines = DEFAULT_LINES
    if text is not None:
        if not (text.isascii() and text.isdigit()) or int(text) > MAX_LINES:
            raise BadQuery(f"n must be a whole number from 0 to {MAX_LINES}, got {shown(text)}")
        lines = int(text)
    follow = _one(request, "follow")
    if follow not in (None, "", "0", "1", "true", "false"):
        raise BadQuery(f"follow must be 1 or 0, got {shown(follow)}")
    return engine, lines, follow in ("", "1", "true")


class HostLogs:
    """The log streams being served (see the module docstring)."""

    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock
        self.streams: set[LogStream] = set()

    def serve(self, request: ProxyRequest, fleet: Fleet, host: str) -> None:
        """Answer one log request (already let in by the door's rules)."""
        try:
            engine, lines, follow = parse_query(request)
        except BadQuery as e:
            write_error(request, 400, str(e), "invalid_parameter")
            return
        if len(self.streams) >= MAX_STREAMS:
            request.setHeader(b"retry-after", str(RETRY_AFTER).encode())
            write_error(request, 503, f"too many engine log streams: this proxy serves at most "
                        f"{MAX_STREAMS} at once; retry later", "too_many_log_streams")
            return
        stream = LogStream(request, host, follow, self)
        self.streams.add(stream)
        try:
            log = fleet.open_log(host, engine, lines, follow, stream.line)
        except LogRefused as e:
            self.streams.discard(stream)
            status, code = REFUSALS[e.kind]
            write_error(request, status, str(e), code, "invalid_request_error")
            return
        stream.began_reading(log)


class LogStream:
    """One client's log stream: its head once the first line (or the end) comes or after
    HEAD_WAIT; written while the client takes it, queued while it is paused, dropped past
    MAX_QUEUED (core/pausedsend.py); the agent's session ended when the client leaves. Over
    HTTP/1.1 and HTTP/2 alike: its timers are the clock's, its drop web/cutoff's."""

    def __init__(self, request: ProxyRequest, host: str, follow: bool, logs: HostLogs) -> None:
        self.request = request
        self.host = host
        self.follow = follow
        self.engine = ""
        self.begun = False
        self.gone = False
        self._logs = logs
        self._clock = logs.clock
        self._log: EngineLog | None = None
        self.sender = PausedSend(request.write, MAX_QUEUED, lambda: abort_client(request),
                                 lambda: self._lost(None))
        self._timer: IDelayedCall | None = None
        request.notifyFinish().addErrback(self._lost)

    def began_reading(self, log: EngineLog) -> None:
        self._log = log
        self.engine = log.engine
        log.ended.addCallback(self._ended)
        if not log.ended.called and not self.gone:
            self._timer = self._clock.callLater(HEAD_WAIT, self._begin)

    def line(self, engine: str, text: str) -> None:
        """One line of the log (the EngineLog's `on_line`)."""
        self.engine = self.engine or engine
        if not self.gone:
            self._send(frame("log", {"host": self.host, "engine": engine,
                                     "line": bounded(text)}))

    def _begin(self) -> None:
        """The head and the first bytes (a comment naming the log), and the keep-alives."""
        if self.begun or self.gone:
            return
        self._cancel_timer()          # the head's wait
        self.begun = True
        request = self.request
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        request.registerProducer(self.sender, True)
        request.write(f": engine {self.engine} on {self.host}\n\n".encode())
        if self.follow:
            self._timer = self._clock.callLater(KEEPALIVE_SECONDS, self._keepalive)

    def _keepalive(self) -> None:
        self._timer = None
        if not self.gone:
            self._send(KEEPALIVE)
            self._timer = self._clock.callLater(KEEPALIVE_SECONDS, self._keepalive)

    def _send(self, data: bytes) -> None:
        self._begin()
        self.sender.send(data)

    def _ended(self, reason: str | None) -> None:
        """The reading is over: a JSON error if nothing was sent yet, else a last event and
        a clean end."""
        self._cancel_timer()
        self._logs.streams.discard(self)
        if self.gone:
            return
        if reason is not None and not self.begun:
            write_error(self.request, 502, f"cannot read the log of engine {self.engine} on "
                        f"{self.host}: {reason}", "agent_error")
            return
        doc = {"host": self.host, "engine": self.engine}
        if reason is not None:
            self._send(frame("error", {**doc, "error": reason}))
        elif self._log is not None and self._log.shutdown:
            self._send(frame("end", {**doc, "reason": "the proxy is stopping"}))
        self._begin()
        self._cancel_timer()          # the keep-alive _begin may just have set
        self.sender.flush()
        self.request.unregisterProducer()
        self.request.finish()

    def _lost(self, reason: object) -> None:
        """The client left: the agent's session ends now."""
        if self.gone:
            return
        self.gone = True
        self._cancel_timer()
        self._logs.streams.discard(self)
        if self._log is not None:
            self._log.stop()

    def _cancel_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
