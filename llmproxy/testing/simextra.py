"""More of llama-server in the simulated engine (see `simengine`): the
Anthropic Messages API, multipart audio, the routes outside `/v1/`, a required
API key (`--api-key`, as llama-server's), https (`--tls-cert`, `--tls-key`),
and a health that fails on demand for supervision tests:

- ``--health-file PATH``: while PATH exists, ``GET /health`` answers the status
  written in it (``503`` with llama-server's "Loading model" body by default),
  or never answers when it says ``hang``;
- ``--hang-after S``: from S seconds after start, ``GET /health`` never answers
  (an engine stuck with its process alive).

- ``POST /v1/messages``: a non-streamed message, or with ``"stream": true`` the
  Anthropic SSE events (message_start, content_block_start, content_block_delta
  per word, content_block_stop, message_delta, message_stop);
  ``POST /v1/messages/count_tokens``: ``{"input_tokens": n}``.
- ``POST /v1/audio/transcriptions`` and ``/translations``: multipart with a
  ``model`` and a ``file``; the record gets ``model``, ``fields`` and ``file``
  (filename, size, sha256) so a test sees what arrived.
- ``/rerank``, ``/v1/rerank``, ``/tokenize``, ``/detokenize``, ``/infill``,
  ``/embedding``: answer ``{"route": path, "model": model}``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
from typing import Any, cast

from python_multipart.multipart import MultipartParser, parse_options_header
from twisted.internet import ssl
from twisted.web.server import Request, Site

from llmproxy.testing.simanswers import JSONDict, count_words, sim_error, words

MESSAGES = ("/v1/messages", "/v1/messages/count_tokens")
AUDIO = ("/v1/audio/transcriptions", "/v1/audio/translations")
LLAMA = ("/rerank", "/v1/rerank", "/tokenize", "/detokenize", "/infill", "/embedding")
ROUTES = {path: ("POST",) for path in (*MESSAGES, *AUDIO, *LLAMA)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", help="require Authorization: Bearer KEY (not on /health)")
    parser.add_argument("--tls-cert", help="serve https with this PEM certificate chain")
    parser.add_argument("--tls-key", help="... and this PEM private key")
    parser.add_argument("--health-file", help="while this file exists, /health answers the "
                        "status written in it (503 if none), or never when it says hang")
    parser.add_argument("--hang-after", type=float, default=None,
                        help="from this many seconds after start, /health never answers")


def health_status(health_file: str | None, hang_at: float | None, now: float) -> int | None:
    """What ``GET /health`` answers now: a status, or None for never."""
    if hang_at is not None and now >= hang_at:
        return None
    if health_file is None:
        return 200
    try:
        with open(health_file) as f:
            said = f.read().strip()
    except OSError:
        return 200
    if said == "hang":
        return None
    return int(said) if said.isdigit() and 100 <= int(said) <= 599 else 503


def health(engine: Any, ex: Any) -> None:
    """Answer ``GET /health`` as `health_status` says (a hang leaves the exchange open)."""
    status = health_status(engine.health_file, engine.hang_at, engine.clock.seconds())
    if status == 200:
        ex.reply(200, {"status": "ok"})
    elif status is not None:
        ex.reply(status, {"error": {"code": status, "message": "Loading model",
                                    "type": "unavailable_error"}})


def listen(reactor: Any, site: Site, args: argparse.Namespace) -> tuple[Any, str]:
    """Listen as the arguments say; the port and its scheme."""
    if args.tls_cert:
        with open(args.tls_cert, "rb") as c, open(args.tls_key or args.tls_cert, "rb") as k:
            options = ssl.PrivateCertificate.loadPEM(c.read() + b"\n" + k.read()).options()
        return reactor.listenSSL(args.port, site, options, interface=args.host), "https"
    return reactor.listenTCP(args.port, site, interface=args.host), "http"


def refused(api_key: str | None, request: Request, path: str) -> JSONDict | None:
    """The 401 body when the engine wants a key and did not get it (as
    llama-server: /health needs none)."""
    if api_key is None or path == "/health":
        return None
    sent = request.getHeader("authorization") or ""
    if hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
        return None
    return sim_error("Invalid API Key", "invalid_api_key", "authentication_error")


def answer(engine: Any, ex: Any, path: str, body: Any, controls: Any) -> Any:
    """Answer one of this module's routes (`ex` is simengine's exchange)."""
    if path in AUDIO:
        return _audio(engine, ex)
    if not isinstance(body, dict):
        return ex.reply(400, sim_error("request body is not a JSON object", "invalid_json"))
    model = body.get("model")
    ex.record["model"] = model
    if path in LLAMA:
        return ex.reply(200, {"route": path, "model": model})
    if model not in engine.models:
        return ex.reply(404, {"type": "error", "error": {
            "type": "not_found_error", "message": f"model: {model}"}})
    prompt = count_words(body.get("messages")) + count_words(body.get("system"))
    if path.endswith("/count_tokens"):
        return ex.reply(200, {"input_tokens": prompt})
    max_tokens = body.get("max_tokens")
    n = controls.tokens if controls.tokens is not None else (
        max_tokens if isinstance(max_tokens, int) and max_tokens >= 0 else engine.tokens)
    head = {"id": f"msg_sim{ex.record['id']}", "type": "message", "role": "assistant",
            "model": model, "stop_sequence": None}
    if body.get("stream") is True:
        return _MessageStream(ex, head, n, prompt, controls.delay).begin()
    text = "".join(words(n))
    ex.record["chunks_sent"] = n
    return ex.later(n * controls.delay, ex.reply, 200, {
        **head, "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
        "usage": {"input_tokens": prompt, "output_tokens": n}})


class _MessageStream:
    """The Anthropic event stream of one message, a word per delay."""

    def __init__(self, ex: Any, head: JSONDict, n: int, prompt: int, delay: float) -> None:
        self.ex, self.head, self.n, self.prompt, self.delay = ex, head, n, prompt, delay
        self.sent = 0

    def _event(self, kind: str, doc: JSONDict) -> None:
        self.ex.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **doc})}\n\n".encode())

    def begin(self) -> None:
        self.ex.start(200, b"text/event-stream")
        message = {**self.head, "content": [], "stop_reason": None,
                   "usage": {"input_tokens": self.prompt, "output_tokens": 0}}
        self._event("message_start", {"message": message})
        self._event("content_block_start", {"index": 0,
                                            "content_block": {"type": "text", "text": ""}})
        self.ex.later(self.delay, self._tick)

    def _tick(self) -> None:
        if self.sent < self.n:
            self._event("content_block_delta", {"index": 0, "delta": {
                "type": "text_delta", "text": f"tok{self.sent} "}})
            self.sent += 1
            self.ex.record["chunks_sent"] = self.sent
            self.ex.later(self.delay, self._tick)
            return
        self._event("content_block_stop", {"index": 0})
        self._event("message_delta", {"delta": {"stop_reason": "end_turn",
                                                "stop_sequence": None},
                                      "usage": {"output_tokens": self.n}})
        self._event("message_stop", {})
        self.ex.finish()


def _audio(engine: Any, ex: Any) -> Any:
    request: Request = ex.request
    ctype, params = parse_options_header(request.getHeader(b"content-type") or b"")
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        return ex.reply(400, sim_error("expected multipart/form-data", "invalid_multipart"))
    parts = _Parts()
    parser = MultipartParser(params[b"boundary"], cast(Any, parts.callbacks()))
    assert request.content is not None
    request.content.seek(0)
    while chunk := request.content.read(65536):
        parser.write(chunk)
    parser.finalize()
    fields = {name: data.decode("utf-8", "replace") for name, (filename, data, _) in
              parts.done.items() if filename is None}
    files = {name: {"filename": filename, "size": size, "sha256": data.hex()}
             for name, (filename, data, size) in parts.done.items() if filename is not None}
    ex.record.update(model=fields.get("model"), fields=fields, file=files.get("file"))
    if fields.get("model") not in engine.models:
        return ex.reply(404, sim_error(f"model {fields.get('model')!r} not found",
                                       "model_not_found"))
    return ex.reply(200, {"text": "".join(words(3)).strip()})


class _Parts:
    """Collects form fields whole and files as (size, sha256), streaming."""

    def __init__(self) -> None:
        self.done: dict[str, tuple[str | None, bytes, int]] = {}
        self._header = b""
        self._headers: dict[bytes, bytes] = {}
        self._data = bytearray()
        self._hash = hashlib.sha256()
        self._size = 0

    def callbacks(self) -> dict[str, Any]:
        def part_begin() -> None:
            self._headers, self._data, self._hash, self._size = {}, bytearray(), \
                hashlib.sha256(), 0

        def header_field(data: bytes, start: int, end: int) -> None:
            self._header = data[start:end].lower()

        def header_value(data: bytes, start: int, end: int) -> None:
            self._headers[self._header] = self._headers.get(self._header, b"") + data[start:end]

        def part_data(data: bytes, start: int, end: int) -> None:
            self._hash.update(data[start:end])
            self._size += end - start
            if len(self._data) < 4096:
                self._data += data[start:end]

        def part_end() -> None:
            _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
            name = params.get(b"name", b"").decode()
            filename = params.get(b"filename")
            if filename is None:
                self.done[name] = (None, bytes(self._data), self._size)
            else:
                self.done[name] = (filename.decode(), self._hash.digest(), self._size)

        return {"on_part_begin": part_begin, "on_header_field": header_field,
                "on_header_value": header_value, "on_part_data": part_data,
                "on_part_end": part_end}
