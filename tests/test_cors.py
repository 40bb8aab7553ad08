"""CORS (web/cors.py, config/security.py) through the Site in memory: preflight,
the headers on answers to an allowed origin (errors too), none for others or by
default, the API paths only, and the config's rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock

from llmproxy.config import ConfigError, parse_config
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.fakes import Connection, FakeHTTPClient, ParsedResponse

CHAT = "https://chat.example"


def make(tmp_path: Path, **extra: Any) -> LLMProxyService:
    config = parse_config({"runtime_dir": str(tmp_path / "run"),
                           "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}],
                           "models": {"qwen": {"host": "gpu1"}}, **extra})
    return build_service(ServiceInputs(config, Clock(), http=FakeHTTPClient()))


def ask(svc: LLMProxyService, method: str, path: str, body: bytes = b"",
        **headers: str) -> ParsedResponse:
    conn = Connection(svc.site, "127.0.0.1")
    conn.send(method, path, body, {k.replace("_", "-"): v for k, v in headers.items()})
    return conn.response()


def header(answer: ParsedResponse, name: str) -> str | None:
    value = answer.headers.get(name)
    return None if value is None else str(value)


def test_a_preflight_from_an_allowed_origin_is_answered_before_the_door(
        tmp_path: Path) -> None:
    """OPTIONS /v1/chat/completions from the allowed origin: 204 with the origin,
    the methods and the headers (Authorization, Content-Type, x-api-key,
    anthropic-version, and what the page asked for); keys or not, it needs none."""
    svc = make(tmp_path, cors={"origins": [CHAT]})
    answer = ask(svc, "OPTIONS", "/v1/chat/completions", Origin=CHAT,
                 Access_Control_Request_Method="POST",
                 Access_Control_Request_Headers="authorization, x-stainless-os")
    assert answer.status == 204
    assert header(answer, "access-control-allow-origin") == CHAT
    assert "POST" in (header(answer, "access-control-allow-methods") or "")
    allowed = (header(answer, "access-control-allow-headers") or "").lower()
    for name in ("authorization", "content-type", "x-api-key", "anthropic-version",
                 "x-stainless-os"):
        assert name in allowed
    assert header(answer, "vary") == "Origin"


def test_answers_to_an_allowed_origin_carry_it_and_others_get_none(tmp_path: Path) -> None:
    """An error (404 for an unknown model) to the allowed origin carries
    Access-Control-Allow-Origin; the same from another origin (refused: 403), without
    an Origin, or on /status, carries none; a preflight from another origin is not one."""
    svc = make(tmp_path, cors={"origins": [CHAT]})
    body = json.dumps({"model": "nope", "messages": []}).encode()
    allowed = ask(svc, "POST", "/v1/chat/completions", body, Origin=CHAT)
    assert allowed.status == 404 and header(allowed, "access-control-allow-origin") == CHAT
    assert "x-ratelimit-remaining-requests" in (
        header(allowed, "access-control-expose-headers") or "")
    other = ask(svc, "POST", "/v1/chat/completions", body, Origin="https://evil.example")
    assert other.status == 403 and header(other, "access-control-allow-origin") is None
    assert other.json()["error"]["code"] == "cross_site_request"
    plain = ask(svc, "POST", "/v1/chat/completions", body)
    assert header(plain, "access-control-allow-origin") is None
    status = ask(svc, "GET", "/status", Origin=CHAT)
    assert header(status, "access-control-allow-origin") is None
    preflight = ask(svc, "OPTIONS", "/v1/chat/completions", Origin="https://evil.example")
    assert preflight.status == 405 and header(preflight, "access-control-allow-origin") is None
    admin = ask(svc, "OPTIONS", "/admin/cordon?host=gpu1", Origin=CHAT)
    assert header(admin, "access-control-allow-origin") is None


def test_nothing_is_allowed_by_default(tmp_path: Path) -> None:
    svc = make(tmp_path)
    answer = ask(svc, "OPTIONS", "/v1/chat/completions", Origin=CHAT)
    assert answer.status == 405 and header(answer, "access-control-allow-origin") is None


def test_a_star_allows_any_origin_without_keys(tmp_path: Path) -> None:
    svc = make(tmp_path, cors={"origins": ["*"]})
    answer = ask(svc, "OPTIONS", "/v1/models", Origin="http://anything.lan:3000")
    assert answer.status == 204 and header(answer, "access-control-allow-origin") == "*"


@pytest.mark.parametrize("cors, field", [
    ({"origins": ["*"]}, "cors.origins[0]"),          # with keys_file
    ({"origins": ["https://chat.example/path"]}, "cors.origins[0]"),
    ({"origins": "https://chat.example"}, "cors"),
    ({"origins": [CHAT], "methods": []}, "cors.methods"),
    ({"origins": ["*", CHAT]}, "cors.origins"),
])
def test_bad_cors_config_names_the_field(cors: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}],
                      "keys_file": "keys.json", "cors": cors})
    assert any(line.startswith(f"{field}:") for line in e.value.errors), e.value.errors
