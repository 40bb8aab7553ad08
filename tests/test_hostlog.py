"""`GET /api/hosts/{host}/log` in memory: the real Site and Root (task.Clock), the real
EngineLog over a fake agent stream. The status codes of every refusal, the SSE events,
a line cut at 4 KiB, the head held until the first line, an agent error before and after
the stream began, a client that leaves ending the agent's session, a stalled reader
dropped, and the proxy's stop ending a followed log cleanly; and `llmproxy logs`' SSE
reading and exit statuses against a stand-in."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorCore
from twisted.internet.task import Clock
from zope.interface import implementer

from llmproxy.agent import logs as agent_logs
from llmproxy.agent.protocol import AgentEvent, LogLine, decode
from llmproxy.cli import main
from llmproxy.cli.logs import events, log_url
from llmproxy.config import HostConfig, parse_config
from llmproxy.hosts.agentstream import StreamEnded
from llmproxy.hosts.enginelogs import MAX_LINES, EngineLog, LogRefused, log_engine
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.agentfakes import FakeAgentTransport
from llmproxy.testing.fakes import Connection, FakeHTTPClient, parse_response
from llmproxy.web import hostlog


class FakeStream:
    """An AgentStream stand-in: the test plays the agent."""

    def __init__(self, host: HostConfig, order: dict[str, Any],
                 on_event: Callable[[AgentEvent], None]) -> None:
        self.order = order
        self.on_event = on_event
        self.ended: Deferred[StreamEnded] = Deferred()
        self.stopped = self.killed = False

    def stop(self) -> None:
        self.stopped = True

    def kill(self) -> None:
        self.killed = True

    def line(self, text: str, engine: str = "big") -> None:
        self.on_event(LogLine(text, engine))

    def end(self, why: str = "exit status 0") -> None:
        self.ended.callback(StreamEnded(f"agent on gpu2: {why}"))


@implementer(IReactorCore)
class Triggers:
    """The system event triggers of a reactor, fired by the test."""

    def __init__(self) -> None:
        self.before_shutdown: dict[int, Callable[[], object]] = {}

    def addSystemEventTrigger(self, phase: str, event: str, f: Callable[[], object]) -> int:
        assert (phase, event) == ("before", "shutdown")
        self.before_shutdown[id(f)] = f
        return id(f)

    def removeSystemEventTrigger(self, trigger: int) -> None:
        del self.before_shutdown[trigger]

    def shutdown(self) -> None:
        for f in list(self.before_shutdown.values()):
            f()


CONFIG = {
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"},
              {"name": "gpu2", "url": "http://10.0.0.6:8081", "ssh": "llm@10.0.0.6",
               "engines": {"big": {"command": ["llama-server"]},
                           "small": {"command": ["llama-server"]}}}],
    "models": {"qwen": {"host": "gpu1"}, "big": {"host": "gpu2", "engine": "big"},
               "small": {"host": "gpu2", "engine": "small"}},
    "server_names": ["proxy"],       # the Host the in-memory client names
}


class Proxy:
    """A service whose fleet reads logs through FakeStreams."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any] = CONFIG,
                 triggers: Triggers | None = None) -> None:
        self.clock = Clock()
        self.svc: LLMProxyService = build_service(ServiceInputs(
            parse_config(config), self.clock, http=FakeHTTPClient(), agent=FakeAgentTransport()))
        self.streams: list[FakeStream] = []
        fleet = self.svc.fleet

        def open_stream(host: HostConfig, order: dict[str, Any],
                        on_event: Callable[[dict[str, Any]], None]) -> Any:
            self.streams.append(FakeStream(host, order, on_event))
            return self.streams[-1]

        def open_log(host: str, engine: str | None, lines: int, follow: bool,
                     on_line: Callable[[str, str], None]) -> EngineLog:
            name = log_engine(host, host in fleet.gates, fleet.managers.get(host), engine)
            return EngineLog(fleet.managers[host].host, name, lines, follow, on_line,
                             open_stream, triggers)

        monkeypatch.setattr(fleet, "open_log", open_log)

    def get(self, path: str, client: str = "127.0.0.1",
            headers: dict[str, str] | None = None) -> Connection:
        conn = Connection(self.svc.site, client)
        conn.send("GET", path, headers=headers)
        return conn

    @property
    def stream(self) -> FakeStream:
        return self.streams[-1]


def sse(body: bytes) -> list[tuple[str, Any]]:
    return list(events(body.splitlines(keepends=True)))


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Proxy:
    return Proxy(monkeypatch)


def test_the_last_lines_as_events_then_a_clean_end(proxy: Proxy) -> None:
    """n=5 of a named engine: the agent gets that log order; each line is one `log` event
    with host, engine and line; the agent's clean exit ends the stream (complete), with no
    CORS header."""
    conn = proxy.get("/api/hosts/gpu2/log?engine=big&n=5")
    assert proxy.stream.order == {"op": "log", "engine": "big", "lines": 5, "follow": False}
    proxy.stream.line("loading model")
    proxy.stream.line("ready")
    proxy.stream.end()
    resp = conn.response()
    assert resp.status == 200 and resp.complete
    assert resp.headers["content-type"] == "text/event-stream"
    assert not [h for h in resp.headers if h.startswith("access-control-")]
    assert sse(resp.body) == [
        ("log", {"host": "gpu2", "engine": "big", "line": "loading model"}),
        ("log", {"host": "gpu2", "engine": "big", "line": "ready"})]
    assert proxy.svc.site.resource.host_logs.streams == set()     # type: ignore[attr-defined]


def test_without_an_engine_the_running_one_else_a_400_listing_them(proxy: Proxy) -> None:
    """Engine omitted: 400 engine_needed naming both engines while none runs; the running
    one once one runs; the default is 50 lines, not followed."""
    refused = proxy.get("/api/hosts/gpu2/log").response()
    assert refused.status == 400 and refused.json()["error"]["code"] == "engine_needed"
    assert "big, small" in refused.json()["error"]["message"]
    proxy.svc.fleet.managers["gpu2"].controller.assume("small")
    proxy.get("/api/hosts/gpu2/log")
    assert proxy.stream.order == {"op": "log", "engine": "small", "lines": 50, "follow": False}


def test_a_host_with_one_engine_needs_none_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine, nothing running: that engine's log."""
    config = json.loads(json.dumps(CONFIG))
    del config["hosts"][1]["engines"]["small"]
    del config["models"]["small"]
    proxy = Proxy(monkeypatch, config)
    proxy.get("/api/hosts/gpu2/log?follow=1")
    assert proxy.stream.order == {"op": "log", "engine": "big", "lines": 50, "follow": True}


@pytest.mark.parametrize(("path", "status", "code", "says"), [
    ("/api/hosts/gpu9/log", 404, "host_not_found", "no host named 'gpu9'"),
    ("/api/hosts/gpu1/log", 409, "host_not_managed", "gpu1 is not managed"),
    ("/api/hosts/gpu2/log?engine=huge", 404, "engine_not_found", "no engine 'huge'"),
    ("/api/hosts/gpu2/log?engine=big&n=x", 400, "invalid_parameter", "n must be"),
    ("/api/hosts/gpu2/log?engine=big&n=-1", 400, "invalid_parameter", "n must be"),
    ("/api/hosts/gpu2/log?engine=big&n=10001", 400, "invalid_parameter", "from 0 to 10000"),
    ("/api/hosts/gpu2/log?engine=big&n=1&n=2", 400, "invalid_parameter", "n is given 2 times"),
    ("/api/hosts/gpu2/log?engine=big&follow=yes", 400, "invalid_parameter", "follow must"),
    ("/api/hosts/gpu2/logs", 404, "not_found", "no such path"),
    ("/api/hosts/gpu2/log/x", 404, "not_found", "no such path"),
])
def test_refusals_are_json_errors_naming_why(proxy: Proxy, path: str, status: int, code: str,
                                             says: str) -> None:
    """Each refusal: its status, an OpenAI-style error with its code, a message that says
    why; no agent session opened."""
    resp = proxy.get(path).response()
    assert resp.status == status and resp.complete, resp
    error = resp.json()["error"]
    assert error["code"] == code and says in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert proxy.streams == []


def test_who_may_ask(proxy: Proxy) -> None:
    """Like the admin actions: loopback only without keys (403 from elsewhere), GET only,
    refused when a web page of another site sent it (Origin, Sec-Fetch-Site) or through a
    Host that is not the proxy's (DNS rebinding), and 503 once the proxy stops."""
    path = "/api/hosts/gpu2/log?engine=big"
    assert proxy.get(path, client="10.9.9.9").response().status == 403
    conn = Connection(proxy.svc.site, "127.0.0.1")
    conn.send("POST", path)
    assert conn.response().status == 405
    other = proxy.get(path, headers={"Origin": "http://evil.example"}).response()
    assert other.status == 403 and other.json()["error"]["code"] == "cross_site_request"
    fetch = proxy.get(path, headers={"Sec-Fetch-Site": "cross-site"}).response()
    assert fetch.status == 403
    conn = Connection(proxy.svc.site, "127.0.0.1")
    conn.channel.dataReceived(f"GET {path} HTTP/1.1\r\nHost: evil.example\r\n\r\n".encode())
    rebound = conn.response()
    assert rebound.status == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
    assert proxy.streams == []
    proxy.svc.events.close()
    stopping = proxy.get(path).response()
    assert stopping.status == 503 and stopping.json()["error"]["code"] == "stopping"


def test_with_keys_an_admin_key_from_anywhere(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """Keys on: from off loopback a key without admin gets 403, an admin key the log."""
    keys = tmp_path / "keys.json"
    def sha(secret: str) -> str:
        return hashlib.sha256(secret.encode()).hexdigest()

    keys.write_text(json.dumps({"keys": [{"name": "ops", "sha256": sha("s" * 32), "admin": True},
                                         {"name": "app", "sha256": sha("a" * 32)}]}))
    proxy = Proxy(monkeypatch, {**CONFIG, "keys_file": str(keys)})
    path = "/api/hosts/gpu2/log?engine=big"
    assert proxy.get(path, client="10.9.9.9").response().status == 401
    plain = proxy.get(path, client="10.9.9.9", headers={"Authorization": "Bearer " + "a" * 32})
    assert plain.response().status == 403
    proxy.get(path, client="10.9.9.9", headers={"Authorization": "Bearer " + "s" * 32})
    assert proxy.stream.order["engine"] == "big"


def test_a_long_hostile_line_is_cut_and_stays_one_event(proxy: Proxy) -> None:
    """A 10,000-character line with control characters and an SSE frame inside: one event,
    its line cut at 4,096 characters and saying how much was cut."""
    conn = proxy.get("/api/hosts/gpu2/log?engine=big")
    hostile = "\x1b[31m\r\n\n\nevent: error\ndata: {}\n\n\x00" + "x" * 10000
    proxy.stream.line(hostile)
    proxy.stream.end()
    body = conn.response().body
    (kind, doc), = sse(body)
    assert kind == "log"
    assert doc["line"] == hostile[:4096] + f" [cut: {len(hostile) - 4096} more characters]"
    assert body.count(b"\n\n") == 2          # the opening comment, and this one event


def test_the_head_waits_for_the_first_line_then_keepalives(proxy: Proxy) -> None:
    """A followed log with nothing yet: no head until HEAD_WAIT; then 200 and a comment
    naming the log, a keep-alive comment every 15 s, and lines as they come."""
    conn = proxy.get("/api/hosts/gpu2/log?engine=big&follow=1")
    assert conn.transport.value() == b""
    proxy.clock.advance(hostlog.HEAD_WAIT)
    resp = conn.response()
    assert resp.status == 200 and not resp.complete
    assert resp.body == b": engine big on gpu2\n\n"
    proxy.clock.advance(hostlog.KEEPALIVE_SECONDS)
    proxy.stream.line("later")
    assert conn.response().body.endswith(b": keepalive\n\n" + hostlog.frame(
        "log", {"host": "gpu2", "engine": "big", "line": "later"}))


def test_an_agent_error_before_the_stream_is_a_502(proxy: Proxy) -> None:
    """The agent refuses the order (its `ok: false` answer) before any line: a JSON 502
    agent_error with the agent's reason. An ssh failure the same, with its exit and stderr."""
    conn = proxy.get("/api/hosts/gpu2/log?engine=big")
    proxy.stream.on_event(decode({"ok": False, "protocol": 4, "error": "no log yet for big"}))
    proxy.stream.end("exit status 2")
    resp = conn.response()
    assert resp.status == 502 and resp.json()["error"]["code"] == "agent_error"
    assert "agent on gpu2: no log yet for big" in resp.json()["error"]["message"]
    conn = proxy.get("/api/hosts/gpu2/log?engine=big&follow=1")
    proxy.stream.end("exit status 255; stderr: ssh: connect to host 10.0.0.6: No route")
    resp = conn.response()
    assert resp.status == 502 and "exit status 255; stderr: ssh: connect" in resp.body.decode()


def test_an_agent_error_after_the_stream_began_is_one_error_event(proxy: Proxy) -> None:
    """A followed log whose ssh session dies after a line: that line, then one `error`
    event with the reason, and a clean end of the response."""
    conn = proxy.get("/api/hosts/gpu2/log?engine=big&follow=1")
    proxy.stream.line("one")
    proxy.stream.end("killed by signal 9")
    resp = conn.response()
    assert resp.status == 200 and resp.complete
    assert sse(resp.body) == [
        ("log", {"host": "gpu2", "engine": "big", "line": "one"}),
        ("error", {"host": "gpu2", "engine": "big", "error": "agent on gpu2: killed by signal 9"})]


def test_a_client_that_leaves_ends_the_agent_session(proxy: Proxy) -> None:
    """The client leaves a followed log: the agent's session is stopped at once (stdin
    closed, killed past the grace), the stream forgotten; its later end writes nothing."""
    conn = proxy.get("/api/hosts/gpu2/log?engine=big&follow=1")
    proxy.stream.line("one")
    assert not proxy.stream.stopped
    conn.disconnect()
    assert proxy.stream.stopped
    assert proxy.svc.site.resource.host_logs.streams == set()     # type: ignore[attr-defined]
    before = conn.transport.value()
    proxy.stream.line("two")
    proxy.stream.end()
    assert conn.transport.value() == before


def test_a_reader_that_stalls_is_dropped(proxy: Proxy) -> None:
    """A paused client: lines queue up to MAX_QUEUED, then the connection is aborted."""
    conn = proxy.get("/api/hosts/gpu2/log?engine=big&follow=1")
    proxy.stream.line("first")
    stream, = proxy.svc.site.resource.host_logs.streams       # type: ignore[attr-defined]
    stream.sender.pauseProducing()
    written = len(conn.transport.value())
    size = len(hostlog.frame("log", {"host": "gpu2", "engine": "big", "line": "y" * 3900}))
    for _ in range(hostlog.MAX_QUEUED // size):
        proxy.stream.line("y" * 3900)
    assert len(conn.transport.value()) == written and not conn.closed
    proxy.stream.line("y" * 3900)
    assert conn.closed and stream.sender.queued == 0


def test_the_proxys_stop_ends_a_followed_log_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reactor begins to shut down: the session is stopped; once it ended the client
    gets an `end` event saying the proxy stops and a clean end; the trigger is removed."""
    triggers = Triggers()
    proxy = Proxy(monkeypatch, triggers=triggers)
    conn = proxy.get("/api/hosts/gpu2/log?engine=big&follow=1")
    proxy.stream.line("one")
    assert len(triggers.before_shutdown) == 1
    triggers.shutdown()
    assert proxy.stream.stopped
    proxy.stream.end()
    resp = conn.response()
    assert resp.complete
    assert sse(resp.body)[-1] == ("end", {"host": "gpu2", "engine": "big",
                                          "reason": "the proxy is stopping"})
    assert triggers.before_shutdown == {}
    quiet = proxy.get("/api/hosts/gpu2/log?engine=big&follow=1")     # nothing sent yet
    triggers.shutdown()
    proxy.stream.end()
    written = quiet.transport.value()
    assert parse_response(written).complete
    proxy.clock.advance(3 * hostlog.KEEPALIVE_SECONDS)       # no keep-alive after the end
    assert quiet.transport.value() == written


def test_a_follow_that_ends_on_its_own_is_an_error() -> None:
    """EngineLog: a followed log whose agent exits 0 unasked ends with that reason; a
    look (no follow) ending 0 is a clean end; one stopped by us is clean whatever the exit."""
    host = parse_config(CONFIG).hosts[1]
    made: list[FakeStream] = []

    def open_stream(h: HostConfig, order: dict[str, Any], on: Any) -> Any:
        made.append(FakeStream(h, order, on))
        return made[-1]

    results: list[str | None] = []
    for follow, stop in ((True, False), (False, False), (True, True)):
        log = EngineLog(host, "big", 5, follow, lambda e, line: None, open_stream)
        log.ended.addCallback(results.append)
        if stop:
            log.stop()
        made[-1].end("killed by signal 9" if stop else "exit status 0")
    assert results == ["agent on gpu2: exit status 0", None, None]


def test_the_fleet_reads_logs_over_ssh_only(proxy: Proxy) -> None:
    """The real Fleet.open_log with a stand-in transport: LogRefused no_ssh (a 409)."""
    fleet = build_service(ServiceInputs(parse_config(CONFIG), Clock(), http=FakeHTTPClient(),
                                        agent=FakeAgentTransport())).fleet
    with pytest.raises(LogRefused) as info:
        fleet.open_log("gpu2", "big", 5, False, lambda e, line: None)
    assert info.value.kind == "no_ssh" and hostlog.REFUSALS["no_ssh"][0] == 409


def test_the_bound_is_the_agents() -> None:
    """The proxy's bound on n is the agent's MAX_LINES."""
    assert MAX_LINES == agent_logs.MAX_LINES


@given(st.lists(st.text(max_size=200), max_size=5))
def test_sse_frames_read_back(lines: list[str]) -> None:
    """Any lines framed by the proxy are read back by `llmproxy logs` unchanged."""
    body = b"".join(hostlog.frame("log", {"host": "h", "engine": "e", "line": line})
                    for line in lines)
    assert [doc["line"] for _, doc in sse(b": comment\n\n" + body)] == lines


def test_log_url() -> None:
    assert log_url("http://p", "gpu1", None, None, False) == "http://p/api/hosts/gpu1/log"
    assert log_url("http://p", "gpu1", "a b", 5, True) == \
        "http://p/api/hosts/gpu1/log?engine=a+b&n=5&follow=1"


class StandIn(HTTPServer):
    """Answers each GET with a canned (status, content type, body)."""

    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        self.paths: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.paths.append(self.path)
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def serve() -> Iterator[Callable[[int, str, bytes], StandIn]]:
    servers: list[StandIn] = []

    def start(status: int, content_type: str, body: bytes) -> StandIn:
        servers.append(StandIn(status, content_type, body))
        threading.Thread(target=servers[-1].serve_forever, daemon=True).start()
        return servers[-1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_the_command_prints_lines_and_says_errors(
        serve: Callable[[int, str, bytes], StandIn], capsys: pytest.CaptureFixture[str]) -> None:
    """`llmproxy logs`: the lines printed, exit 0; an error event: printed, exit 1; an
    error answer: its message, exit 1; no proxy there: exit 2."""
    doc = {"host": "gpu2", "engine": "big"}
    ok = serve(200, "text/event-stream", b": engine big on gpu2\n\n" + hostlog.frame(
        "log", {**doc, "line": "alpha"}) + hostlog.frame("log", {**doc, "line": "beta"}))
    assert main(["logs", "gpu2", "big", "-n", "2", "--url", ok.url]) == 0
    assert capsys.readouterr().out == "alpha\nbeta\n"
    assert ok.paths == ["/api/hosts/gpu2/log?engine=big&n=2"]
    bad = serve(200, "text/event-stream", hostlog.frame("log", {**doc, "line": "alpha"})
                + hostlog.frame("error", {**doc, "error": "agent on gpu2: exit status 255"}))
    assert main(["logs", "gpu2", "-f", "--url", bad.url]) == 1
    out = capsys.readouterr()
    assert out.out == "alpha\n" and "agent on gpu2: exit status 255" in out.err
    refused = serve(404, "application/json", json.dumps({"error": {
        "message": "no host named 'gpu9'", "type": "invalid_request_error",
        "code": "host_not_found"}}).encode())
    assert main(["logs", "gpu9", "--url", refused.url]) == 1
    assert "404 no host named 'gpu9'" in capsys.readouterr().err
    refused.shutdown()
    refused.server_close()
    assert main(["logs", "gpu9", "--url", refused.url, "--timeout", "5"]) == 2
    assert "cannot reach" in capsys.readouterr().err
