"""Keys off means "no keys", not "no origin" (issue 44, item 10 and its Low items),
through the real Site in memory: the Host allow-list on every path, cross-site
API POSTs refused, dot segments refused before anything is forwarded, engine
log text and client addresses only for those who may read logs, never in an
error body, and `trusted_peers` honoured and validated by field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock

from llmproxy.config import ConfigError, parse_config
from llmproxy.config.keys import load_keys
from llmproxy.core.events import EngineExit, RequestEnded
from llmproxy.core.redact import quote_log, redact_doc, redact_text
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.fakes import Connection, FakeHTTPClient, ParsedResponse
from llmproxy.web.errors import error_body

SECRET = "s3cret-admin-key-0123456789"
BASE: dict[str, Any] = {"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}],
                        "models": {"qwen": {"host": "gpu1"}}}
CHAT = json.dumps({"model": "qwen", "messages": [{"role": "user", "content": "hi"}]})
PATHS = [("GET", "/"), ("GET", "/status"), ("GET", "/metrics"), ("GET", "/api/events"),
         ("GET", "/v1/models"), ("POST", "/v1/chat/completions")]


def make(tmp_path: Path, keys: bool = False, **extra: Any) -> tuple[LLMProxyService,
                                                                   FakeHTTPClient]:
    doc: dict[str, Any] = {**BASE, "runtime_dir": str(tmp_path / "run"), **extra}
    if keys:
        import hashlib
        tmp_path.mkdir(parents=True, exist_ok=True)
        path = tmp_path / "keys.json"
        path.write_text(json.dumps({"keys": [{"name": "ops", "admin": True, "sha256":
                                              hashlib.sha256(SECRET.encode()).hexdigest()}]}))
        load_keys(str(path))
        doc |= {"keys_file": str(path), "public_status": True}
    http = FakeHTTPClient()
    return build_service(ServiceInputs(parse_config(doc), Clock(), http=http)), http


def send(svc: LLMProxyService, method: str, path: str, *headers: str, body: str = "",
         client: str = "127.0.0.1") -> Connection:
    """One request with exactly these header lines (Host included)."""
    conn = Connection(svc.site, client)
    head = [f"{method} {path} HTTP/1.1", *headers]
    if method == "POST":
        head.append(f"Content-Length: {len(body.encode())}")
    conn.channel.dataReceived("\r\n".join(head).encode() + b"\r\n\r\n" + body.encode())
    return conn


def raw(svc: LLMProxyService, method: str, path: str, *headers: str, body: str = "",
        client: str = "127.0.0.1") -> ParsedResponse:
    """The answer to one request with exactly these header lines."""
    return send(svc, method, path, *headers, body=body, client=client).response()


@pytest.mark.parametrize("keys", [False, True], ids=["keys off", "keys on, public_status"])
@pytest.mark.parametrize(("method", "path"), PATHS)
def test_a_rebound_name_gets_403_on_every_path(tmp_path: Path, keys: bool, method: str,
                                               path: str) -> None:
    """Host: evil.example (a DNS name rebound to the proxy) without a key: 403
    host_not_allowed on the page, /status, /metrics, /api/events and the API (with
    keys on the API wants its key first: 401), and nothing reaches an engine;
    /healthz still answers (probes)."""
    svc, http = make(tmp_path, keys)
    answer = raw(svc, method, path, "Host: evil.example:8080", body=CHAT)
    if keys and path.startswith("/v1/"):
        assert answer.status == 401 and not http.calls
        return
    assert answer.status == 403, answer.body
    assert answer.json()["error"]["code"] == "host_not_allowed"
    assert "server_names" in answer.json()["error"]["message"]
    assert not http.calls
    assert raw(svc, "GET", "/healthz", "Host: evil.example").status == 200


def test_the_proxys_own_names_pass(tmp_path: Path) -> None:
    """An IP literal, localhost and a name in server_names are answered; with a
    valid key, any name is (a page cannot present a key across sites)."""
    svc, _ = make(tmp_path, server_names=["gpu-gateway.lan"])
    for host in ("127.0.0.1:8080", "[::1]:8080", "localhost", "GPU-Gateway.lan:8080"):
        assert raw(svc, "GET", "/v1/models", f"Host: {host}").status == 200, host
    keyed, _ = make(tmp_path / "k", True)
    answer = raw(keyed, "GET", "/v1/models", "Host: anything.lan",
                 f"Authorization: Bearer {SECRET}")
    assert answer.status == 200


@pytest.mark.parametrize("headers", [
    ("Origin: https://evil.example",),
    ("Origin: null",),
    ("Sec-Fetch-Site: cross-site",),
], ids=["another origin", "an opaque origin", "sec-fetch-site"])
def test_a_cross_site_text_plain_post_is_refused(tmp_path: Path,
                                                 headers: tuple[str, ...]) -> None:
    """A page on another site POSTs text/plain JSON (no preflight) to the API with
    keys off: 403 cross_site_request, and no engine runs it."""
    svc, http = make(tmp_path)
    answer = raw(svc, "POST", "/v1/chat/completions", "Host: 127.0.0.1:8080",
                 "Content-Type: text/plain", *headers, body=CHAT)
    assert answer.status == 403, answer.body
    assert answer.json()["error"]["code"] == "cross_site_request"
    assert not http.calls


def test_the_proxys_own_origin_and_allowed_origins_pass(tmp_path: Path) -> None:
    """The proxy's own page (same origin) and an origin in cors.origins may POST."""
    svc, http = make(tmp_path, cors={"origins": ["https://chat.example"]})
    send(svc, "POST", "/v1/chat/completions", "Host: 127.0.0.1:8080",
         "Origin: http://127.0.0.1:8080", "Sec-Fetch-Site: same-origin", body=CHAT)
    send(svc, "POST", "/v1/chat/completions", "Host: 127.0.0.1:8080",
         "Origin: https://chat.example", "Sec-Fetch-Site: cross-site", body=CHAT)
    assert len(http.calls) == 2


@pytest.mark.parametrize("path", [
    "/v1/../../slots/0?action=erase", "/v1/%2e%2e/%2E%2E/slots/0?action=erase",
    "/v1/chat/..%2f..%2fslots/0", "/v1/./chat/completions", "/v1\\..\\slots/0",
    "/api/hosts/../../v1/chat/completions", "/v1/chat/completions/..",
])
def test_dot_segments_are_400_and_never_reach_an_engine(tmp_path: Path, path: str) -> None:
    """A `.` or `..` segment, raw or percent-encoded: 400 invalid_path, nothing
    forwarded."""
    svc, http = make(tmp_path)
    answer = raw(svc, "POST", path, "Host: 127.0.0.1", body=CHAT)
    assert answer.status == 400, answer.body
    assert answer.json()["error"]["code"] == "invalid_path"
    assert not http.calls


def test_a_424_to_an_api_client_never_quotes_the_engines_log() -> None:
    """An error body (OpenAI and Anthropic shapes go through it) withholds a quoted
    log line, even one cut short by a bounded note."""
    message = (f"model m: c failed: it died 5 times within 10 minutes, last with exit "
               f"status 3; its log's last line: {quote_log('user said: my password')} "
               "(llmproxy engine gpu1 start c tries again)")
    body = json.loads(error_body(424, message))["error"]["message"]
    assert "password" not in body and "withheld" in body and "exit status 3" in body
    assert "start c tries again" in body
    assert "password" not in redact_text(message[:message.index("password") + 8])


def events(svc: LLMProxyService, client: str, *headers: str) -> list[dict[str, Any]]:
    conn = Connection(svc.site, client)
    lines = ["GET /api/events HTTP/1.1", "Host: 127.0.0.1", *headers]
    conn.channel.dataReceived("\r\n".join(lines).encode() + b"\r\n\r\n")
    svc.parts.hub.publish(EngineExit(1.0, "gpu1", "c", "exit status 3",
                               ("loading", "prompt: my password")))
    svc.parts.hub.publish(RequestEnded(2.0, "r-1", "POST", "/v1/chat/completions", "10.7.7.7",
                                 "qwen", "gpu1", None, 424, 10, 0.1, "failed",
                                 f"its log's last line: {quote_log('my password')}"))
    text = conn.transport.value().decode()
    kinds = ('"type":"engine.exit"', '"type":"request.end"')
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and any(kind in line for kind in kinds)]


@pytest.mark.parametrize("keys", [False, True], ids=["keys off", "keys on, public_status"])
def test_logs_and_client_addresses_only_for_those_who_may_read_logs(tmp_path: Path,
                                                                   keys: bool) -> None:
    """/api/events: a LAN reader (keys off) or a keyless public_status reader gets
    engine.exit without its log tail and request.end without the log line or the
    client's address; a trusted peer (keys off) or an admin key gets them whole."""
    svc, _ = make(tmp_path, keys)
    lan = events(svc, "10.1.2.3")
    assert [e["type"] for e in lan] == ["engine.exit", "request.end"]
    assert "password" not in json.dumps(lan) and lan[0]["log_tail"] == []
    assert lan[1]["client"] == "withheld"
    operator = events(svc, "127.0.0.1", *([f"Authorization: Bearer {SECRET}"] if keys else []))
    assert operator[0]["log_tail"] == ["loading", "prompt: my password"]
    assert operator[1]["client"] == "10.7.7.7" and "my password" in operator[1]["detail"]


def test_status_withholds_log_lines_from_a_lan_reader(tmp_path: Path) -> None:
    """/status with keys off: a LAN peer reads `last_line` as None and quoted lines
    withheld; a trusted peer reads them."""
    svc, _ = make(tmp_path)
    doc = {"supervision": {"c": {"last_line": "my password", "state": "failed"}},
           "last_error": f"x (last log line: {quote_log('my password')})"}
    svc.status = lambda: doc      # type: ignore[method-assign]
    lan = raw(svc, "GET", "/status", "Host: 127.0.0.1", client="10.1.2.3").json()
    assert "password" not in json.dumps(lan) and lan["supervision"]["c"]["last_line"] is None
    assert raw(svc, "GET", "/status", "Host: 127.0.0.1").json() == doc
    assert redact_doc(doc) != doc and doc["supervision"]["c"]["last_line"] == "my password"


def test_trusted_peers_are_honoured(tmp_path: Path) -> None:
    """trusted_peers ["10.0.0.0/24"]: a keyless admin action from 10.0.0.9 is let
    in, loopback is not; [] trusts nobody; the default is loopback only."""
    svc, _ = make(tmp_path, trusted_peers=["10.0.0.0/24"])
    assert raw(svc, "POST", "/admin/cordon?host=gpu1", "Host: 127.0.0.1",
               client="10.0.0.9").status == 200
    refused = raw(svc, "POST", "/admin/uncordon?host=gpu1", "Host: 127.0.0.1")
    assert refused.status == 403 and "trusted_peers" in refused.json()["error"]["message"]
    nobody, _ = make(tmp_path / "n", trusted_peers=[])
    assert raw(nobody, "POST", "/admin/cordon?host=gpu1", "Host: 127.0.0.1").status == 403
    default, _ = make(tmp_path / "d")
    assert raw(default, "POST", "/admin/cordon?host=gpu1", "Host: 127.0.0.1").status == 200
    assert raw(default, "POST", "/admin/cordon?host=gpu1", "Host: 127.0.0.1",
               client="10.0.0.9").status == 403


def test_trusted_peers_are_validated_by_field() -> None:
    """Each entry is an address or a network (kept in CIDR form); errors name it."""
    config = parse_config({**BASE, "trusted_peers": ["127.0.0.1", "10.0.0.0/24", "::1"]})
    assert config.trusted_peers == ("127.0.0.1/32", "10.0.0.0/24", "::1/128")
    assert parse_config(BASE).trusted_peers == ("127.0.0.0/8", "::1/128")
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "trusted_peers": ["10.0.0.1/24", 7, "gpu.lan"]})
    assert [e.split(":")[0] for e in info.value.errors] == [
        "trusted_peers[0]", "trusted_peers[1]", "trusted_peers[2]"]
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "trusted_peers": "127.0.0.1"})
    assert info.value.errors[0].startswith("trusted_peers: must be a list")
