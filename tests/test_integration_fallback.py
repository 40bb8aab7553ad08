"""Fallback chains for real: twistd llmproxy in front of simulated engines (their
own records say which model each request reached). A model whose only host is
down, or cordoned (`llmproxy cordon`), hands its requests to its fallback with
`model` substituted and X-LLMProxy-Model set, on the OpenAI and Anthropic paths,
streamed or not; a stream whose engine dies mid-way is cut for the client and
never handed to another model."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.procs import Proxy, SimEngine, env, refusing_port, wait_until

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", *args], env=env(),
                          capture_output=True, text=True, timeout=60, check=False)


def post(port: int, model: str, path: str = "/v1/chat/completions", stream: bool = False,
         ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body: dict[str, Any] = {"model": model, "stream": stream, "max_tokens": 8,
                            "messages": [{"role": "user", "content": "hi"}]}
    conn.request("POST", path, json.dumps(body), {"X-Sim-Tokens": "3", "X-Sim-Delay": "0.01"})
    resp = conn.getresponse()
    headers = {k.lower(): v for k, v in resp.getheaders()}
    return resp.status, headers, resp.read()


def models_seen(engine: SimEngine) -> list[str]:
    return [r["model"] for r in engine.requests()]


def test_a_down_host_and_a_cordoned_one_fall_back_to_the_next_model(tmp_path: Path) -> None:
    """x's only host refuses connections: x is served by y (y's engine sees model
    y), with X-LLMProxy-Model: y and the route.fallback log line; so are an
    Anthropic request and a stream. z's host is up: z is served there, no header;
    once h1 is cordoned, z goes to y too, and h1's engine sees nothing more."""
    one, two = SimEngine(["z-up"]), SimEngine(["y"])
    proxy: Proxy | None = None
    try:
        with refusing_port() as dead:
            proxy = Proxy({"runtime_dir": str(tmp_path / "run"),
                           "hosts": [{"name": "dead", "url": f"http://127.0.0.1:{dead}"},
                                     {"name": "h1", "url": one.url},
                                     {"name": "h2", "url": two.url}],
                           "models": {"x": {"host": "dead", "fallbacks": ["y"]},
                                      "z": {"host": "h1", "upstream": "z-up",
                                            "fallbacks": ["y"]},
                                      "y": {"host": "h2"}}}, tmp_path)
            status, headers, body = post(proxy.port, "x")
            assert status == 200 and headers["x-llmproxy-model"] == "y"
            assert json.loads(body)["choices"]
            assert models_seen(two) == ["y"]
            proxy.wait_for(r"for x: no host could take it \(.*\), nothing was sent: "
                           r"falling back to y")
            status, headers, _ = post(proxy.port, "x", "/v1/messages")
            assert status == 200 and headers["x-llmproxy-model"] == "y"
            assert two.requests()[-1]["path"] == "/v1/messages"
            status, headers, body = post(proxy.port, "x", stream=True)
            assert status == 200 and headers["x-llmproxy-model"] == "y"
            assert body.rstrip().endswith(b"data: [DONE]")
            assert models_seen(two) == ["y"] * 3

            status, headers, _ = post(proxy.port, "z")
            assert status == 200 and "x-llmproxy-model" not in headers
            assert models_seen(one) == ["z-up"]
            assert cli("cordon", "h1", "--url", proxy.url).returncode == 0
            status, headers, _ = post(proxy.port, "z")
            assert status == 200 and headers["x-llmproxy-model"] == "y"
            assert models_seen(one) == ["z-up"] and models_seen(two) == ["y"] * 4
            assert "for z: no host could take it (cordoned: h1)" in proxy.output()
    finally:
        if proxy is not None:
            proxy.stop()
        one.stop()
        two.stop()


def test_no_fallback_once_a_stream_started_then_the_dead_host_falls_back(
        tmp_path: Path) -> None:
    """A stream of z runs on h1 when h1's engine is killed: the client sees the cut
    (no [DONE]), and y's engine never hears of it. The next request for z finds
    h1 down and is served by y."""
    one, two = SimEngine(["z"]), SimEngine(["y"])
    proxy = Proxy({"hosts": [{"name": "h1", "url": one.url}, {"name": "h2", "url": two.url}],
                   "models": {"z": {"host": "h1", "fallbacks": ["y"]}, "y": {"host": "h2"}}},
                  tmp_path)
    try:
        stream = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        stream.request("POST", "/v1/chat/completions",
                       json.dumps({"model": "z", "stream": True}),
                       {"X-Sim-Tokens": "200", "X-Sim-Delay": "0.05"})
        resp = stream.getresponse()
        assert resp.status == 200 and resp.getheader("x-llmproxy-model") is None
        got = resp.read1(65536)
        assert wait_until(lambda: one.requests()[0]["chunks_sent"] >= 2)
        one.kill()
        cut = False
        try:
            while chunk := resp.read1(65536):
                got += chunk
        except (http.client.IncompleteRead, OSError):
            cut = True
        assert cut, "the stream ended cleanly"
        assert b"data: {" in got and b"[DONE]" not in got
        assert two.requests() == []
        assert "falling back" not in proxy.output()
        status, headers, body = post(proxy.port, "z")
        assert status == 200 and headers["x-llmproxy-model"] == "y", (body, proxy.output())
        assert models_seen(two) == ["y"]
    finally:
        proxy.stop()
        one.stop()
        two.stop()
