"""The proxy as a real `twistd -n llmproxy` process in front of real simulated
engines on 127.0.0.1: the promises of the core, end to end."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmproxy.testing import demo
from tests.procs import ROOT, Proc, Proxy, SimEngine, free_port, refusing_port, twistd, wait_until

pytestmark = pytest.mark.integration

HEADER_TIMEOUT = 2
READ_TIMEOUT = 2


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[SimEngine, SimEngine]]:
    a = SimEngine(["qwen-up", "extra-a"], "--ctx", "4096")
    b = SimEngine(["mistral"], "--ctx", "8192")
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def down_port() -> Iterator[int]:
    with refusing_port() as port:
        yield port


@pytest.fixture(scope="module")
def proxy(engines: tuple[SimEngine, SimEngine], down_port: int,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    a, b = engines
    config = {
        # Well apart from every answer the tests wait for (0.1 s) and from the
        # one they want to time out (10 s).
        "header_timeout_seconds": HEADER_TIMEOUT,
        # Well above every gap between two events of the tests' streams (0.1 s).
        "engine_read_timeout_seconds": READ_TIMEOUT,
        "max_body_bytes": 4096,
        "hosts": [
            {"name": "gpu1", "url": a.url},
            {"name": "laptop", "url": b.url},
            {"name": "down", "url": f"http://127.0.0.1:{down_port}"},
        ],
        "models": {
            "qwen": {"host": "gpu1", "upstream": "qwen-up", "ctx": 32768},
            "mistral": {"host": "laptop"},
            "offline": {"host": "down", "upstream": "big"},
        },
        "aliases": {"coder": "qwen"},
    }
    p = Proxy(config, tmp_path_factory.mktemp("proxy"))
    yield p
    p.stop()


def post(proxy: Proxy, path: str, body: Any, headers: dict[str, str] | None = None
         ) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


def chat(model: str = "coder", **extra: Any) -> dict[str, Any]:
    return {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}],
            **extra}


def events(resp: http.client.HTTPResponse) -> Iterator[str]:
    """SSE data payloads, one at a time, as they arrive."""
    while True:
        line = resp.readline()
        if not line:
            return
        if line.startswith(b"data: "):
            yield line[6:].strip().decode()


def last_record(engine: SimEngine) -> dict[str, Any]:
    return engine.requests()[-1]


def test_merged_model_list_survives_a_down_host(proxy: Proxy) -> None:
    """/v1/models merges both live hosts' rosters with the catalog (catalog ctx
    wins, alias listed, roster-only model served) and keeps the down host's
    catalog entry; /status names the down host's error."""
    doc = proxy.get_json("/v1/models")
    by_id = {m["id"]: m for m in doc["data"]}
    assert set(by_id) == {"qwen", "mistral", "offline", "coder", "extra-a"}
    assert by_id["qwen"]["context_length"] == 32768
    assert by_id["mistral"]["context_length"] == 8192
    assert by_id["offline"]["llmproxy"]["available"] is False
    status = proxy.get_json("/status")
    down = next(h for h in status["hosts"] if h["name"] == "down")
    assert "refused" in down["roster"]["last_error"].lower()
    assert proxy.get_json("/readyz") == {"ready": True}


def test_chunks_reach_the_client_while_the_upstream_still_generates(
        proxy: Proxy, engines: tuple[SimEngine, SimEngine]) -> None:
    """The first chunk arrives while the engine is still generating (the
    engine's own record says so), then every chunk arrives in order and the
    stream ends with the engine's [DONE]."""
    resp = post(proxy, "/v1/chat/completions", chat(),
                {"X-Sim-Delay": "0.2", "X-Sim-Tokens": "10"})
    assert resp.status == 200
    assert resp.getheader("X-Accel-Buffering") == "no"
    stream = events(resp)
    assert "assistant" in next(stream)          # the role chunk
    first = json.loads(next(stream))
    assert first["choices"][0]["delta"]["content"] == "tok0 "
    record = last_record(engines[0])
    assert record["outcome"] == "running" and record["chunks_sent"] < 10
    assert record["model"] == "qwen-up"         # upstream name substituted
    rest = list(stream)
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in rest[:-2]]
    assert contents == [f"tok{i} " for i in range(1, 10)]
    assert rest[-1] == "[DONE]"
    assert wait_until(lambda: last_record(engines[0])["outcome"] == "completed", 5)
    assert proxy.wait_for(r"POST /v1/chat/completions model=coder host=gpu1 status=200 .*"
                          r"outcome=completed")


def test_client_disconnect_cancels_the_upstream(
        proxy: Proxy, engines: tuple[SimEngine, SimEngine]) -> None:
    """A client that hangs up mid-stream makes the proxy drop the upstream
    request at once: the engine sees its client go long before it would finish."""
    resp = post(proxy, "/v1/chat/completions", chat("mistral"),
                {"X-Sim-Delay": "0.1", "X-Sim-Tokens": "200"})
    stream = events(resp)
    next(stream)
    next(stream)
    resp.close()
    record = wait_until(lambda: next((r for r in engines[1].requests()
                                      if r["outcome"] == "client-gone"), None))
    assert record is not None, engines[1].requests()
    assert record["chunks_sent"] < 50
    assert proxy.wait_for(r"model=mistral host=laptop .*outcome=client-gone")


def test_upstream_dying_mid_stream_is_visible_to_the_client(proxy: Proxy) -> None:
    """An engine that crashes mid-stream: the client's chunked body ends without
    its terminating chunk (an error for the client), never with [DONE]."""
    resp = post(proxy, "/v1/chat/completions", chat(),
                {"X-Sim-Delay": "0.05", "X-Sim-Die-After": "3"})
    with pytest.raises(http.client.IncompleteRead) as cut:
        resp.read()
    assert b"tok2" in cut.value.partial and b"[DONE]" not in cut.value.partial
    assert proxy.wait_for(r"model=coder host=gpu1 status=200 .*outcome=upstream-failed")


def test_an_engine_silent_mid_stream_is_cut_off_with_an_error_event(
        proxy: Proxy, engines: tuple[SimEngine, SimEngine]) -> None:
    """An engine that sends its first event and then nothing (alive, connected):
    after engine_read_timeout_seconds the client gets an error event and an
    incomplete body, and the engine's connection is closed."""
    started = time.monotonic()
    resp = post(proxy, "/v1/chat/completions", chat("mistral"),
                {"X-Sim-Delay": "60", "X-Sim-Tokens": "2"})
    assert resp.status == 200
    with pytest.raises(http.client.IncompleteRead) as cut:
        resp.read()
    waited = time.monotonic() - started
    first, error_event = cut.value.partial.decode().strip().split("\n\n")
    assert '"role": "assistant"' in first or '"role":"assistant"' in first
    assert json.loads(error_event.removeprefix("data: "))["error"] == {
        "message": f"the engine sent nothing for {READ_TIMEOUT}s (engine_read_timeout_seconds)",
        "type": "upstream_error", "code": 504}
    assert READ_TIMEOUT <= waited < 30
    record = wait_until(lambda: engines[1].requests()[-1]["outcome"] == "client-gone"
                        and engines[1].requests()[-1])
    assert record and record["chunks_sent"] == 0, engines[1].requests()
    assert proxy.wait_for(r"model=mistral host=laptop status=200 .*outcome=upstream-failed "
                          r"\(the engine sent nothing")


def error(resp: http.client.HTTPResponse) -> tuple[int, dict[str, Any]]:
    assert resp.getheader("Content-Type") == "application/json"
    doc = json.loads(resp.read())
    return resp.status, doc["error"]


@pytest.mark.parametrize("body, status, code", [
    (b"not json", 400, "invalid_json"),
    ({"messages": []}, 400, "missing_model"),
    ({"model": "gpt-9", "messages": []}, 404, "model_not_found"),
    ({"model": "coder", "pad": "x" * 5000}, 413, "request_too_large"),
    ({"model": "offline", "messages": []}, 502, "upstream_failed"),
])
def test_error_answers(proxy: Proxy, body: Any, status: int, code: str) -> None:
    """Bad requests and a down host get OpenAI-style JSON errors with the right status."""
    got_status, err = error(post(proxy, "/v1/chat/completions", body))
    assert (got_status, err["code"]) == (status, code)
    assert err["message"] and err["type"]


def test_upstream_too_slow_for_headers_is_504(proxy: Proxy) -> None:
    """An engine that sends no headers within header_timeout_seconds is a 504."""
    started = time.monotonic()
    status, err = error(post(proxy, "/v1/chat/completions", chat(),
                             {"X-Sim-Header-Delay": "10"}))
    assert (status, err["code"]) == (504, "upstream_timeout")
    assert HEADER_TIMEOUT <= time.monotonic() - started < 8


def test_openai_sdk_streams_through_the_proxy(proxy: Proxy) -> None:
    """The openai SDK lists models and streams a chat completion through the proxy."""
    import openai

    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused")
    assert "coder" in [m.id for m in client.models.list()]
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(
        model="coder", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=5)
        if c.choices and c.choices[0].delta.content]
    assert pieces == [f"tok{i} " for i in range(5)]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[])


def test_twistd_lists_and_documents_the_plugin() -> None:
    """`twistd --help` lists llmproxy; `twistd llmproxy --help` documents its options."""
    out = subprocess.run([twistd(), "--help"], capture_output=True, text=True, cwd="/",
                         env=_env(), timeout=30, check=True).stdout
    assert "llmproxy" in out
    sub = subprocess.run([twistd(), "llmproxy", "--help"], capture_output=True, text=True,
                         cwd="/", env=_env(), timeout=30, check=True).stdout
    assert "--config=" in sub and "--demo" in sub


def _env() -> dict[str, str]:
    from tests.procs import env

    return env()


def test_bad_config_stops_twistd_naming_every_field(tmp_path: Path) -> None:
    """A bad config stops twistd before anything starts, with every error
    naming its field and no traceback."""
    p = Proxy({"hosts": [{"name": "a", "url": "ftp://x"}],
               "models": {"m": {"host": "gpu9"}}}, tmp_path, wait_ready=False)
    assert p.popen.wait(30) != 0
    out = p.output()
    assert "hosts[0].url: not an http(s) URL" in out
    assert "models.m.host: no host named 'gpu9'" in out
    assert "Traceback" not in out


def test_busy_port_is_a_clear_error(tmp_path: Path) -> None:
    """A listen address already in use stops twistd with a one-line reason."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = Proxy({"listen": f"127.0.0.1:{port}",
                   "hosts": [{"name": "a", "url": "http://127.0.0.1:9"}]},
                  tmp_path, wait_ready=False)
        assert p.popen.wait(30) != 0
    assert f"cannot listen on 127.0.0.1:{port}" in p.output()
    assert "Traceback" not in p.output()


def test_demo_serves_two_simulated_engines(tmp_path: Path) -> None:
    """The README's demo: `twistd -n llmproxy --demo` serves 127.0.0.1:8080 in
    front of simulated engines on 127.0.0.1:18091 and :18092. Run here on ports
    of its own (the demo config with its ports changed, `--demo -c`), so that it
    never depends on those three being free: it streams a chat completion."""
    doc = json.loads(Path(demo.CONFIG_PATH).read_text())
    assert doc["listen"] == "127.0.0.1:8080"
    assert [h["url"] for h in doc["hosts"]] == ["http://127.0.0.1:18091",
                                                "http://127.0.0.1:18092"]
    doc["listen"] = "127.0.0.1:0"
    for host in doc["hosts"]:
        host["url"] = f"http://127.0.0.1:{free_port()}"
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(doc))
    p = Proc([twistd(), "-n", "--pidfile=", "llmproxy", "--demo", "-c", str(path)], cwd=tmp_path)
    try:
        m = p.wait_for(r"ready: listening on http://127\.0\.0\.1:(\d+) .* from 2 of 2 host")
        conn = http.client.HTTPConnection("127.0.0.1", int(m.group(1)), timeout=10)
        conn.request("POST", "/v1/chat/completions", json.dumps(chat("llama-demo")))
        data = [e for e in events(conn.getresponse())]
        assert data[-1] == "[DONE]" and len(data) > 3
    finally:
        p.stop()
    assert "Server Shut Down." in p.output()


def test_wheel_carries_the_dropin_and_demo(tmp_path: Path) -> None:
    """`pip install .` installs the twistd dropin and the demo config: the wheel has both."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, timeout=120, capture_output=True)
    [wheel] = tmp_path.glob("llmproxy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "twisted/plugins/llmproxy_plugin.py" in names
    assert "llmproxy/testing/demo.json" in names
    assert not any(n.startswith("twisted/plugins/__init__") for n in names)


def test_plain_json_answer_keeps_its_length_and_no_stray_headers(proxy: Proxy) -> None:
    """A non-streamed answer reaches the client with the engine's Content-Length,
    no Transfer-Encoding of its own, and no empty Content-Encoding."""
    resp = post(proxy, "/v1/chat/completions", chat(stream=False),
                {"Accept-Encoding": "identity", "X-Sim-Tokens": "2"})   # answered at 0.1 s
    body = resp.read()
    assert resp.status == 200 and json.loads(body)["object"] == "chat.completion"
    assert resp.getheader("Content-Length") == str(len(body))
    assert resp.getheader("Content-Encoding") is None
    assert resp.getheader("Transfer-Encoding") is None


def test_an_engine_closing_idle_connections_costs_no_request(tmp_path: Path) -> None:
    """An engine that closes keep-alive connections idle for 0.3 s, and a POST
    every 0.3 s (each one racing the engine's close of the connection the last
    one used): 60 requests, 0 failures. The check before reuse drops a
    connection whose close has come; the pool learns the engine's timeout (on
    the fast client); a POST the close crossed, which the engine then reset
    unread, goes once more on a fresh connection (tests/
    test_integration_unread_post.py). (At 0.1 s, a CI machine busy with the
    rest of the suite could starve the engine or the proxy past the timeout
    between a connect and its request: a fresh connection's race, not this.)"""
    engine = SimEngine(["m"], "--idle-timeout", "0.3")
    proxy = Proxy({"hosts": [{"name": "h", "url": engine.url}]}, tmp_path)
    try:
        statuses = []
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        for _ in range(60):
            conn.request("POST", "/v1/chat/completions",
                         json.dumps({"model": "m", "max_tokens": 1}), {"X-Sim-Delay": "0"})
            resp = conn.getresponse()
            resp.read()
            statuses.append(resp.status)
            time.sleep(0.3)
        assert statuses == [200] * 60
    finally:
        proxy.stop()
        engine.stop()


def test_events_an_engine_writes_together_reach_clients_whole_and_in_order(
        tmp_path: Path) -> None:
    """The bench's engine writes a fast stream 32 events per write (its head
    with the first ones): the proxy relays what comes together as it came.
    The openai SDK gets every event in order, a raw HTTP/1.1 client reads
    valid chunked framing with every event and `[DONE]`, and the connection
    carries the next request."""
    import openai

    engine = Proc([sys.executable, "-m", "bench.engine", "--host", "127.0.0.1", "--port", "0"],
                  cwd=ROOT)
    try:
        port = int(engine.wait_for(r"bench engine listening on 127\.0\.0\.1:(\d+)").group(1))
        proxy = Proxy({"hosts": [{"name": "b", "url": f"http://127.0.0.1:{port}"}],
                       "models": {"bench": {"host": "b"}}}, tmp_path)
        try:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused")
            for _ in range(2):
                stream = client.chat.completions.create(
                    model="bench", messages=[{"role": "user", "content": "hi"}], stream=True,
                    extra_headers={"X-Bench-Events": "300"})
                times = [c.model_extra["t"] for c in stream]      # type: ignore[index]
                assert len(times) == 300 and times == sorted(times)
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            for events in (100, 5):
                conn.request("POST", "/v1/chat/completions", json.dumps(
                    {"model": "bench", "stream": True, "messages": []}),
                    {"X-Bench-Events": str(events), "Content-Type": "application/json"})
                resp = conn.getresponse()
                assert resp.status == 200 and resp.getheader("Transfer-Encoding") == "chunked"
                body = resp.read()           # http.client checks the chunked framing
                assert body.count(b"data: {") == events
                assert body.endswith(b"data: [DONE]\n\n")
        finally:
            proxy.stop()
    finally:
        engine.stop()
