"""The capture's parts alone (config/capture.py, observe/capture.py,
observe/captureredact.py, observe/capturefiles.py): its config block and its
errors, what redaction takes out, the ring's bound under wrapping, and the files
that rotate within their size. On a task.Clock, no sockets."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from llmproxy.config import ConfigError, parse_config
from llmproxy.config.capture import CaptureConfig, json_path
from llmproxy.core.hub import Hub
from llmproxy.observe import captureredact as redact
from llmproxy.observe.capture import ENTRY_COST, OFFLOAD_BYTES, CaptureRing
from llmproxy.observe.capturefiles import KEPT, NAME, CaptureFiles
from llmproxy.observe.inflight import InFlight

HOSTS = [{"name": "h", "url": "http://h:1"}]


def parsed(capture: Any) -> Any:
    return parse_config({"hosts": HOSTS, "capture": capture}).capture


def errors(capture: Any) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config({"hosts": HOSTS, "capture": capture})
    return list(e.value.errors)


def test_capture_is_off_by_default_and_on_with_its_block() -> None:
    """No `capture` block: None (off). A block: its sizes in bytes, its redact list
    split into JSON paths and lower-case header names."""
    assert parse_config({"hosts": HOSTS}).capture is None
    assert parsed({}) == CaptureConfig()
    got = parsed({"max_mb": 2, "bodies": False, "redact": ["$.user", "$.messages[*].content",
                                                            "X-User"],
                  "dir": "/tmp/x", "dir_max_mb": 1, "max_record_kb": 8})
    assert got == CaptureConfig(max_bytes=2 << 20, bodies=False,
                                json_paths=(("user",), ("messages", "*", "content")),
                                headers=("x-user",), dir="/tmp/x", dir_max_bytes=1 << 20,
                                max_record_bytes=8 << 10)


@pytest.mark.parametrize(("block", "wanted"), [
    ([], "capture: must be a JSON object"),
    ({"max_mb": 0}, "capture.max_mb: must be a positive number (MB)"),
    ({"max_mb": True}, "capture.max_mb: must be a positive number (MB)"),
    ({"max_record_kb": "1"}, "capture.max_record_kb: must be a positive number (KB)"),
    ({"bodies": "yes"}, "capture.bodies: must be true or false"),
    ({"dir": ""}, "capture.dir: must be a non-empty string"),
    ({"redact": "$.a"}, "capture.redact: must be a list"),
    ({"redact": ["$.a..b"]}, "capture.redact[0]: '$.a..b': not a JSON path"),
    ({"redact": ["$.a", "bad header"]}, "capture.redact[1]: 'bad header': neither"),
    ({"size": 1}, "capture.size: unknown key"),
    ({"max_md": 1}, 'capture.max_md: unknown key (did you mean "max_mb"?)'),
])
def test_a_bad_capture_block_is_refused_by_field(block: Any, wanted: str) -> None:
    """Each mistake is an error naming its field."""
    assert any(e.startswith(wanted) for e in errors(block)), errors(block)


def test_json_paths() -> None:
    """$.a, $.a[0], $.a[*].b, $['x y'], $.* read as steps; anything else is not a path."""
    assert json_path("$.a[0]") == ("a", 0)
    assert json_path("$.a[*].b") == ("a", "*", "b")
    assert json_path("$['x y'][\"z\"]") == ("x y", "z")
    assert json_path("$.*") == ("*",)
    for bad in ("$", "a.b", "$.", "$[x]", "$.a[", "$a"):
        assert json_path(bad) is None, bad


def test_redaction_of_headers_bodies_and_stream_events() -> None:
    """Credentials and cookies are always redacted, named headers too; a JSON path
    redacts in a body and in each `data:` event of a stream; a secret is blanked
    wherever it appears, and a body that is not JSON is kept as text."""
    config = CaptureConfig(json_paths=(("user",), ("choices", "*", "delta", "content")),
                           headers=("x-user",))
    got = redact.headers([(b"Authorization", [b"Bearer k"]), (b"X-Api-Key", [b"k"]),
                          (b"Cookie", [b"c"]), (b"X-User", [b"u"]), (b"Accept", [b"a"])],
                         config)
    assert got == {"authorization": ["[redacted]"], "x-api-key": ["[redacted]"],
                   "cookie": ["[redacted]"], "x-user": ["[redacted]"], "accept": ["a"]}
    body = redact.body(b'{"user": "bob", "note": "key sk-123456", "n": 1}', config,
                       ["sk-123456"])
    assert json.loads(body) == {"user": "[redacted]", "note": "key [redacted]", "n": 1}
    stream = (b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
              b': comment\n\ndata: [DONE]\n\n')
    kept = redact.body(stream, config, [])
    assert json.loads(kept.split("\n")[0][len("data: "):]) == \
        {"choices": [{"delta": {"content": "[redacted]"}}]}
    assert kept.endswith(": comment\n\ndata: [DONE]\n\n")
    assert redact.body(b"\xffnot json", config, []) == "\ufffdnot json"


def ended(inflight: InFlight, clock: Clock, model: str = "m") -> Any:
    exchange = inflight.begin("POST", "/v1/chat/completions", "127.0.0.1")
    exchange.asked_for(model, streaming=True)
    exchange.bound_for("gpu1")
    exchange.authenticated("team-a")
    clock.advance(0.5)
    exchange.wrote(200, 10)
    inflight.end(exchange, "completed")
    return exchange


def test_the_ring_stays_within_max_bytes_as_it_wraps_many_times() -> None:
    """1,000 captures of ~20 KB answers each into a 64 KB ring: its accounted size is
    never over its bound, is exactly what it holds (each record's compressed size
    and its entry's flat cost), and the newest captures are the ones kept."""
    clock = Clock()
    inflight = InFlight(clock, Hub(), id_prefix="t")
    ring = CaptureRing(CaptureConfig(max_bytes=64 * 1024, max_record_bytes=16 * 1024), clock)
    for n in range(1000):
        exchange = ended(inflight, clock)
        rec = ring.recording("POST", "/v1/chat/completions", [], b'{"model": "m"}', 14)
        for i in range(500):     # ~20 KB an answer, of which 16 KB is kept
            rec.feed(b"data: {\"n\": %d, \"i\": %d, \"text\": \"tok%d \"}\n\n" % (n, i, i))
        ring.keep(rec, exchange, 200, [])
        assert ring.accounted <= 64 * 1024
    held = list(ring._kept.values())
    assert ring.accounted == sum(len(k.blob) + ENTRY_COST for k in held)
    assert ring.evicted == 1000 - len(held) and ring.evicted > 900
    newest = ring.page(limit=1)["captures"][0]
    assert newest["id"] == "t-1000" and newest["key"] == "team-a" and newest["host"] == "gpu1"
    doc = ring.get("t-1000")
    assert doc is not None and doc["response"]["truncated"] is True
    assert len(doc["response"]["body"]) == 16 * 1024 and doc["response_bytes"] > 16 * 1024
    assert ring.get("t-1") is None


def test_pages_are_bounded_and_follow_one_another() -> None:
    """Pages list the newest first, at most `limit` (and never over 200); `next`
    leads to the following page until none is left."""
    clock = Clock()
    inflight = InFlight(clock, Hub(), id_prefix="t")
    ring = CaptureRing(CaptureConfig(), clock)
    for _ in range(7):
        ring.keep(ring.recording("POST", "/v1/x", [], b"", 0), ended(inflight, clock), 200, [])
    first = ring.page(limit=3)
    assert [c["id"] for c in first["captures"]] == ["t-7", "t-6", "t-5"]
    second = ring.page(limit=3, before=first["next"])
    third = ring.page(limit=3, before=second["next"])
    assert [c["id"] for c in second["captures"] + third["captures"]] == \
        ["t-4", "t-3", "t-2", "t-1"]
    assert third["next"] is None
    assert len(ring.page(limit=10**6)["captures"]) == 7


def test_without_bodies_only_the_heads_are_kept_and_engine_keys_never() -> None:
    """bodies: false keeps no body (nothing of the answer is held while it runs); an
    engine key that an answer quotes is blanked in the record."""
    clock = Clock()
    inflight = InFlight(clock, Hub(), id_prefix="t")
    headless = CaptureRing(CaptureConfig(bodies=False), clock)
    rec = headless.recording("POST", "/v1/x", [(b"Accept", [b"a"])], b"secret body", 11)
    rec.feed(b"answer")
    assert rec.held == 0 and rec.total == 6
    headless.keep(rec, ended(inflight, clock), 200, [])
    doc = headless.get("t-1")
    assert doc is not None
    assert doc["request"]["body"] is None and doc["response"]["body"] is None
    assert doc["request"]["headers"] == {"accept": ["a"]} and doc["response_bytes"] == 6
    keyed = CaptureRing(CaptureConfig(), clock, lambda: ["engine-key-42"])
    rec = keyed.recording("POST", "/v1/x", [], b"", 0, ("client-key-7",))
    rec.feed(b"engine-key-42 and client-key-7")
    keyed.keep(rec, ended(inflight, clock), 200, [])
    kept = keyed.get("t-2")
    assert kept is not None and kept["response"]["body"] == "[redacted] and [redacted]"
    assert b"engine-key-42" not in zlib.decompress(keyed._kept["t-2"].blob)


def test_files_rotate_within_their_size(tmp_path: Path) -> None:
    """With `dir`: one line per capture; the files rotate so that all of them
    together stay within dir_max_bytes, the oldest dropped."""
    files = CaptureFiles(str(tmp_path / "caps"), 4000)
    for n in range(100):
        files.write(json.dumps({"n": n, "pad": "x" * 80}).encode())
    names = sorted(p.name for p in (tmp_path / "caps").iterdir())
    assert names == [NAME] + [f"{NAME}.{i}" for i in range(1, KEPT + 1)]
    assert sum(p.stat().st_size for p in (tmp_path / "caps").iterdir()) <= 4000
    last = (tmp_path / "caps" / NAME).read_text().splitlines()[-1]
    assert json.loads(last)["n"] == 99
    assert files.summary()["written"] == 100 and files.summary()["failed"] == 0


def test_a_file_that_cannot_be_written_fails_no_request(tmp_path: Path) -> None:
    """A dir that cannot be made: the write is counted as failed and said, nothing raises."""
    (tmp_path / "file").write_text("")
    files = CaptureFiles(str(tmp_path / "file" / "sub"), 4000)
    files.write(b"{}")
    assert files.failed == 1 and files.error is not None and "file" in files.error


def test_requests_in_flight_count_against_the_same_bound() -> None:
    """What recordings of requests in flight hold counts against max_bytes with the
    kept captures: the oldest captures go to make room for it; with none left, a
    recording holds no more and its capture says truncated. Once every request
    ended, nothing is held and the ring is within its bound."""
    clock = Clock()
    inflight = InFlight(clock, Hub(), id_prefix="t")
    ring = CaptureRing(CaptureConfig(max_bytes=64 * 1024, max_record_bytes=40 * 1024), clock)
    for _ in range(20):
        rec = ring.recording("POST", "/v1/x", [], b"", 0)
        rec.feed(b"x" * 1000)
        ring.keep(rec, ended(inflight, clock), 200, [])
    kept_before = ring.summary()["count"]
    assert kept_before == 20
    running = [ring.recording("POST", "/v1/x", [], b"q" * 100, 100) for _ in range(3)]
    for rec in running:
        for _ in range(40):
            rec.feed(b"y" * 1000)
            assert ring.accounted + ring.live <= 64 * 1024
    assert ring.summary()["count"] == 0 and ring.evicted == 20      # room made for them
    assert running[0].held == 40 * 1000 and running[1].held < 40 * 1000
    assert running[2].held == 0 and ring.live == sum(r.held + 100 for r in running)
    for rec in running:
        ring.keep(rec, ended(inflight, clock), 200, [])
    assert ring.live == 0 and ring.accounted <= 64 * 1024
    doc = ring.get("t-23")
    assert doc is not None and doc["response"]["truncated"] is True and \
        doc["response"]["body"] == "" and doc["response_bytes"] == 40_000


def held_ring(clock: Clock) -> tuple[CaptureRing, list[tuple[Any, Deferred[bytes]]]]:
    """A ring whose `offload` holds each packing (its work and its Deferred, in the
    list returned) until the test runs the work and fires the Deferred."""
    works: list[tuple[Any, Deferred[bytes]]] = []

    def offload(work: Any) -> Deferred[bytes]:
        d: Deferred[bytes] = Deferred()
        works.append((work, d))
        return d

    return CaptureRing(CaptureConfig(), clock, offload=offload), works


def test_a_large_capture_is_packed_by_offload_and_held_until_then() -> None:
    """A capture of OFFLOAD_BYTES or more goes to `offload` (later turns of the loop in
    the proxy, web/turns.py); until its packing is done its bytes count as held and it is not
    listed; then it is kept. A packing that fails is counted as lost and holds
    nothing more. Smaller captures are packed at once."""
    clock = Clock()
    inflight = InFlight(clock, Hub(), id_prefix="t")
    ring, works = held_ring(clock)
    small = ring.recording("POST", "/v1/x", [], b"", 0)
    small.feed(b"s" * 100)
    ring.keep(small, ended(inflight, clock), 200, [])
    big = ring.recording("POST", "/v1/x", [], b"", 0)
    big.feed(b"b" * OFFLOAD_BYTES)
    ring.keep(big, ended(inflight, clock), 200, [])
    assert [c["id"] for c in ring.page()["captures"]] == ["t-1"] and len(works) == 1
    assert ring.live == OFFLOAD_BYTES
    work, d = works.pop()
    d.callback(work())
    assert [c["id"] for c in ring.page()["captures"]] == ["t-2", "t-1"] and ring.live == 0
    doc = ring.get("t-2")
    assert doc is not None and doc["response"]["body"] == "b" * OFFLOAD_BYTES
    assert doc["seq"] == 2
    again = ring.recording("POST", "/v1/x", [], b"", 0)
    again.feed(b"c" * OFFLOAD_BYTES)
    ring.keep(again, ended(inflight, clock), 200, [])
    works.pop()[1].errback(ValueError("boom"))
    assert ring.live == 0 and ring.summary()["lost"] == 1 and ring.summary()["count"] == 2


def test_settled_fires_once_every_capture_being_packed_is_kept_or_lost() -> None:
    """`settled()` (what the stop waits for before the reactor stops) fires at once
    with nothing packing, else only once each capture packing now is kept or lost;
    the packings' own results are left alone."""
    clock = Clock()
    inflight = InFlight(clock, Hub(), id_prefix="t")
    ring, works = held_ring(clock)
    idle = ring.settled()
    assert idle.called
    for _ in range(2):
        rec = ring.recording("POST", "/v1/x", [], b"", 0)
        rec.feed(b"b" * OFFLOAD_BYTES)
        ring.keep(rec, ended(inflight, clock), 200, [])
    settled = ring.settled()
    (first, d1), (_, d2) = works
    d1.callback(first())
    assert not settled.called and ring.summary()["count"] == 1
    d2.errback(ValueError("boom"))
    assert settled.called and ring.summary()["lost"] == 1 and ring.live == 0
    assert ring.settled().called


def test_a_reload_refuses_a_capture_change_by_name() -> None:
    """Turning capture on or off, or changing it, needs a restart: a reload names it."""
    from llmproxy.lifecycle.reload import refused_changes

    off = parse_config({"hosts": HOSTS})
    on = parse_config({"hosts": HOSTS, "capture": {}})
    bigger = parse_config({"hosts": HOSTS, "capture": {"max_mb": 128}})
    assert refused_changes(off, on) == ["capture changed: restart to apply"]
    assert refused_changes(on, bigger) == ["capture changed: restart to apply"]
    assert refused_changes(on, parse_config({"hosts": HOSTS, "capture": {}})) == []
