"""The path table (web/paths.py) through the real Site in memory, on the
reference path and with every speedup its guard allows: a method a path does
not take is a 405 whose `Allow` lists exactly the methods it does take (HEAD
wherever GET is answered in full); every method listed is answered, never
with a 405; the status page is served from memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h2.events
import pytest
from twisted.internet.task import Clock

from llmproxy.compat.goaway import GracefulH2Connection
from llmproxy.config import parse_config
from llmproxy.config.keys import parse_keys
from llmproxy.lifecycle.accessfiles import AccessFiles
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.speedups import select
from llmproxy.testing.fakes import Connection, FakeHTTPClient
from llmproxy.web.paths import EXACT, HOST_LOG, PAGE_DIR, PAGE_FILES, PREFIXES, route
from tests import test_h2_streams as h2_streams
from tests.selections import compat_entries

CONFIG = {"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}]}
MODES = {"reference": select({"LLMPROXY_SPEEDUPS": "0"}),
         "speedups": select({"LLMPROXY_SPEEDUPS": "1"})}
READ = "GET, HEAD"
# Every path the proxy serves (one of each prefix), and its Allow.
ALLOW = {
    "/": READ, "/page/app.js": READ, "/page/style.css": READ, "/page/tokens.js": READ,
    "/page/captures.js": READ, "/api/captures": READ, "/api/captures/abc-1": READ,
    "/page/sleep.js": READ, "/page/playground.js": READ, "/page/playground.css": READ,
    "/healthz": READ, "/readyz": READ, "/status": READ, "/metrics": READ,
    "/v1/models": READ, "/v1/models/some-model": READ,
    "/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/embeddings": "POST",
    "/v1/messages": "POST", "/v1/audio/transcriptions": "POST",
    "/rerank": "POST", "/tokenize": "POST", "/detokenize": "POST", "/infill": "POST",
    "/embedding": "POST",
    "/admin/reload": "POST", "/admin/upgrade": "POST", "/admin/cordon": "POST",
    "/admin/uncordon": "POST", "/admin/engine": "POST", "/admin/wake": "POST",
    "/admin/sleep": "POST",
    # Endless streams: a HEAD would hold the connection as long as a GET.
    "/api/events": "GET", "/api/hosts/gpu1/log": "GET",
}
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH")
# Answered for real when taken: not sent here (an upgrade would start one).
NOT_SENT = {("POST", "/admin/upgrade")}


def test_every_path_of_the_table_is_tested_here() -> None:
    """ALLOW names each exact path of the table and one path of each prefix."""
    assert set(EXACT) <= set(ALLOW)
    assert all(any(path.startswith(prefix) for path in ALLOW) for prefix, _ in PREFIXES)
    assert {route(path) for path in ALLOW} >= {*EXACT.values(), HOST_LOG}


def served(mode: str, files: AccessFiles | None = None) -> Connection:
    svc = build_service(ServiceInputs(parse_config(CONFIG), Clock(), http=FakeHTTPClient(),
                                      speedups=MODES[mode], access_files=files,
                                      compat=compat_entries()))
    # Loopback, as the admin paths need with keys off.
    return Connection(svc.site, client_ip="127.0.0.1")


def status_line(conn: Connection) -> bytes:
    return bytes(conn.transport.value()).partition(b"\r\n")[0]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("path", sorted(ALLOW))
def test_a_method_a_path_does_not_take_is_a_405_with_its_allow(mode: str, path: str) -> None:
    """Each method outside the path's Allow: 405, `Allow` exactly the methods
    it takes, a JSON error (no body for HEAD)."""
    allow = ALLOW[path]
    for method in METHODS:
        if method in allow.split(", "):
            continue
        conn = served(mode)
        conn.send(method, path)
        answer = conn.response()
        assert (method, answer.status, answer.headers.get("allow")) == (method, 405, allow)
        if method != "HEAD":
            error = answer.json()["error"]      # OpenAI's shape; Anthropic's on /v1/messages
            assert error.get("code", "method_not_allowed") == "method_not_allowed"
            assert error["message"] == f"{path} takes {allow.split(', ')[0]}"


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("path", sorted(ALLOW))
def test_every_method_a_path_lists_is_answered(mode: str, path: str) -> None:
    """Allow says no more than the path takes: each method it lists gets an
    answer other than 405 (or 500: a route without its handler), or no answer
    yet (a stream under way)."""
    for method in ALLOW[path].split(", "):
        if (method, path) in NOT_SENT:
            continue
        conn = served(mode)
        conn.send(method, path, b"{}" if method == "POST" else b"")
        line = status_line(conn)
        assert not line.startswith((b"HTTP/1.1 405", b"HTTP/1.1 500")), (method, path, line)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_event_stream_is_a_stream_on_get(mode: str) -> None:
    """GET /api/events starts an event stream (its Allow's one method is served)."""
    conn = served(mode)
    conn.send("GET", "/api/events")
    answer = conn.response()
    assert answer.status == 200 and answer.headers["content-type"] == "text/event-stream"


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("path", ["/nope", "/api/hosts/gpu1", "/api/hosts/gpu1/log/more",
                                  "/v1", "/admin/nope", "/page/other.js"])
def test_a_path_outside_the_table_is_a_404_whatever_the_method(mode: str, path: str) -> None:
    """No route: 404 not_found for every method (never a 405)."""
    for method in ("GET", "POST", "PUT"):
        conn = served(mode)
        conn.send(method, path)
        answer = conn.response()
        assert answer.status == 404 and answer.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_405_comes_after_the_door(mode: str) -> None:
    """With keys on, a request without one is refused (401) before its
    method is judged: the table does not tell a stranger what a path takes."""
    keys = parse_keys({"keys": [{"name": "a", "sha256": "0" * 64}]}, "keys.json")
    conn = served(mode, AccessFiles(keys=keys))
    conn.send("DELETE", "/v1/chat/completions")
    assert conn.response().status == 401


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_page_is_served_from_memory(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's files are read when the proxy starts, never per request:
    with the disk unreadable afterwards, each is still served whole."""
    expected = {path: (PAGE_DIR / name).read_bytes() for path, (name, _) in PAGE_FILES.items()}
    conns = {path: served(mode) for path in PAGE_FILES}

    def unreadable(self: Path) -> bytes:
        raise OSError(f"read {self} per request")

    monkeypatch.setattr(Path, "read_bytes", unreadable)
    for path, conn in conns.items():
        conn.send("GET", path)
        answer = conn.response()
        assert answer.status == 200 and answer.body == expected[path]


class H2Client(h2_streams.Client):
    """The HTTP/2 test client, keeping each stream's response headers."""

    def __init__(self, server: Any, clock: Clock) -> None:
        self.headers: dict[int, dict[bytes, bytes]] = {}
        super().__init__(server, clock)

    def _event(self, event: Any) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            self.headers[event.stream_id] = dict(event.headers)
        super()._event(event)

    def ask(self, method: str, path: str, headers: dict[str, str]) -> int:
        """A request without a body."""
        stream = int(self.h2.get_next_available_stream_id())
        self.h2.send_headers(stream, [(":method", method), (":path", path),
                                      (":scheme", "https"), (":authority", "127.0.0.1"),
                                      *headers.items()], end_stream=True)
        self.pump()
        return stream


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET, HEAD"),
    ("HEAD", "/api/events", "GET")])
def test_an_http2_request_is_routed_by_the_same_table(method: str, path: str,
                                                      allow: str) -> None:
    """An HTTP/2 stream's request (made by Twisted's H2Stream through the site's
    requestFactory) has its record too: it is in flight (its X-Request-Id), let
    in by the door, and its 405 carries the same Allow as on HTTP/1.1."""
    svc, _, _, clock = h2_streams.make()
    client = H2Client(GracefulH2Connection(clock, svc.site, svc.parts.hub.publish), clock)
    admin = {"authorization": f"Bearer {h2_streams.SECRETS['root']}"}
    stream = client.ask(method, path, admin)
    assert client.status[stream] == 405 and client.headers[stream]["allow"] == allow
    if path != "/api/events":       # the event stream is not a request in flight
        assert client.headers[stream]["x-request-id"]
