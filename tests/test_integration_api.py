"""The other APIs an engine speaks, through a real twistd llmproxy to a real
simulated engine, driven by the real SDKs: the Anthropic Messages API (the
`anthropic` SDK), multipart audio (the `openai` SDK) and llama-server's routes
outside /v1/."""

from __future__ import annotations

import hashlib
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.procs import Proxy, SimEngine

pytestmark = pytest.mark.integration

SECRET = "sk-api-test-4e1f0b9d"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proxy, SimEngine]]:
    engine = SimEngine(["qwen-up", "whisper-up"], "--delay", "0.01", "--tokens", "5")
    workdir = tmp_path_factory.mktemp("api")
    (workdir / "keys.json").write_text(json.dumps({"keys": [
        {"name": "dev", "sha256": hashlib.sha256(SECRET.encode()).hexdigest()}]}))
    config = {
        "keys_file": "keys.json",
        "max_body_bytes": 4 << 20,
        "hosts": [{"name": "gpu1", "url": engine.url}],
        "models": {"claude-local": {"host": "gpu1", "upstream": "qwen-up"},
                   "whisper": {"host": "gpu1", "upstream": "whisper-up"}},
    }
    try:
        proxy = Proxy(config, workdir)
    except BaseException:
        engine.stop()
        raise
    yield proxy, engine
    proxy.stop()
    engine.stop()


def sdk(proxy: Proxy, key: str = SECRET) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0, timeout=10)


def test_the_anthropic_sdk_streams_a_message(setup: tuple[Proxy, SimEngine]) -> None:
    """The SDK streams a message through the proxy from an engine that speaks
    /v1/messages: every word arrives, the engine saw the upstream model name,
    the final message is whole, and count_tokens answers too."""
    proxy, engine = setup
    client = sdk(proxy)
    with client.messages.stream(model="claude-local", max_tokens=5,
                                messages=[{"role": "user", "content": "say hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "tok0 tok1 tok2 tok3 tok4 "
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 5
    assert engine.requests()[-1]["model"] == "qwen-up"
    whole = client.messages.create(model="claude-local", max_tokens=5,
                                   messages=[{"role": "user", "content": "say hi"}])
    assert whole.content[0].text == "tok0 tok1 tok2 tok3 tok4 "  # type: ignore[union-attr]
    counted = client.messages.count_tokens(model="claude-local",
                                           messages=[{"role": "user", "content": "a b c"}])
    assert counted.input_tokens == 3


def test_proxy_errors_parse_as_anthropic_errors_in_the_sdk(
        setup: tuple[Proxy, SimEngine]) -> None:
    """An unknown model is the SDK's NotFoundError, a wrong key its
    AuthenticationError, each with Anthropic's error body."""
    proxy, _ = setup
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk(proxy).messages.create(model="nope", max_tokens=8, messages=messages)
    assert missing.value.status_code == 404
    assert missing.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "The model 'nope' does not exist"}}
    with pytest.raises(anthropic.AuthenticationError) as denied:
        sdk(proxy, "sk-wrong").messages.create(model="claude-local", max_tokens=8,
                                                messages=messages)
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/tokenize", "/detokenize",
                                  "/infill", "/embedding"])
def test_llama_server_routes_outside_v1_route_by_model(
        setup: tuple[Proxy, SimEngine], path: str) -> None:
    """Each of llama-server's own routes that carries a model goes to the model's
    host with the upstream name; other paths stay 404."""
    proxy, _ = setup
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("POST", path, json.dumps({"model": "claude-local", "content": "a b"}),
                 {"Authorization": f"Bearer {SECRET}"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert json.loads(resp.read()) == {"route": path, "model": "qwen-up"}
    conn.request("POST", "/props", b"{}", {"Authorization": f"Bearer {SECRET}"})
    assert conn.getresponse().status == 404


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # audio.translations
def test_the_openai_sdk_transcribes_through_the_proxy(
        setup: tuple[Proxy, SimEngine], tmp_path: Path) -> None:
    """audio.transcriptions.create sends multipart through the proxy: the engine
    receives the file intact (name, size, sha256) and the upstream model name;
    a form naming an unknown model is the SDK's NotFoundError."""
    proxy, engine = setup
    audio = bytes(range(256)) * 4096 + b"\r\n--not-a-boundary\r\n"   # 1 MiB and a bit
    path = tmp_path / "speech.wav"
    path.write_bytes(audio)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=SECRET, max_retries=0)
    with path.open("rb") as f:
        result = client.audio.transcriptions.create(model="whisper", file=f)
    assert result.text == "tok0 tok1 tok2"
    record = engine.requests()[-1]
    assert record["path"] == "/v1/audio/transcriptions" and record["model"] == "whisper-up"
    assert record["file"] == {"filename": "speech.wav", "size": len(audio),
                              "sha256": hashlib.sha256(audio).hexdigest()}
    with pytest.raises(openai.NotFoundError), path.open("rb") as f:
        client.audio.translations.create(model="nope", file=f)
