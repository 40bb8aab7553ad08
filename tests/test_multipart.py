"""Multipart bodies routed by their model field, in memory: the upstream name
spliced in, every other byte of every part forwarded unchanged, and every bad
form a 400 (never a 500)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from twisted.internet.task import Clock

from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.lifecycle.service import LLMProxyService
from llmproxy.testing.fakes import Connection, FakeHTTPClient

CONFIG: dict[str, Any] = {
    "listen": "127.0.0.1:0", "max_body_bytes": 600_000,
    "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}],
    "models": {"whisper": {"host": "gpu1", "upstream": "whisper-large-v3"}},
}
BOUNDARY = "----llmproxy-test-7d3a"
AUDIO = bytes(range(256)) * 1500 + b"\r\n--" + BOUNDARY[:-1].encode() + b"\r\n"


def form(*parts: tuple[str, bytes, str | None]) -> bytes:
    out = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (
            f'; filename="{filename}"' if filename else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n".encode()
        if filename:
            out += b"Content-Type: audio/wav\r\n"
        out += b"\r\n" + value + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def make() -> tuple[LLMProxyService, FakeHTTPClient, Clock]:
    clock, http = Clock(), FakeHTTPClient()
    svc = build_service(ServiceInputs(parse_config(CONFIG), clock, http=http))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("whisper-large-v3", 0),))
    return svc, http, clock


def post(svc: LLMProxyService, body: bytes, ctype: str | None = None) -> Connection:
    conn = Connection(svc.site)
    conn.send("POST", "/v1/audio/transcriptions", body,
              {"Content-Type": ctype or f"multipart/form-data; boundary={BOUNDARY}"})
    return conn


class Sink:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def produced(producer: Any, clock: Clock) -> bytes:
    """Everything a body producer writes, running its cooperator on the clock."""
    sink = Sink()
    done = producer.startProducing(sink)
    while not done.called:
        clock.advance(0)
    return sink.data


@pytest.mark.parametrize("order", ["model first", "file first"])
def test_routed_by_the_model_field_with_the_upstream_name_spliced_in(order: str) -> None:
    """The form goes to the model's host; upstream it is byte for byte the
    client's form with the model's value replaced, its length announced."""
    svc, http, clock = make()
    parts = [("model", b"whisper", None), ("file", AUDIO, "speech.wav"),
             ("response_format", b"json", None)]
    if order == "file first":
        parts = parts[1:2] + parts[:1] + parts[2:]
    body = form(*parts)
    post(svc, body)
    [call] = http.calls
    assert call.url == "http://10.0.0.5:8081/v1/audio/transcriptions"
    assert call.headers.getRawHeaders(b"content-type") == [
        f"multipart/form-data; boundary={BOUNDARY}".encode()]
    expected = body.replace(b"\r\n\r\nwhisper\r\n", b"\r\n\r\nwhisper-large-v3\r\n")
    assert call.body.length == len(expected)
    assert produced(call.body, clock) == expected


def test_a_stream_field_marks_the_request_streaming() -> None:
    """`stream=true` in the form is a streaming request (for the access line)."""
    svc, http, _ = make()
    post(svc, form(("model", b"whisper", None), ("stream", b"true", None),
                   ("file", b"abc", "a.wav")))
    assert [e.streaming for e in svc.inflight.active.values()] == [True]
    assert len(http.calls) == 1


@pytest.mark.parametrize("body, ctype, code", [
    (form(("file", b"abc", "a.wav")), None, "missing_model"),
    (form(("model", b"", None)), None, "missing_model"),
    (form(("model", b"w" * 2000, None)), None, "invalid_multipart"),
    (b"--" + BOUNDARY.encode() + b"\r\nno headers end", None, "invalid_multipart"),
    (b"garbage", None, "invalid_multipart"),
    (form(("model", b"whisper", None)), "multipart/form-data", "invalid_multipart"),
])
def test_bad_forms_are_400(body: bytes, ctype: str | None, code: str) -> None:
    """No model, an oversized model field, a broken form, no boundary: 400."""
    svc, http, _ = make()
    conn = post(svc, body, ctype)
    resp = conn.response()
    assert (resp.status, resp.json()["error"]["code"]) == (400, code)
    assert http.calls == []


def test_an_unknown_model_in_a_form_is_404() -> None:
    """A form naming a model nobody serves is the usual 404."""
    svc, _, _ = make()
    resp = post(svc, form(("model", b"nope", None), ("file", b"x", "a.wav"))).response()
    assert resp.status == 404 and json.loads(resp.body)["error"]["code"] == "model_not_found"


def test_a_form_over_the_limit_is_413() -> None:
    """max_body_bytes holds for forms too."""
    svc, http, _ = make()
    resp = post(svc, form(("model", b"whisper", None), ("file", b"x" * 700_000, "a"))).response()
    assert resp.status == 413 and http.calls == []
