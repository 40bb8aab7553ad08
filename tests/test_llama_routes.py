"""llama-server's routes outside /v1/ that carry a model, in memory: routed by
model like /v1/*, the upstream name substituted; other paths stay 404."""

from __future__ import annotations

import json

import pytest
from twisted.internet.task import Clock

from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.testing.fakes import Connection, FakeHTTPClient

CONFIG = {"listen": "127.0.0.1:0", "hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}],
          "models": {"qwen": {"host": "gpu1", "upstream": "qwen-up"}}}


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/tokenize", "/detokenize",
                                  "/infill", "/embedding"])
def test_routes_with_a_model_go_to_its_host(path: str) -> None:
    """POST PATH with a model goes to the model's host at the same path."""
    http = FakeHTTPClient()
    svc = build_service(ServiceInputs(parse_config(CONFIG), Clock(), http=http))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen-up", 4096),))
    Connection(svc.site).send("POST", path, json.dumps({"model": "qwen", "query": "q"}).encode())
    [call] = http.calls
    assert call.url == "http://10.0.0.5:8081" + path
    assert json.loads(call.body) == {"model": "qwen-up", "query": "q"}


@pytest.mark.parametrize("method, path, status", [
    ("POST", "/props", 404), ("POST", "/completion", 404), ("POST", "/slots", 404),
    ("GET", "/tokenize", 405), ("POST", "/tokenize/x", 404),
])
def test_other_paths_stay_404(method: str, path: str, status: int) -> None:
    """Only the listed routes are forwarded; the rest are answered here."""
    http = FakeHTTPClient()
    svc = build_service(ServiceInputs(parse_config(CONFIG), Clock(), http=http))
    conn = Connection(svc.site)
    conn.send(method, path, json.dumps({"model": "qwen"}).encode())
    assert conn.response().status == status and http.calls == []
