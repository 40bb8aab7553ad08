"""Capture over HTTP/2 (web/captures.py): a stream's request, whose body arrives in
DATA frames after its headers, is captured whole, with its key's name (never its
secret), and the engine's answer as the client read it. A real h2 client over a
memory transport on a task.Clock (tests/h2client.py), the proxy built as the service
builds it, keys on (tests/test_access.py's)."""

from __future__ import annotations

import json

from twisted.internet.task import Clock

from llmproxy.compat import streamhooks
from llmproxy.compat.goaway import GracefulH2Connection
from llmproxy.config import parse_config
from llmproxy.hosts.roster import RosterEntry
from llmproxy.lifecycle.accessfiles import AccessFiles
from llmproxy.lifecycle.assemble import ServiceInputs, build_service
from llmproxy.testing.fakes import FakeHTTPClient, FakeResponse
from tests.h2client import Client
from tests.test_access import CONFIG, SECRETS, ring


def test_an_http2_stream_is_captured_whole_with_its_keys_name() -> None:
    """A POST whose body comes in two DATA frames, answered by the engine in two
    pieces: its capture holds the whole body, the key's name `bob`, the answer the
    client read, status 200, host gpu1; the secret appears nowhere in it."""
    clock, http = Clock(), FakeHTTPClient()
    config = parse_config({**CONFIG, "capture": {}})
    svc = build_service(ServiceInputs(config, clock, http=http,
                                      access_files=AccessFiles(keys=ring())))
    svc.runtime.rosters.record_success("gpu1", 1, (RosterEntry("qwen-up", 4096),))
    client = Client(streamhooks.hooked(GracefulH2Connection)(clock, svc.site,
                                                             svc.parts.hub.publish),
                    clock, acknowledge=True)
    stream = client.post("/v1/chat/completions",
                         {"authorization": f"Bearer {SECRETS['bob']}",
                          "content-type": "application/json"})
    body = json.dumps({"model": "coder", "messages": [{"role": "user", "content": "x" * 300}]})
    client.send(stream, body[:100].encode())
    client.send(stream, body[100:].encode(), end=True)
    upstream = FakeResponse(200, {"Content-Type": "application/json"})
    http.calls[0].deferred.callback(upstream)
    upstream.send(b'{"choices": [{"message": ')
    upstream.send(b'{"content": "hi"}}]}')
    upstream.finish()
    client.pump()
    assert client.status[stream] == 200 and stream in client.ended
    ring_ = svc.parts.captures
    assert ring_ is not None
    [entry] = ring_.page()["captures"]
    doc = ring_.get(entry["id"])
    assert doc is not None
    assert doc["request"]["body"] == body and doc["key"] == "bob" and doc["host"] == "gpu1"
    assert doc["response"]["body"].encode() == client.data[stream]
    assert doc["status"] == 200 and doc["outcome"] == "completed"
    assert doc["request"]["headers"]["authorization"] == ["[redacted]"]
    assert SECRETS["bob"] not in json.dumps(doc)
