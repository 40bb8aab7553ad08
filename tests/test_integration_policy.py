"""Priority classes, per-key rate limits and CORS through a real twistd in front
of a simulated engine (issue 37, parts 2, 3 and 5)."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import openai
import pytest

from tests import procs
from tests.procs import Proxy, SimEngine

pytestmark = pytest.mark.integration

FAST, SLOW, HIGH, LOW, TOKENS = ("sk-fast-1a2b3c", "sk-slow-4d5e6f", "sk-high-7a8b9c",
                                 "sk-low-0d1e2f", "sk-tok-3a4b5c")
CHAT = "https://chat.example"


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


KEYS = {"keys": [
    {"name": "limited", "sha256": sha(FAST), "rpm": 3},
    {"name": "free", "sha256": sha(SLOW)},
    {"name": "high", "sha256": sha(HIGH), "priority": "high"},
    {"name": "low", "sha256": sha(LOW), "priority": "low"},
    {"name": "tokens", "sha256": sha(TOKENS), "tpm": 30},
]}


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Proxy, SimEngine]]:
    engine = SimEngine(["sim"], "--delay", "0.05", "--tokens", "8")
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    config = {"keys_file": "keys.json", "public_status": True, "cors": {"origins": [CHAT]},
              "runtime_dir": str(tmp_path / "run"),
              "hosts": [{"name": "gpu1", "url": engine.url, "max_concurrent": 1,
                         "max_queue": 10, "queue_timeout_seconds": 60}]}
    try:
        proxy = Proxy(config, tmp_path)
    except BaseException:
        engine.stop()
        raise
    yield proxy, engine
    proxy.stop()
    engine.stop()


def chat(proxy: Proxy, secret: str, stream: bool = False,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    body = {"model": "sim", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {secret}",
                  **(headers or {})})
    resp = conn.getresponse()
    out = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, out


def test_rpm_counts_down_refuses_with_429_and_the_openai_sdk_reads_it(
        setup: tuple[Proxy, SimEngine]) -> None:
    """rpm 3: the remaining-requests header goes 2, 1, 0, the fourth request is 429
    with type requests, code rate_limit_exceeded and Retry-After; the openai SDK
    raises RateLimitError; a key without limits gets no such headers; /status and
    /metrics count the refusals."""
    proxy, _ = setup
    left = []
    for _ in range(3):
        status, headers, _ = chat(proxy, FAST)
        assert status == 200
        assert headers["x-ratelimit-limit-requests"] == "3"
        left.append(headers["x-ratelimit-remaining-requests"])
    assert left == ["2", "1", "0"]
    status, headers, body = chat(proxy, FAST)
    error = json.loads(body)["error"]
    assert status == 429 and error["type"] == "requests"
    assert error["code"] == "rate_limit_exceeded" and int(headers["retry-after"]) >= 1
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=FAST, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "x"}])
    status, headers, _ = chat(proxy, SLOW)
    assert status == 200 and "x-ratelimit-limit-requests" not in headers
    limited = next(k for k in proxy.get_json("/status")["access"]["per_key"]
                   if k["name"] == "limited")
    assert limited["limits"]["ratelimited"]["requests"] == 2
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'llmproxy_ratelimited_total{key="limited",type="requests"} 2.0' in metrics


def test_tpm_is_counted_from_the_engines_usage(setup: tuple[Proxy, SimEngine]) -> None:
    """tpm 30: the first answers' usage (prompt plus completion) is taken from the
    limit; once it is used up the next request is 429 with type tokens."""
    proxy, _ = setup
    remaining = []
    for _ in range(10):
        status, headers, body = chat(proxy, TOKENS)
        if status == 429:
            assert json.loads(body)["error"]["type"] == "tokens"
            break
        assert status == 200
        remaining.append(int(headers["x-ratelimit-remaining-tokens"]))
    else:
        pytest.fail("never refused")
    assert remaining[0] == 30 and all(b < a for a, b in pairwise(remaining))


def test_a_high_priority_key_is_served_before_an_earlier_low_one(
        setup: tuple[Proxy, SimEngine]) -> None:
    """max_concurrent 1, busy with a stream: a low-priority request arrives, then a
    high one; the high one is served first."""
    proxy, _ = setup
    done: list[str] = []

    def run(name: str, secret: str) -> None:
        chat(proxy, secret, stream=True)
        done.append(name)

    busy = threading.Thread(target=run, args=("busy", SLOW))
    busy.start()
    procs.wait_until(lambda: proxy.get_json("/status")["capacity"]["gpu1"]["in_flight"] == 1
                     if "capacity" in proxy.get_json("/status") else True)
    time.sleep(0.1)
    low = threading.Thread(target=run, args=("low", LOW))
    low.start()
    time.sleep(0.2)
    high = threading.Thread(target=run, args=("high", HIGH))
    high.start()
    for t in (busy, low, high):
        t.join(30)
    assert done == ["busy", "high", "low"]


def test_cors_preflight_and_a_stream_with_and_without_an_allowed_origin(
        setup: tuple[Proxy, SimEngine]) -> None:
    """The preflight from the allowed origin is 204 with the methods and headers;
    a streamed answer to it carries Access-Control-Allow-Origin; a POST from another
    origin is refused (403 cross_site_request, web/origin.py) without it; one with no
    Origin (not a browser's cross-site request) is answered without it."""
    proxy, _ = setup
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": CHAT, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 204 and resp.getheader("access-control-allow-origin") == CHAT
    assert "x-api-key" in (resp.getheader("access-control-allow-headers") or "")
    status, headers, body = chat(proxy, SLOW, stream=True, headers={"Origin": CHAT})
    assert status == 200 and headers.get("access-control-allow-origin") == CHAT
    assert body.rstrip().endswith(b"data: [DONE]")
    status, headers, body = chat(proxy, SLOW, stream=True,
                                 headers={"Origin": "https://evil.example"})
    assert status == 403 and "access-control-allow-origin" not in headers
    assert json.loads(body)["error"]["code"] == "cross_site_request"
    status, headers, _ = chat(proxy, SLOW, stream=True)
    assert status == 200 and "access-control-allow-origin" not in headers


def test_a_limit_holds_across_an_upgrade(setup: tuple[Proxy, SimEngine]) -> None:
    """rpm 3 used up by the old process; after SIGUSR1 the successor (once the old
    one has gone) refuses the key's next request with 429."""
    proxy, _ = setup
    for _ in range(3):
        assert chat(proxy, FAST)[0] == 200
    old = proxy.pid
    os.kill(old, signal.SIGUSR1)
    new = procs.wait_new_pid(proxy, old)
    try:
        assert procs.wait_gone(old)
        status, _, body = chat(proxy, FAST)
        assert status == 429 and json.loads(body)["error"]["type"] == "requests"
    finally:
        os.kill(new, signal.SIGTERM)
        procs.wait_gone(new)
        procs.kill_if_alive(new)
