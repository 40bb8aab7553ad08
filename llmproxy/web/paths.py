"""The proxy's paths as one table: which paths exist, what kind of answer each
gets (web/routes.Root answers each kind), and which methods each takes: a 405's
`Allow` lists exactly those, HEAD wherever GET is answered in full.

The status page's files (observe/page) are read once, when the proxy starts
(`Page.load`): a SIGHUP reload keeps them, an upgrade's new process reads its own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from llmproxy.web.admin import ADMIN_PATHS
from llmproxy.web.hostlog import PATH as HOST_LOG_PATH

GET = ("GET", "HEAD")
# An endless event stream: a HEAD would hold its connection for as long.
STREAM = ("GET",)
POST = ("POST",)


class Kind(enum.Enum):
    """What answers a path."""

    PAGE = "page"           # the status page and its assets, from memory
    READ = "read"           # the probes, /status, /metrics and the model list
    ADMIN = "admin"         # actions, refused when another site's page may have sent them
    API = "api"             # forwarded to the engine serving its model
    EVENTS = "events"       # the event stream: not a request in flight
    HOST_LOG = "host log"   # an engine's log: not a request in flight


@dataclass(frozen=True)
class Route:
    """A path's kind of answer and the methods it takes."""

    kind: Kind
    methods: tuple[str, ...]

    @property
    def streamed(self) -> bool:
        """Answered outside the requests in flight (it never holds a drain)."""
        return self.kind in (Kind.EVENTS, Kind.HOST_LOG)


# llama-server's own routes outside /v1/ that carry a `model`: routed like /v1/*.
LLAMA_ROUTES = frozenset({"/rerank", "/tokenize", "/detokenize", "/infill", "/embedding"})
# The status page: path -> (file in observe/page, content type). No CDN, no build step.
PAGE_DIR = Path(__file__).resolve().parent.parent / "observe" / "page"
PAGE_FILES = {
    "/": ("index.html", b"text/html; charset=utf-8"),
    "/page/app.js": ("app.js", b"text/javascript; charset=utf-8"),
    "/page/style.css": ("style.css", b"text/css; charset=utf-8"),
}

EXACT: Mapping[str, Route] = {
    **{path: Route(Kind.PAGE, GET) for path in PAGE_FILES},
    **{path: Route(Kind.READ, GET)
       for path in ("/healthz", "/readyz", "/status", "/metrics", "/v1/models")},
    **{path: Route(Kind.ADMIN, POST)
       for path in ("/admin/reload", "/admin/upgrade", *ADMIN_PATHS)},
    "/api/events": Route(Kind.EVENTS, STREAM),
    **{path: Route(Kind.API, POST) for path in LLAMA_ROUTES},
}
# Looked at in order, when no exact path matches.
PREFIXES: tuple[tuple[str, Route], ...] = (
    ("/v1/models/", Route(Kind.READ, GET)),     # one model: /v1/models/<name>
    ("/v1/", Route(Kind.API, POST)),
)
HOST_LOG = Route(Kind.HOST_LOG, STREAM)         # /api/hosts/<name>/log


def route(path: str) -> Route | None:
    """The route of `path`; None for a path the proxy does not serve (404)."""
    found = EXACT.get(path)
    if found is not None:
        return found
    for prefix, prefixed in PREFIXES:
        if path.startswith(prefix):
            return prefixed
    return HOST_LOG if HOST_LOG_PATH.fullmatch(path) else None


@dataclass(frozen=True)
class Page:
    """The status page's files, in memory: path -> (body, content type)."""

    files: Mapping[str, tuple[bytes, bytes]]

    @classmethod
    def load(cls, directory: Path = PAGE_DIR) -> Page:
        """Read every file of PAGE_FILES from `directory` (once, at start-up)."""
        return cls({path: ((directory / name).read_bytes(), content_type)
                    for path, (name, content_type) in PAGE_FILES.items()})
