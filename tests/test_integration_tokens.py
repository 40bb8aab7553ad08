"""`tpm` that holds, through a real twistd in front of a simulated engine (or a
scripted one), with the openai and anthropic SDKs and raw HTTP (issue 44,
items 6 and 7): a stream is charged though its client did not ask for its
usage (and does not see the usage chunk), an Anthropic stream its input and
output, a client that leaves what was relayed; 40 concurrent requests cannot
overdraw tpm 50; a 361-digit usage changes nothing but that request."""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.procs import Proxy, SimEngine

pytestmark = pytest.mark.integration

METERED, BURST, OTHER = "sk-metered-1a2b", "sk-burst-3c4d", "sk-other-5e6f"


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


KEYS = {"keys": [
    {"name": "metered", "sha256": sha(METERED), "tpm": 60},
    {"name": "burst", "sha256": sha(BURST), "tpm": 50},
    {"name": "other", "sha256": sha(OTHER), "tpm": 60},
]}


def start(tmp_path: Path, url: str) -> Proxy:
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    return Proxy({"keys_file": "keys.json", "public_status": True,
                  "runtime_dir": str(tmp_path / "run"),
                  "hosts": [{"name": "gpu1", "url": url, "max_queue": 100}]}, tmp_path)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Proxy, SimEngine]]:
    engine = SimEngine(["sim"], "--delay", "0.02", "--tokens", "8")
    try:
        proxy = start(tmp_path, engine.url)
    except BaseException:
        engine.stop()
        raise
    yield proxy, engine
    proxy.stop()
    engine.stop()


def remaining(proxy: Proxy, name: str) -> int:
    keys = proxy.get_json("/status")["access"]["per_key"]
    return int(next(k for k in keys if k["name"] == name)["limits"]["remaining_tokens"])


def test_a_stream_without_include_usage_is_charged_and_shows_no_usage_chunk(
        setup: tuple[Proxy, SimEngine]) -> None:
    """tpm 60, an openai SDK stream that does not ask for its usage: the engine
    is asked for it, the client gets no chunk without choices, and the key is
    charged the prompt and the 8 tokens (today: nothing). A client that asks
    for the usage gets its chunk as before."""
    proxy, engine = setup
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=METERED, max_retries=0,
                           timeout=10)
    chunks = list(client.chat.completions.create(
        model="sim", stream=True, messages=[{"role": "user", "content": "one two three"}]))
    assert chunks and all(c.choices for c in chunks)
    sent = engine.requests()[-1]["body"]
    assert sent["stream_options"] == {"include_usage": True}
    assert remaining(proxy, "metered") <= 60 - 11 + 2       # 3 + 8, less a refill's slack
    asked = list(client.chat.completions.create(
        model="sim", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "x"}]))
    assert asked[-1].choices == [] and asked[-1].usage is not None
    assert asked[-1].usage.completion_tokens == 8


def test_a_client_that_leaves_mid_stream_is_charged_what_was_relayed(
        setup: tuple[Proxy, SimEngine]) -> None:
    """A stream of 200 tokens whose client reads a few events and closes: the key
    is charged the prompt's estimate and the events relayed (today: nothing)."""
    proxy, _ = setup
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    body = {"model": "sim", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                 {"Authorization": f"Bearer {METERED}", "Content-Type": "application/json",
                  "X-Sim-Tokens": "200", "X-Sim-Delay": "0.05"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = b""
    while seen.count(b"data:") < 6:
        seen += resp.read1(65536)
    conn.close()
    for _ in range(100):
        if not proxy.get_json("/status")["in_flight"]:
            break
        threading.Event().wait(0.05)
    assert remaining(proxy, "metered") <= 60 - 6 + 2


def test_forty_concurrent_requests_against_tpm_50_are_mostly_refused(
        setup: tuple[Proxy, SimEngine]) -> None:
    """40 requests at once (max_tokens 20, each lasting about a second), tpm 50:
    each admitted one reserves its estimate, so at most a few pass and the rest
    are 429 `tokens` (today: all 40 pass, 1,200 tokens against 50)."""
    proxy, _ = setup
    statuses: list[int] = []
    gate = threading.Barrier(40)

    def one() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        body = {"model": "sim", "max_tokens": 20,
                "messages": [{"role": "user", "content": "hello there"}]}
        gate.wait()
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                     {"Authorization": f"Bearer {BURST}", "Content-Type": "application/json",
                      "X-Sim-Delay": "0.05"})
        resp = conn.getresponse()
        resp.read()
        statuses.append(resp.status)
        conn.close()

    threads = [threading.Thread(target=one) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(statuses) == 40 and set(statuses) <= {200, 429}
    assert statuses.count(200) <= 4 and statuses.count(429) >= 36


def test_an_anthropic_stream_is_charged_its_input_and_output(
        setup: tuple[Proxy, SimEngine]) -> None:
    """The anthropic SDK streams a message of 20 input words and 8 output tokens:
    the key is charged both, input from message_start (today: the 8 only)."""
    proxy, _ = setup
    client = anthropic.Anthropic(base_url=proxy.url, api_key=METERED, max_retries=0,
                                 timeout=10)
    words = " ".join(f"w{i}" for i in range(20))
    with client.messages.stream(model="sim", max_tokens=8,
                                messages=[{"role": "user", "content": words}]) as stream:
        text = "".join(stream.text_stream)
    assert text.startswith("tok0")
    assert remaining(proxy, "metered") <= 60 - 28 + 2


class _Absurd(BaseHTTPRequestHandler):
    """An engine whose answers report the completion_tokens its X-Usage header
    names (a 361-digit number, say)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._send({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"},
             "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": int(self.headers["X-Usage"])}})


def test_a_361_digit_usage_changes_nothing_but_that_request(tmp_path: Path) -> None:
    """A request whose engine reports 10**360 completion tokens: its key waits at
    most a day (Retry-After), another key's tpm still refuses once used up, and
    /metrics still counts the requests after it (today: the rate limits and the
    metrics are dropped from the event hub for good)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Absurd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = start(tmp_path, f"http://127.0.0.1:{server.server_address[1]}")
    try:
        def chat(secret: str, usage: int) -> tuple[int, dict[str, str]]:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            conn.request("POST", "/v1/chat/completions",
                         b'{"model": "m", "max_tokens": 1, "messages": []}',
                         {"Authorization": f"Bearer {secret}", "X-Usage": str(usage),
                          "Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            conn.close()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}

        assert chat(METERED, 10**360)[0] == 200
        status, headers = chat(METERED, 1)
        assert status == 429 and 1 <= int(headers["retry-after"]) <= 86400
        assert chat(OTHER, 100)[0] == 200
        status, headers = chat(OTHER, 1)
        assert status == 429 and int(headers["retry-after"]) <= 60
        with urllib.request.urlopen(proxy.url + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
        done = [line for line in metrics.splitlines()
                if line.startswith("llmproxy_key_requests_total{") and 'key="other"' in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in done) == 2.0
    finally:
        proxy.stop()
        server.shutdown()
        server.server_close()
