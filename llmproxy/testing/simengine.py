"""A simulated OpenAI-compatible LLM engine, the upstream behind the proxy in demos and tests.

It answers like llama.cpp's llama-server (``/health``, ``/v1/models``, chat and text
completions with SSE streaming, embeddings) on an injected clock, and records every POST in
``GET /sim/requests`` so tests can see what the proxy forwarded and whether it cancelled the
upstream; each record has ``started`` and ``ended`` (engine clock seconds; ``ended`` None while
it runs), so how many requests the engine served at once can be read from its own record.
Request headers override the engine defaults for one request (the proxy forwards them):

- ``X-Sim-Delay: s`` seconds between content chunks; ``X-Sim-Tokens: n`` content chunks.
- ``X-Sim-Header-Delay: s`` wait before sending anything, status line included.
- ``X-Sim-Die-After: k`` stream k content chunks, then one delay later abort the connection
  (no stop chunk, no ``[DONE]``); k > n streams normally. Without streaming: abort, no answer.
- ``X-Sim-Status: code`` answer at once with that status and a ``server_error`` body.

A streamed request with ``"stream_options": {"include_usage": true}`` gets, as from OpenAI, a
last chunk with no choices and the ``usage`` (non-streamed answers always carry it).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from llmproxy.testing import simextra, simslots
from llmproxy.testing.simanswers import (
    Controls,
    JSONDict,
    count_words,
    embed,
    sim_error,
    word,
    words,
)

_API_POST = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET", "HEAD"),
    "/v1/models": ("GET", "HEAD"),
    **{path: ("POST",) for path in _API_POST},
    "/sim/requests": ("GET", "HEAD"),
    "/sim/reset": ("POST",),
    **simextra.ROUTES,    # Anthropic messages, multipart audio, llama-server's own routes
}


@dataclass
class SimEngine:
    """What the simulated engine serves, its defaults, its clock and its request record."""

    models: tuple[str, ...]
    clock: IReactorTime
    ctx: int = 4096
    delay: float = 0.05
    tokens: int = 16
    api_key: str | None = None     # required as a Bearer (not on /health), as llama-server's
    health_file: str | None = None  # /health as this file says (simextra.health_status)
    hang_at: float | None = None    # from then on (engine clock), /health never answers
    slots: simslots.SimSlots | None = None   # llama-server's slot API (simslots)
    requests: list[JSONDict] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    def __post_init__(self) -> None:
        self.models = tuple(self.models)

    def new_record(self, method: str, path: str, body: Any, headers: dict[str, str]) -> JSONDict:
        """Append and return the record of one POST, which the exchange updates as it goes."""
        model = body.get("model") if isinstance(body, dict) else None
        record: JSONDict = {"id": next(self._ids), "method": method, "path": path, "model": model,
                            "body": body, "headers": headers, "chunks_sent": 0, "status": None,
                            "outcome": "running", "started": self.clock.seconds(),
                            "ended": None}
        self.requests.append(record)
        return record


class _Exchange:
    """One request in flight: its timers, its record, and no writes once the client is gone."""

    log = Logger()

    def __init__(self, engine: SimEngine, request: Request, record: JSONDict) -> None:
        self.engine = engine
        self.request = request
        self.record = record
        self.calls: list[IDelayedCall] = []
        self.done = False
        request.notifyFinish().addErrback(self._client_gone)

    def later(self, delay: float, f: Callable[..., object], *args: object) -> None:
        """Run ``f`` after ``delay`` seconds of the engine clock, unless the client goes away."""
        self.calls = [c for c in self.calls if c.active()]
        self.calls.append(self.engine.clock.callLater(delay, f, *args))

    def _client_gone(self, reason: Failure) -> None:
        for call in self.calls:
            if call.active():
                call.cancel()
        self._end("client-gone")

    def _end(self, outcome: str) -> bool:
        """Mark the exchange over and log it; False if it already was."""
        if self.done:
            return False
        self.done = True
        self.record["outcome"] = outcome
        if "ended" in self.record:
            self.record["ended"] = self.engine.clock.seconds()
        self.log.info(
            "simengine {method} {path} #{id} model={model} status={status} chunks={chunks_sent}"
            " outcome={outcome}",
            method=self.request.method.decode("ascii", "replace"),
            path=self.request.path.decode("ascii", "replace"),
            status=self.request.code,
            **{k: self.record[k] for k in ("id", "model", "chunks_sent", "outcome")},
        )
        return True

    def start(self, status: int, content_type: bytes, length: int | None = None) -> None:
        """Set the status line and headers (sent with the first write)."""
        self.request.setResponseCode(status)
        self.request.responseHeaders.setRawHeaders(b"Content-Type", [content_type])
        if length is not None:
            self.request.responseHeaders.setRawHeaders(b"Content-Length", [b"%d" % length])
        self.record["status"] = status

    def write(self, data: bytes) -> None:
        if not self.done:
            self.request.write(data)  # type: ignore[no-untyped-call,unused-ignore]

    def reply(self, status: int, obj: Any) -> None:
        """Answer with one JSON document, Content-Length set, and finish."""
        if not self.done:
            data = json.dumps(obj).encode("utf-8")
            self.start(status, b"application/json", len(data))
            self.write(data)
            self.finish()

    def finish(self) -> None:
        if self._end("completed"):
            self.request.finish()  # type: ignore[no-untyped-call,unused-ignore]

    def die(self) -> None:
        """Simulate an engine crash: drop the TCP connection with no clean end of the body."""
        if self._end("died"):
            self.request.transport.abortConnection()  # type: ignore[union-attr]


class _EngineResource(Resource):
    """The whole HTTP surface of the simulated engine, routed by exact path."""

    isLeaf = True

    def __init__(self, engine: SimEngine) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.engine = engine

    def render(self, request: Request) -> bytes | int:
        path = request.path.decode("utf-8", "replace")
        method = request.method.decode("ascii", "replace")
        if self.engine.slots is not None and (path == "/slots" or path.startswith("/slots/")):
            return self.engine.slots.render(request, path)
        allowed = _ROUTES.get(path)
        if allowed is None:
            return self._now(request, 404, sim_error(f"no route for {path}", "not_found"))
        if method not in allowed:
            request.responseHeaders.setRawHeaders(b"Allow", [", ".join(allowed).encode("ascii")])
            message = f"method {method} not allowed on {path}"
            return self._now(request, 405, sim_error(message, "method_not_allowed"))
        denied = None if path.startswith("/sim/") else simextra.refused(
            self.engine.api_key, request, path)
        if denied is not None:
            return self._now(request, 401, denied)
        if path == "/sim/requests":
            return self._now(request, 200, self.engine.requests)
        if path == "/sim/reset":
            self.engine.requests.clear()
            return self._now(request, 200, {"status": "ok"})
        return self._serve(request, path, method)

    def _now(self, request: Request, status: int, obj: Any) -> bytes:
        request.setResponseCode(status)
        request.responseHeaders.setRawHeaders(b"Content-Type", [b"application/json"])
        return json.dumps(obj).encode("utf-8")

    def _serve(self, request: Request, path: str, method: str) -> int:
        """Answer an engine API request, after ``X-Sim-Header-Delay`` if asked."""
        body: Any = None
        record: JSONDict = {"id": 0, "model": None, "chunks_sent": 0}  # GETs are not recorded
        if method == "POST":
            raw = request.content.read() if request.content is not None else b""
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            headers = {
                name.decode("latin-1").lower(): ", ".join(v.decode("latin-1") for v in values)
                for name, values in request.requestHeaders.getAllRawHeaders()
            }
            record = self.engine.new_record(method, path, body, headers)
        controls = Controls.parse(request, self.engine.delay)
        ex = _Exchange(self.engine, request, record)
        if controls.header_delay > 0:
            ex.later(controls.header_delay, self._answer, ex, path, body, controls)
        else:
            self._answer(ex, path, body, controls)
        return NOT_DONE_YET

    def _answer(self, ex: _Exchange, path: str, body: Any, controls: Controls) -> None:
        engine = self.engine
        if controls.status is not None:
            ex.reply(controls.status,
                     sim_error("simulated failure", controls.status, "server_error"))
        elif controls.problems:
            ex.reply(400, sim_error("; ".join(controls.problems), "bad_sim_header"))
        elif path == "/health":
            simextra.health(engine, ex)
        elif path == "/v1/models":
            created = int(engine.clock.seconds())
            meta = {"n_ctx_train": engine.ctx}
            models = [{"id": m, "object": "model", "created": created} for m in engine.models]
            data = [{**m, "owned_by": "simengine", "meta": meta} for m in models]
            ex.reply(200, {"object": "list", "data": data})
        elif path in simextra.ROUTES:
            simextra.answer(engine, ex, path, body, controls)
        elif not isinstance(body, dict):
            ex.reply(400, sim_error("request body is not a JSON object", "invalid_json"))
        elif body.get("model") not in engine.models:
            message = f"model {body.get('model')!r} not found"
            ex.reply(404, sim_error(message, "model_not_found"))
        elif path == "/v1/embeddings":
            self._embeddings(ex, body, controls)
        else:
            self._completion(ex, path, body, controls)

    def _embeddings(self, ex: _Exchange, body: JSONDict, controls: Controls) -> None:
        inputs = body.get("input")
        texts = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            message = "'input' must be a string or a list of strings"
            ex.reply(400, sim_error(message, "invalid_input"))
        elif controls.die_after is not None:
            ex.die()
        else:
            data = [{"object": "embedding", "index": i, "embedding": embed(t)}
                    for i, t in enumerate(texts)]
            n = count_words(texts)
            usage = {"prompt_tokens": n, "total_tokens": n}
            ex.reply(200, {"object": "list", "data": data, "model": body["model"], "usage": usage})

    def _completion(self, ex: _Exchange, path: str, body: JSONDict, controls: Controls) -> None:
        chat = path == "/v1/chat/completions"
        max_tokens = body.get("max_tokens")
        if controls.tokens is not None:
            n = controls.tokens
        elif isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 0:
            n = max_tokens
        else:
            n = self.engine.tokens
        prompt = count_words(body.get("messages") if chat else body.get("prompt"))
        stream = _Stream(
            ex=ex,
            chat=chat,
            n=n,
            delay=controls.delay,
            die_after=controls.die_after,
            head={"id": f"{'chatcmpl' if chat else 'cmpl'}-{ex.record['id']}",
                  "created": int(self.engine.clock.seconds()), "model": body["model"]},
            usage={"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n},
            stream_usage=isinstance(body.get("stream_options"), dict)
            and body["stream_options"].get("include_usage") is True,
        )
        if self.engine.slots is not None:   # as llama-server: the prompt words processed
            words = simslots.prompt_words(body.get("messages") if chat else body.get("prompt"))
            stream.timings = {"prompt_n": self.engine.slots.use(words)}
        if body.get("stream") is True:
            stream.begin()
        elif controls.die_after is not None:
            ex.later(n * controls.delay, ex.die)
        else:
            ex.later(n * controls.delay, stream.whole)


@dataclass
class _Stream:
    """Produces one completion, either as SSE events on a timer or as one JSON answer."""

    ex: _Exchange
    chat: bool
    n: int
    delay: float
    die_after: int | None
    head: JSONDict  # id, created, model
    usage: JSONDict
    stream_usage: bool = False   # stream_options.include_usage: a last chunk with usage
    timings: JSONDict | None = None   # llama-server's, on a non-streamed answer
    sent: int = 0

    def _obj(self, kind: str, choice: JSONDict) -> JSONDict:
        return {**self.head, "object": kind, "choices": [{"index": 0, **choice}]}

    def _chunk(self, delta: JSONDict, finish: str | None = None) -> JSONDict:
        if self.chat:
            return self._obj("chat.completion.chunk", {"delta": delta, "finish_reason": finish})
        text = delta.get("content", "")
        choice = {"text": text, "logprobs": None, "finish_reason": finish}
        return self._obj("text_completion", choice)

    def _event(self, obj: JSONDict | str) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj)
        self.ex.write(b"data: " + payload.encode("utf-8") + b"\n\n")

    def whole(self) -> None:
        """Answer a non-streaming request with the full completion."""
        text = "".join(words(self.n))
        if self.chat:
            choice = {"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            obj = {**self._obj("chat.completion", choice), "usage": self.usage}
        else:
            obj = {**self._chunk({"content": text}, "stop"), "usage": self.usage}
        if self.timings is not None:
            obj["timings"] = self.timings
        self.ex.record["chunks_sent"] = self.n
        self.ex.reply(200, obj)

    def begin(self) -> None:
        """Send the headers and the role chunk, then one content chunk per ``delay``."""
        self.ex.start(200, b"text/event-stream")
        self.ex.request.responseHeaders.setRawHeaders(b"Cache-Control", [b"no-cache"])
        if self.chat:
            self._event(self._chunk({"role": "assistant"}))
        else:
            self.ex.write(b"")  # text completions have no role chunk: send just the headers
        self._advance()

    def _advance(self) -> None:
        # An engine told to die after k chunks stops writing and aborts one delay later,
        # where chunk k+1 or the end would have been.
        if self.sent < self.n or self.die_after == self.sent:
            self.ex.later(self.delay, self._tick)
        else:
            self._event(self._chunk({}, "stop"))
            if self.stream_usage:   # as OpenAI does: no choices, just the usage
                kind = "chat.completion.chunk" if self.chat else "text_completion"
                self._event({**self.head, "object": kind, "choices": [], "usage": self.usage})
            self._event("[DONE]")
            self.ex.finish()

    def _tick(self) -> None:
        if self.die_after == self.sent:
            self.ex.die()
            return
        self._event(self._chunk({"content": word(self.sent)}))
        self.sent += 1
        self.ex.record["chunks_sent"] = self.sent
        self._advance()


def make_site(engine: SimEngine, idle_timeout: float | None = None) -> Site:
    """A web site serving ``engine``; its connection timeouts run on the engine's clock too.
    `idle_timeout`: close a keep-alive connection idle that long (as engines do)."""
    site = Site(_EngineResource(engine), reactor=engine.clock)  # type: ignore[no-untyped-call,unused-ignore]
    if idle_timeout is not None:
        site.timeOut = idle_timeout
    return site


def main(argv: list[str] | None = None) -> None:
    """Console script ``llmproxy-simengine``: serve a simulated engine until SIGTERM/SIGINT
    (the command line is in `simserve`)."""
    from llmproxy.testing.simserve import serve

    serve(argv)


if __name__ == "__main__":
    main()
