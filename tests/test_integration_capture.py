"""Capture end to end (issue 49): twistd llmproxy with a `capture` block in front of a
simulated engine, on the reference path and with the speedups (`on_both_paths`: both
relays feed the capture from where they already see the bytes, and must keep the same).
A captured answer is byte for byte what the client read; failed requests are captured
with their status and what the client got; secrets and the configured paths and headers
never reach a capture; the ring stays within `max_mb` as it wraps many times; the reads
are for trusted peers only, and never for another site's page."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.procs import Proxy, SimEngine, one_host, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("on_both_paths")]

SECRET = "sk-live-0123456789"
REDACT = ["$.user", "$.metadata.email", "x-team-secret"]


def post(proxy: Proxy, body: dict[str, Any], **headers: str) -> tuple[int, bytes, str]:
    """POST /v1/chat/completions: the status, what the client read (up to a cut),
    and the request id."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        try:
            data = response.read()
        except http.client.IncompleteRead as e:
            data = e.partial
        return response.status, data, response.getheader("x-request-id") or ""
    finally:
        conn.close()


def get(proxy: Proxy, path: str, **headers: str) -> tuple[int, Any]:
    request = urllib.request.Request(proxy.url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def capture_of(proxy: Proxy, id: str) -> dict[str, Any]:
    """The capture of request `id` (a large one is kept once its packing, in a
    later turn of the loop, is done: shortly after its client read the end)."""
    def read() -> Any:
        status, doc = get(proxy, f"/api/captures/{id}")
        return doc if status == 200 else None

    found: dict[str, Any] = wait_until(read, timeout=5)
    assert found, f"no capture {id}"
    return dict(found)


def test_answers_and_failures_are_captured_as_the_client_read_them(
        engine: SimEngine, tmp_path: Path) -> None:
    """A stream, a plain answer, an unknown model (404), an engine's 500 and an
    engine that dies mid-stream: each is listed (newest first) with its status,
    outcome, model, host and timings, and its capture's answer body is exactly the
    bytes the client read. The request's credentials, its x-team-secret header,
    `user` and `metadata.email` are redacted, and the key's value is blanked in the
    body that quoted it."""
    proxy = Proxy(one_host(engine, capture={"max_mb": 4, "redact": REDACT}), tmp_path)
    try:
        body = {"model": "m", "stream": True, "user": "alice",
                "metadata": {"email": "a@example.com", "team": "blue"},
                "messages": [{"role": "user", "content": f"my key is {SECRET}"}]}
        streamed = post(proxy, body, Authorization=f"Bearer {SECRET}",
                        **{"X-Team-Secret": "t0p", "X-Sim-Tokens": "4"})
        plain = post(proxy, {**body, "stream": False}, **{"X-Sim-Tokens": "3"})
        unknown = post(proxy, {"model": "nope", "messages": []})
        failed = post(proxy, {"model": "m", "messages": []}, **{"X-Sim-Status": "500"})
        cut = post(proxy, {**body, "user": "bob"}, **{"X-Sim-Tokens": "50",
                                                      "X-Sim-Die-After": "5"})
        # over OFFLOAD_BYTES: packed in later turns of the loop
        large = post(proxy, {"model": "m", "stream": True, "messages": []},
                     **{"X-Sim-Tokens": "400", "X-Sim-Delay": "0"})
        assert [r[0] for r in (streamed, plain, unknown, failed, cut, large)] == \
            [200, 200, 404, 500, 200, 200]
        assert len(large[1]) > 32 * 1024
        assert capture_of(proxy, large[2])["response"]["body"] == large[1].decode()
        status, listing = get(proxy, "/api/captures?before=" + str(
            capture_of(proxy, large[2])["seq"]))
        assert status == 200 and listing["enabled"] is True, listing
        rows = {row["id"]: row for row in listing["captures"]}
        ids = [r[2] for r in (streamed, plain, unknown, failed, cut)]
        assert [row["id"] for row in listing["captures"]] == ids[::-1]
        assert [rows[i]["status"] for i in ids] == [200, 200, 404, 500, 200]
        assert [rows[i]["outcome"] for i in ids] == \
            ["completed", "completed", "completed", "completed", "upstream-failed"]
        assert rows[ids[0]]["model"] == "m" and rows[ids[0]]["host"] == "gpu1"
        assert rows[ids[0]]["streaming"] is True and rows[ids[0]]["ttfb"] is not None
        assert rows[ids[2]]["host"] is None            # never routed
        for (_, read, id) in (streamed, plain, unknown, failed, cut):
            doc = capture_of(proxy, id)
            assert doc["response"]["body"] == read.decode(), id
            assert doc["response_bytes"] == len(read)
        assert b"error" in unknown[1] and b"model_not_found" in unknown[1]
        doc = capture_of(proxy, streamed[2])
        headers = doc["request"]["headers"]
        assert headers["authorization"] == ["[redacted]"]
        assert headers["x-team-secret"] == ["[redacted]"]
        sent = json.loads(doc["request"]["body"])
        assert sent["user"] == "[redacted]" and sent["metadata"] == \
            {"email": "[redacted]", "team": "blue"}
        assert sent["messages"][0]["content"] == "my key is [redacted]"
        assert SECRET not in json.dumps(doc) and "t0p" not in json.dumps(doc)
        assert doc["response"]["headers"]["content-type"] == ["text/event-stream"]
    finally:
        proxy.stop()


def test_the_ring_stays_within_max_mb_as_it_wraps_many_times(
        engine: SimEngine, tmp_path: Path) -> None:
    """A 32 KB ring (max_mb) under 80 streamed answers of ~16 KB each: the ring lets
    the oldest go many times over, its accounted size (the kept captures and what
    requests in flight hold) is never above its bound, and the newest answer is the
    one kept whole."""
    bound = 32 * 1024
    proxy = Proxy(one_host(engine, capture={"max_mb": bound / (1 << 20)}), tmp_path)
    try:
        # (each answer is over OFFLOAD_BYTES: packed in a later turn, listed once packed)
        def all_kept() -> Any:
            doc = get(proxy, "/api/captures?limit=200")[1]
            return doc if doc["in_flight_bytes"] == 0 else None

        last = None
        for n in range(80):
            if n == 79:     # the last finds no packing holding the ring's room: kept whole
                assert wait_until(all_kept, timeout=5)
            last = post(proxy, {"model": "m", "stream": True,
                                "messages": [{"role": "user", "content": f"n{n}"}]},
                        **{"X-Sim-Tokens": "100", "X-Sim-Delay": "0"})
            assert last[0] == 200 and len(last[1]) > 15_000
            if n % 10 == 9:
                _, listing = get(proxy, "/api/captures?limit=1")
                assert 0 < listing["bytes"] + listing["in_flight_bytes"] \
                    <= listing["max_bytes"] == bound, listing
        listing = wait_until(all_kept, timeout=5)
        assert listing["evicted"] >= 80 - listing["count"] > 40, listing
        assert listing["count"] * 1024 < bound < 80 * 16_000
        assert last is not None
        assert capture_of(proxy, last[2])["response"]["body"] == last[1].decode()
    finally:
        proxy.stop()


def test_captures_are_read_by_trusted_peers_only_and_off_by_default(
        engine: SimEngine, tmp_path: Path) -> None:
    """Without a `capture` block nothing is kept (the listing says capture is off, a
    capture is 404). With one, a peer outside trusted_peers is refused (403), and a
    trusted one is refused too when another site's page sends the read."""
    (tmp_path / "off").mkdir()
    off = Proxy(one_host(engine), tmp_path / "off")
    try:
        assert post(off, {"model": "m", "messages": []})[0] == 200
        assert get(off, "/api/captures") == (200, {"enabled": False, "captures": [],
                                                    "next": None})
        status, doc = get(off, f"/api/captures/{off.get_json('/status')['pid']}-1")
        assert status == 404 and doc["error"]["code"] == "capture_not_found"
    finally:
        off.stop()
    proxy = Proxy(one_host(engine, capture={}, trusted_peers=["10.0.0.0/8"]), tmp_path)
    try:
        status, doc = get(proxy, "/api/captures")
        assert status == 403, doc
    finally:
        proxy.stop()
    proxy = Proxy(one_host(engine, capture={}), tmp_path)
    try:
        status, doc = get(proxy, "/api/captures", Origin="https://evil.example")
        assert status == 403, doc
        assert get(proxy, "/api/captures?limit=x")[0] == 400
    finally:
        proxy.stop()


def test_captures_are_written_to_dir_only_when_asked(engine: SimEngine, tmp_path: Path) -> None:
    """With `dir`, each capture is one JSON line in captures.jsonl (redacted as in
    memory); without, the proxy's directory holds no capture file."""
    caps = tmp_path / "caps"
    proxy = Proxy(one_host(engine, capture={"dir": str(caps), "redact": ["$.user"]}), tmp_path)
    try:
        _, _, id = post(proxy, {"model": "m", "user": "carol", "messages": []})
    finally:
        proxy.stop()
    lines = [json.loads(line) for line in (caps / "captures.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == [id]
    assert json.loads(lines[0]["request"]["body"])["user"] == "[redacted]"
    assert "carol" not in (caps / "captures.jsonl").read_text()


def test_a_client_that_leaves_is_captured_without_a_status(
        engine: SimEngine, tmp_path: Path) -> None:
    """A client that leaves before the engine's headers: its capture says
    client-gone, with no status (nothing was sent) and its request body kept."""
    import time

    proxy = Proxy(one_host(engine, capture={}), tmp_path)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("POST", "/v1/chat/completions",
                     json.dumps({"model": "m", "messages": [], "note": "left"}).encode(),
                     {"Content-Type": "application/json", "X-Sim-Header-Delay": "5"})
        time.sleep(0.3)
        conn.close()

        def listed() -> Any:
            _, listing = get(proxy, "/api/captures")
            return listing["captures"] or None

        [row] = wait_until(listed, timeout=5)
        assert row["outcome"] == "client-gone" and row["status"] is None, row
        assert json.loads(capture_of(proxy, row["id"])["request"]["body"])["note"] == "left"
    finally:
        proxy.stop()
