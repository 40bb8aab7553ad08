"""The proxy's paths as one table: which paths exist, what kind of answer each
gets (web/routes.Root has a handler for each), and which methods each takes: a 405's
`Allow` lists exactly those, HEAD wherever GET is answered in full.

The status page's files (observe/page) are read once, when the proxy starts
(`Page.load`): a SIGHUP reload keeps them, an upgrade's new process reads its own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from twisted.web.iweb import IRequest

from llmproxy.web.admin import ADMIN_PATHS
from llmproxy.web.hostlog import PATH as HOST_LOG_PATH

GET = ("GET", "HEAD")
# An endless event stream: a HEAD would hold its connection for as long.
STREAM = ("GET",)
POST = ("POST",)


class Answer(enum.Enum):
    """What answers a path (web/routes.Root has one handler for each)."""

    PAGE = "the status page and its assets, from memory"
    HEALTH = "alive"
    READY = "ready"
    STATUS = "the status document"
    METRICS = "the metrics"
    MODELS = "the model list"
    MODEL = "one model of it"
    RELOAD = "a reload"
    UPGRADE = "an upgrade"
    ACTION = "an operator's action (web/admin.py)"
    API = "forwarded to the engine serving its model"
    EVENTS = "the event stream"
    HOST_LOG = "an engine's log"
    CAPTURES = "the captured requests (web/captures.py)"


# Outside the requests in flight: they never hold a drain.
STREAMED = frozenset({Answer.EVENTS, Answer.HOST_LOG})
# Refused before their 405 when another site's page may have sent them (web/admin.py).
ADMIN = frozenset({Answer.RELOAD, Answer.UPGRADE, Answer.ACTION})


@dataclass(frozen=True)
class Route:
    """What answers a path and the methods it takes."""

    answer: Answer
    methods: tuple[str, ...]

    @property
    def streamed(self) -> bool:
        return self.answer in STREAMED

    @property
    def admin(self) -> bool:
        return self.answer in ADMIN


# llama-server's own routes outside /v1/ that carry a `model`: routed like /v1/*.
LLAMA_ROUTES = frozenset({"/rerank", "/tokenize", "/detokenize", "/infill", "/embedding"})
# The status page: path -> (file in observe/page, content type). No CDN, no build step.
PAGE_DIR = Path(__file__).resolve().parent.parent / "observe" / "page"
PAGE_FILES = {
    "/": ("index.html", b"text/html; charset=utf-8"),
    "/page/app.js": ("app.js", b"text/javascript; charset=utf-8"),
    "/page/sleep.js": ("sleep.js", b"text/javascript; charset=utf-8"),
    "/page/tokens.js": ("tokens.js", b"text/javascript; charset=utf-8"),
    "/page/style.css": ("style.css", b"text/css; charset=utf-8"),
    "/page/captures.js": ("captures.js", b"text/javascript; charset=utf-8"),
    "/page/playground.js": ("playground.js", b"text/javascript; charset=utf-8"),
    "/page/playground.css": ("playground.css", b"text/css; charset=utf-8"),
}

EXACT: Mapping[str, Route] = {
    **{path: Route(Answer.PAGE, GET) for path in PAGE_FILES},
    "/healthz": Route(Answer.HEALTH, GET),
    "/readyz": Route(Answer.READY, GET),
    "/status": Route(Answer.STATUS, GET),
    "/metrics": Route(Answer.METRICS, GET),
    "/v1/models": Route(Answer.MODELS, GET),
    "/admin/reload": Route(Answer.RELOAD, POST),
    "/admin/upgrade": Route(Answer.UPGRADE, POST),
    **{path: Route(Answer.ACTION, POST) for path in ADMIN_PATHS},
    "/api/events": Route(Answer.EVENTS, STREAM),
    "/api/captures": Route(Answer.CAPTURES, GET),
    **{path: Route(Answer.API, POST) for path in LLAMA_ROUTES},
}
# Looked at in order, when no exact path matches.
PREFIXES: tuple[tuple[str, Route], ...] = (
    ("/v1/models/", Route(Answer.MODEL, GET)),      # /v1/models/<name>
    ("/api/captures/", Route(Answer.CAPTURES, GET)),    # /api/captures/<id>
    ("/v1/", Route(Answer.API, POST)),
)
HOST_LOG = Route(Answer.HOST_LOG, STREAM)           # /api/hosts/<name>/log


def route(path: str) -> Route | None:
    """The route of `path`; None for a path the proxy does not serve (404)."""
    found = EXACT.get(path)
    if found is not None:
        return found
    for prefix, prefixed in PREFIXES:
        if path.startswith(prefix):
            return prefixed
    return HOST_LOG if HOST_LOG_PATH.fullmatch(path) else None


# Sent with the page and its assets: scripts and styles from the proxy's own
# files only (no inline code), data and the event stream from the proxy only,
# never shown inside another site's frame, never sniffed as another type.
PAGE_HEADERS = {
    b"content-security-policy": b"default-src 'none'; script-src 'self'; style-src 'self'; "
                                b"img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                                b"form-action 'none'; frame-ancestors 'none'",
    b"x-content-type-options": b"nosniff",
    b"x-frame-options": b"DENY",
}


@dataclass(frozen=True)
class Page:
    """The status page's files, in memory: path -> (body, content type)."""

    files: Mapping[str, tuple[bytes, bytes]]

    def serve(self, request: IRequest, path: str) -> None:
        """Answer `request` with the file of `path` (one of PAGE_FILES)."""
        body, content_type = self.files[path]
        request.setHeader(b"content-type", content_type)
        request.setHeader(b"cache-control", b"no-cache")
        for header, value in PAGE_HEADERS.items():
            request.setHeader(header, value)
        request.write(body)
        request.finish()

    @classmethod
    def load(cls, directory: Path = PAGE_DIR) -> Page:
        """Read every file of PAGE_FILES from `directory` (once, at start-up)."""
        return cls({path: ((directory / name).read_bytes(), content_type)
                    for path, (name, content_type) in PAGE_FILES.items()})
