"""Tests for llmproxy.testing.simengine, the simulated OpenAI-compatible engine.

Unit tests run a real ``twisted.web.server.Site`` (from ``make_site``) over a
``StringTransport``, with a ``task.Clock`` as the engine clock, so every byte the engine
writes and every moment it writes it are observable without sockets or sleeps. A streamed
response is decoded chunk by chunk: one HTTP chunk per ``request.write``, so "one event per
chunk" proves the engine never buffers events together.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from llmproxy.testing.simengine import SimEngine, embed, main, make_site

MODELS = ("alpha", "beta")


@dataclass
class Response:
    """A parsed (possibly still incomplete) HTTP/1.1 response."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)
    complete: bool = False

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def events(self) -> list[Any]:
        """The SSE payloads, asserting each HTTP chunk carries exactly one event."""
        out: list[Any] = []
        for chunk in self.chunks:
            assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n"), chunk
            payload = chunk[len(b"data: ") : -2]
            assert b"\n\n" not in payload, f"two events in one write: {chunk!r}"
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        return out


def parse(raw: bytes) -> Response | None:
    """Decode what the engine has written so far; None before the headers are out."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    resp = Response(int(lines[0].split()[1]), headers)
    if headers.get("transfer-encoding") == "chunked":
        while rest:
            size_line, sep, after = rest.partition(b"\r\n")
            if not sep:
                break
            size = int(size_line, 16)
            if size == 0:
                resp.complete = after == b"\r\n"
                break
            assert len(after) >= size + 2, "a chunk was written in pieces"
            resp.chunks.append(after[:size])
            rest = after[size + 2 :]
        resp.body = b"".join(resp.chunks)
    else:
        resp.body = rest
        resp.complete = len(rest) == int(headers["content-length"])
    return resp


class Conn:
    """One client connection to the engine's Site over a StringTransport."""

    def __init__(self, engine: SimEngine) -> None:
        self.channel = make_site(engine).buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
        self.transport = StringTransport()
        self.channel.makeConnection(self.transport)

    def send(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> Conn:
        data = raw if raw is not None else b"" if body is None else json.dumps(body).encode()
        lines = [f"{method} {path} HTTP/1.1", "Host: engine", f"Content-Length: {len(data)}"]
        if body is not None:
            lines.append("Content-Type: application/json")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.channel.dataReceived("\r\n".join(lines).encode() + b"\r\n\r\n" + data)
        return self

    @property
    def response(self) -> Response | None:
        return parse(self.transport.value())

    @property
    def got(self) -> Response:
        """The response so far, which must have started."""
        resp = self.response
        assert resp is not None, "no response yet"
        return resp

    def aborted(self) -> bool:
        """Whether the engine aborted the connection (StringTransport calls that disconnected)."""
        return bool(self.transport.disconnected)

    def lose(self) -> None:
        """The client goes away."""
        self.channel.connectionLost(Failure(ConnectionDone()))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def engine(clock: Clock) -> SimEngine:
    return SimEngine(MODELS, clock, delay=1.0, tokens=3)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "alpha", "messages": [{"role": "user", "content": "hi there"}], **extra}


def answer(engine: SimEngine, method: str, path: str, **kw: Any) -> Response:
    """Send one request and return its (immediate) answer."""
    resp = Conn(engine).send(method, path, **kw).response
    assert resp is not None and resp.complete
    return resp


def test_health(engine: SimEngine) -> None:
    """GET /health answers 200 {"status": "ok"} with a Content-Length."""
    resp = answer(engine, "GET", "/health")
    assert (resp.status, resp.json()) == (200, {"status": "ok"})
    assert resp.headers["content-length"] == str(len(resp.body))


def test_health_fails_on_demand(clock: Clock, tmp_path: Path) -> None:
    """--health-file: while the file exists /health answers the status it holds (503 with
    llama-server's loading body when it holds none), never when it says hang; --hang-after:
    from then on (engine clock) /health never answers."""
    control = tmp_path / "health"
    engine = SimEngine(MODELS, clock, health_file=str(control), hang_at=10.0)
    assert answer(engine, "GET", "/health").status == 200
    control.write_text("")
    resp = answer(engine, "GET", "/health")
    assert (resp.status, resp.json()["error"]["message"]) == (503, "Loading model")
    control.write_text("500\n")
    assert answer(engine, "GET", "/health").status == 500
    control.write_text("hang")
    assert Conn(engine).send("GET", "/health").response is None
    control.unlink()
    assert answer(engine, "GET", "/health").status == 200
    clock.advance(10)
    hung = Conn(engine).send("GET", "/health")
    clock.advance(60)
    assert hung.response is None and not hung.aborted()


def test_models_list(engine: SimEngine, clock: Clock) -> None:
    """GET /v1/models lists every model in order with the engine's context size."""
    clock.advance(1234)
    body = answer(engine, "GET", "/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == list(MODELS)
    assert body["data"][0] == {
        "id": "alpha",
        "object": "model",
        "created": 1234,
        "owned_by": "simengine",
        "meta": {"n_ctx_train": 4096},
    }


def test_stream_writes_one_event_per_delay(engine: SimEngine, clock: Clock) -> None:
    """Streamed events go out one per delay, each as its own write, none early."""
    conn = Conn(engine).send("POST", "/v1/chat/completions", chat(stream=True))

    def events() -> int:
        resp = conn.response
        assert resp is not None
        return len(resp.events)

    assert events() == 1  # headers and the role chunk, at once
    for expected in (2, 3):
        clock.advance(0.999)
        assert events() == expected - 1
        clock.advance(0.001)
        assert events() == expected
    clock.advance(0.999)
    assert events() == 3 and not conn.got.complete
    clock.advance(0.001)
    assert events() == 6 and conn.got.complete  # tok2, stop, [DONE]


def test_stream_exact_sequence(engine: SimEngine, clock: Clock) -> None:
    """A chat stream is role chunk, tok0..tokN-1, stop chunk, [DONE], then a clean chunked end."""
    conn = Conn(engine).send("POST", "/v1/chat/completions", chat(stream=True))
    clock.pump([1.0] * 3)
    resp = conn.response
    assert resp is not None and resp.complete and resp.status == 200
    assert resp.headers["content-type"] == "text/event-stream"
    assert resp.headers["cache-control"] == "no-cache"
    assert "content-length" not in resp.headers
    events = resp.events
    assert events[-1] == "[DONE]"
    deltas = [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events[:-1]]
    assert deltas == [
        ({"role": "assistant"}, None),
        ({"content": "tok0 "}, None),
        ({"content": "tok1 "}, None),
        ({"content": "tok2 "}, None),
        ({}, "stop"),
    ]
    for e in events[:-1]:
        assert (e["id"], e["object"], e["model"]) == (
            "chatcmpl-1",
            "chat.completion.chunk",
            "alpha",
        )
    assert engine.requests[0]["outcome"] == "completed"
    assert engine.requests[0]["chunks_sent"] == 3


def test_text_completion_stream(engine: SimEngine, clock: Clock) -> None:
    """/v1/completions streams text_completion chunks in order and ends with [DONE]."""
    body = {"model": "beta", "prompt": "once upon", "stream": True}
    conn = Conn(engine).send("POST", "/v1/completions", body)
    resp = conn.response
    assert resp is not None and resp.status == 200 and resp.events == []
    clock.pump([1.0] * 3)
    resp = conn.response
    assert resp is not None and resp.complete
    *chunks, done = resp.events
    assert done == "[DONE]"
    assert [c["choices"][0]["text"] for c in chunks] == ["tok0 ", "tok1 ", "tok2 ", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert {c["object"] for c in chunks} == {"text_completion"}


def test_non_stream_chat(engine: SimEngine, clock: Clock) -> None:
    """A non-streamed chat answers after N*delay, once, with Content-Length and usage."""
    conn = Conn(engine).send("POST", "/v1/chat/completions", chat())
    clock.advance(2.999)
    assert conn.transport.value() == b""
    clock.advance(0.001)
    resp = conn.response
    assert resp is not None and resp.complete and resp.status == 200
    assert resp.headers["content-type"] == "application/json"
    assert resp.headers["content-length"] == str(len(resp.body))
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "tok0 tok1 tok2 "}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert engine.requests[0]["outcome"] == "completed"


def test_non_stream_completion(engine: SimEngine, clock: Clock) -> None:
    """A non-streamed text completion carries the whole text in choices[0].text."""
    conn = Conn(engine).send("POST", "/v1/completions", {"model": "alpha", "prompt": "x"})
    clock.pump([1.0] * 3)
    body = conn.got.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "tok0 tok1 tok2 "


def test_max_tokens_and_sim_tokens(engine: SimEngine, clock: Clock) -> None:
    """max_tokens sets the number of content chunks; X-Sim-Tokens overrides it."""
    a = Conn(engine).send("POST", "/v1/chat/completions", chat(stream=True, max_tokens=5))
    b = Conn(engine).send(
        "POST", "/v1/chat/completions", chat(stream=True, max_tokens=5), {"X-Sim-Tokens": "1"}
    )
    clock.pump([1.0] * 10)
    assert len(a.got.events) == 1 + 5 + 2
    assert len(b.got.events) == 1 + 1 + 2


def test_sim_delay_overrides_default(engine: SimEngine, clock: Clock) -> None:
    """X-Sim-Delay sets the gap between chunks for that request only."""
    conn = Conn(engine).send(
        "POST", "/v1/chat/completions", chat(stream=True), {"X-Sim-Delay": "0.25"}
    )
    clock.advance(0.25)
    assert len(conn.got.events) == 2
    clock.pump([0.25, 0.25])
    assert conn.got.complete


def test_die_after_aborts_stream(engine: SimEngine, clock: Clock) -> None:
    """X-Sim-Die-After k sends k content chunks, then aborts: no stop chunk, no [DONE]."""
    conn = Conn(engine).send(
        "POST", "/v1/chat/completions", chat(stream=True), {"X-Sim-Die-After": "2"}
    )
    clock.pump([1.0] * 2)
    assert len(conn.got.events) == 3 and not conn.aborted()
    clock.advance(1)
    resp = conn.response
    assert resp is not None and not resp.complete
    assert [e["choices"][0]["delta"] for e in resp.events] == [
        {"role": "assistant"},
        {"content": "tok0 "},
        {"content": "tok1 "},
    ]
    assert conn.aborted()
    conn.lose()  # the transport reports the abort
    assert (engine.requests[0]["outcome"], engine.requests[0]["chunks_sent"]) == ("died", 2)
    assert clock.getDelayedCalls() == []


def test_die_after_all_tokens_withholds_the_end(engine: SimEngine, clock: Clock) -> None:
    """Die-after equal to the token count sends every content chunk but never the end."""
    conn = Conn(engine).send(
        "POST", "/v1/chat/completions", chat(stream=True), {"X-Sim-Die-After": "3"}
    )
    clock.pump([1.0] * 3)
    assert len(conn.got.events) == 4 and not conn.aborted()
    clock.advance(1)
    assert conn.aborted() and not conn.got.complete
    assert len(conn.got.events) == 4


def test_die_after_non_stream(engine: SimEngine, clock: Clock) -> None:
    """Without streaming, X-Sim-Die-After aborts the connection instead of answering."""
    conn = Conn(engine).send("POST", "/v1/chat/completions", chat(), {"X-Sim-Die-After": "0"})
    clock.pump([1.0] * 3)
    assert conn.aborted() and conn.transport.value() == b""
    assert engine.requests[0]["outcome"] == "died"


def test_client_gone_mid_stream(engine: SimEngine, clock: Clock) -> None:
    """A client that leaves mid-stream cancels every timer; nothing is written afterwards."""
    conn = Conn(engine).send("POST", "/v1/chat/completions", chat(stream=True))
    clock.advance(1)
    assert engine.requests[0]["chunks_sent"] == 1
    conn.lose()
    assert clock.getDelayedCalls() == []
    written = conn.transport.value()
    clock.pump([1.0] * 100)
    assert conn.transport.value() == written
    assert (engine.requests[0]["outcome"], engine.requests[0]["chunks_sent"]) == ("client-gone", 1)


def test_client_gone_before_answer(engine: SimEngine, clock: Clock) -> None:
    """A client that leaves before a non-streamed answer gets nothing and is recorded gone."""
    conn = Conn(engine).send("POST", "/v1/chat/completions", chat())
    clock.advance(1)
    conn.lose()
    assert clock.getDelayedCalls() == []
    clock.pump([1.0] * 100)
    assert conn.transport.value() == b""
    assert engine.requests[0]["outcome"] == "client-gone"


def test_header_delay(engine: SimEngine, clock: Clock) -> None:
    """X-Sim-Header-Delay holds back even the status line, then the stream runs as usual."""
    conn = Conn(engine).send(
        "POST", "/v1/chat/completions", chat(stream=True), {"X-Sim-Header-Delay": "5"}
    )
    clock.advance(4.999)
    assert conn.transport.value() == b""
    clock.advance(0.001)
    resp = conn.response
    assert resp is not None and resp.status == 200 and len(resp.events) == 1
    clock.advance(1)
    assert len(conn.got.events) == 2


def test_header_delay_client_gone(engine: SimEngine, clock: Clock) -> None:
    """A client that times out during the header delay never gets a byte."""
    conn = Conn(engine).send("POST", "/v1/chat/completions", chat(), {"X-Sim-Header-Delay": "5"})
    clock.pump([1.0] * 2)
    conn.lose()
    clock.pump([1.0] * 100)
    assert conn.transport.value() == b""
    assert engine.requests[0]["outcome"] == "client-gone"


@pytest.mark.parametrize("model", ["alpha", "nope"])
def test_status_override(engine: SimEngine, model: str) -> None:
    """X-Sim-Status answers at once with that status and the simulated-failure body."""
    resp = answer(
        engine,
        "POST",
        "/v1/chat/completions",
        body=chat(model=model),
        headers={"X-Sim-Status": "503"},
    )
    assert resp.status == 503
    assert resp.json() == {
        "error": {"message": "simulated failure", "type": "server_error", "code": 503}
    }
    assert engine.requests[0]["status"] == 503


def test_unknown_model(engine: SimEngine) -> None:
    """An unknown model is a 404 model_not_found error in OpenAI shape."""
    resp = answer(engine, "POST", "/v1/chat/completions", body=chat(model="x"))
    assert resp.status == 404
    assert resp.json() == {
        "error": {
            "message": "model 'x' not found",
            "type": "invalid_request_error",
            "code": "model_not_found",
        }
    }


def test_bad_json(engine: SimEngine) -> None:
    """A body that is not JSON is a 400 in the same error shape, and is still recorded."""
    resp = answer(engine, "POST", "/v1/chat/completions", raw=b"{nope")
    assert resp.status == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert engine.requests[0]["body"] is None


def test_bad_sim_header(engine: SimEngine) -> None:
    """An unparsable X-Sim-* header is a 400 naming the header."""
    resp = answer(
        engine, "POST", "/v1/chat/completions", body=chat(), headers={"X-Sim-Tokens": "many"}
    )
    assert resp.status == 400 and "X-Sim-Tokens" in resp.json()["error"]["message"]


def test_unknown_path_and_wrong_method(engine: SimEngine) -> None:
    """Unknown paths are 404 and wrong methods 405 (with Allow), both as JSON errors."""
    resp = answer(engine, "GET", "/v2/nothing")
    assert resp.status == 404 and resp.json()["error"]["code"] == "not_found"
    resp = answer(engine, "GET", "/v1/chat/completions")
    assert resp.status == 405 and resp.headers["allow"] == "POST"
    assert resp.json()["error"]["code"] == "method_not_allowed"
    assert engine.requests == []


def test_embeddings(engine: SimEngine) -> None:
    """Embeddings give 8 deterministic floats per input, equal texts equal vectors."""
    one = answer(engine, "POST", "/v1/embeddings", body={"model": "beta", "input": "hello"}).json()
    many = answer(
        engine, "POST", "/v1/embeddings", body={"model": "beta", "input": ["a b", "hello"]}
    ).json()
    assert one["object"] == "list" and one["model"] == "beta"
    assert one["data"] == [{"object": "embedding", "index": 0, "embedding": embed("hello")}]
    assert [d["index"] for d in many["data"]] == [0, 1]
    assert many["data"][1]["embedding"] == one["data"][0]["embedding"]
    assert many["data"][0]["embedding"] != many["data"][1]["embedding"]
    assert many["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    vec = embed("hello")
    assert len(vec) == 8 and all(-1 <= x <= 1 for x in vec)
    bad = answer(engine, "POST", "/v1/embeddings", body={"model": "beta", "input": 3})
    assert bad.status == 400


def test_records_and_reset(engine: SimEngine, clock: Clock) -> None:
    """/sim/requests lists each POST as received and as it goes; /sim/reset clears them."""
    body = chat(stream=True)
    Conn(engine).send("POST", "/v1/chat/completions", body, {"X-Trace": "t1"})
    clock.advance(1)
    records = answer(engine, "GET", "/sim/requests").json()
    assert len(records) == 1
    rec = records[0]
    assert {k: rec[k] for k in ("id", "method", "path", "model", "body")} == {
        "id": 1,
        "method": "POST",
        "path": "/v1/chat/completions",
        "model": "alpha",
        "body": body,
    }
    assert rec["headers"]["x-trace"] == "t1"
    assert rec["headers"]["content-type"] == "application/json"
    assert (rec["chunks_sent"], rec["outcome"]) == (1, "running")
    answer(engine, "GET", "/health")  # GETs are not recorded
    assert len(engine.requests) == 1
    assert answer(engine, "POST", "/sim/reset").status == 200
    assert answer(engine, "GET", "/sim/requests").json() == []
    answer(engine, "POST", "/v1/embeddings", body={"model": "beta", "input": "x"})
    assert engine.requests[0]["id"] == 2


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 8), die=st.one_of(st.none(), st.integers(0, 10)))
def test_stream_shape_property(n: int, die: int | None) -> None:
    """For any token count and die-after, a stream is role + min(n, k) ordered chunks, then
    the clean end (stop, [DONE]) only when the engine does not die."""
    clock = Clock()
    engine = SimEngine(MODELS, clock, delay=0.5, tokens=n)
    headers = {} if die is None else {"X-Sim-Die-After": str(die)}
    conn = Conn(engine).send("POST", "/v1/chat/completions", chat(stream=True), headers)
    clock.pump([0.5] * (n + 2))
    resp = conn.response
    assert resp is not None
    dies = die is not None and die <= n
    sent = min(n, die) if dies and die is not None else n
    contents = [e["choices"][0]["delta"].get("content") for e in resp.events[1 : 1 + sent]]
    assert contents == [f"tok{i} " for i in range(sent)]
    assert resp.complete is not dies and conn.aborted() is dies
    assert (resp.events[-1] == "[DONE]") is not dies
    assert len(resp.events) == 1 + sent + (0 if dies else 2)
    conn.lose()  # also cancels the channel's keep-alive timeout
    assert clock.getDelayedCalls() == []


@pytest.mark.integration
def test_main_serves_a_stream_and_exits_on_sigterm() -> None:
    """The console script listens on a real port, streams a completion, and exits on SIGTERM."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    args = ["--port", "0", "--models", "a,b", "--delay", "0.01", "--tokens", "3"]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from llmproxy.testing.simengine import main; main()", *args],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("simengine listening on http://127.0.0.1:"), line
        assert line.rstrip().endswith(" models=a,b")
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "b", "messages": [], "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        body = resp.read().decode()
        assert body.count("data: ") == 6 and body.endswith("data: [DONE]\n\n")
        conn.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_main_rejects_empty_models() -> None:
    """main() refuses to start without a model name (argparse exits with status 2)."""
    with pytest.raises(SystemExit) as exc:
        main(["--models", " , "])
    assert exc.value.code == 2


def test_each_record_says_when_its_request_started_and_ended(engine: SimEngine,
                                                            clock: Clock) -> None:
    """`started` is the engine clock when the request arrived, `ended` None while it
    runs, then the clock when it ended (so overlaps can be counted from the record)."""
    clock.advance(100)
    Conn(engine).send("POST", "/v1/chat/completions", chat(stream=True),
                      {"X-Sim-Tokens": "3", "X-Sim-Delay": "1"})
    [rec] = engine.requests
    assert (rec["started"], rec["ended"]) == (100, None)
    clock.pump([1, 1, 1])
    assert (rec["outcome"], rec["ended"]) == ("completed", 103)
