"""Placement over two and three simulated machines (tests/gpuhost.py: network namespaces running
real sshd; the proxy brings its agent; the engines are simulated): one engine that several hosts
may run goes where it fits, the reason published on /api/events; a host full of busy engines is
never chosen over one with room, nor one that must evict over one that need not; a host that
dies during a placement is skipped."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.gpuhost import GPUHost, engine_command
from tests.procs import BodyReader, Proxy, free_port, wait_until
from tests.test_integration_observe import Events

pytestmark = pytest.mark.integration


def config(hosts: list[GPUHost], tmp_path: Path) -> dict[str, Any]:
    """gpu1, gpu2, ... (one per machine), 24 GB each: `big` (16 GB) and `small` (12 GB)
    on each; model `big` may run on any of them, `small<N>` on gpuN only."""
    ssh = list(hosts[0].ssh_command)
    for other in hosts[1:]:
        ssh[1:1] = ["-i", str(other.client_key)]
    entries = []
    for i, host in enumerate(hosts):
        ports = {name: free_port() for name in ("big", "small")}
        entries.append({
            "name": f"gpu{i + 1}", "url": host.url(ports["big"]), "ssh": host.target,
            "memory_gb": 24, "min_engine_seconds": 0,
            "engines": {name: {"command": engine_command(port, f"m{name}"),
                               "url": host.url(port), "start_timeout_seconds": 20,
                               "memory_gb": 16 if name == "big" else 12}
                        for name, port in ports.items()}})
    names = [entry["name"] for entry in entries]
    return {"ssh_command": ssh, "runtime_dir": str(tmp_path / "locks"), "hosts": entries,
            "models": {"big": {"hosts": names, "engine": "big", "upstream": "mbig"},
                       **{f"small{i + 1}": {"host": name, "engine": "small",
                                            "upstream": "msmall"}
                          for i, name in enumerate(names)}}}


def post(port: int, model: str, stream: bool = False, **headers: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": model, "stream": stream}),
                 headers)
    return conn.getresponse()


def host_status(proxy: Proxy, name: str) -> dict[str, Any]:
    """The host's engine state in /status."""
    entry = next(h for h in proxy.get_json("/status")["hosts"] if h["name"] == name)
    return dict(entry["engine"] or {})


def of(events: Events, kind: str, **fields: object) -> list[dict[str, Any]]:
    """The events of type `kind` received so far with these `fields`."""
    return [m["data"] for m in list(events.messages) if m["data"].get("type") == kind
            and all(m["data"].get(k) == v for k, v in fields.items())]


def placements(events: Events, timeout: float = 10) -> list[dict[str, Any]]:
    """The engine.placed events so far (waits for one)."""
    events.wait(lambda m: m["data"].get("type") == "engine.placed", timeout)
    return of(events, "engine.placed")


def busy_stream(proxy: Proxy) -> BodyReader:
    """A stream for `small1` (25 tokens, 0.2 s apart), once gpu1 has it in flight."""
    stream = BodyReader(post(proxy.port, "small1", stream=True,
                             **{"X-Sim-Delay": "0.2", "X-Sim-Tokens": "25"}))
    deadline = time.monotonic() + 30
    while host_status(proxy, "gpu1").get("in_flight", 0) < 1:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.1)
    return stream


def test_the_engine_goes_to_the_host_with_room_never_the_busy_one(
        gpu_hosts: list[GPUHost], tmp_path: Path) -> None:
    """A stream holds `small` on gpu1 (12 of 24 GB, busy); a request for `big` (16 GB)
    goes to gpu2, where it fits, and engine.placed on /api/events says so with both
    hosts' headroom; the stream on gpu1 completes in full."""
    proxy = Proxy(config(gpu_hosts[:2], tmp_path), tmp_path)
    events = Events(proxy.port)
    try:
        stream = busy_stream(proxy)
        answer = post(proxy.port, "big")
        assert answer.status == 200 and b"tok" in answer.read()
        placed = placements(events)
        assert [(e["host"], e["engine"]) for e in placed] == [("gpu2", "big")]
        assert placed[0]["why"] == "fits without evicting: 24 GB free"
        assert dict(map(tuple, placed[0]["headroom"])) == {"gpu1": 12, "gpu2": 24}
        stream.join(30)
        assert stream.resp.status == 200 and stream.body.count(b"tok") >= 25
        proxy.wait_for(r"placed big on gpu2 for \S+: fits without evicting")
    finally:
        events.close()
        proxy.stop()


def test_a_host_killed_during_placement_is_skipped(
        gpu_hosts: list[GPUHost], tmp_path: Path) -> None:
    """gpu1 holds an idle `small`; gpu2 is empty, so `big` is placed there; gpu2's
    machine is gone (its sshd stopped): nothing was sent, so the request goes to
    gpu1, which evicts its idle engine and answers."""
    proxy = Proxy(config(gpu_hosts[:2], tmp_path), tmp_path)
    events = Events(proxy.port)
    try:
        warm = post(proxy.port, "small1")
        assert warm.status == 200 and b"tok" in warm.read()
        gpu_hosts[1].stop()
        answer = post(proxy.port, "big")
        assert answer.status == 200 and b"tok" in answer.read()
        placed = placements(events)
        assert placed[0]["host"] == "gpu2" and placed[0]["order"] == ["gpu2", "gpu1"]
        status = host_status(proxy, "gpu1")
        assert [r["engine"] for r in status["resident"]] == ["big"]
    finally:
        events.close()
        proxy.stop()


def test_over_three_machines_the_one_with_room_wins_over_a_busy_and_an_evicting_one(
        gpu_hosts: list[GPUHost], tmp_path: Path) -> None:
    """Three machines: a stream holds `small` on gpu1 (busy: never evicted), gpu2 holds
    an idle `small` (room only by evicting it), gpu3 is empty. A request for `big` goes to
    gpu3, the last host the model names; engine.placed gives the reason, the order
    (gpu3, then gpu2 that would evict, then gpu1 that must wait) and every host's
    headroom; gpu2's idle engine is not stopped and the stream on gpu1 completes."""
    proxy = Proxy(config(gpu_hosts, tmp_path), tmp_path)
    events = Events(proxy.port)
    try:
        warm = post(proxy.port, "small2")
        assert warm.status == 200 and b"tok" in warm.read()
        stream = busy_stream(proxy)
        answer = post(proxy.port, "big")
        assert answer.status == 200 and b"tok" in answer.read()
        placed = placements(events)
        assert [(e["host"], e["engine"]) for e in placed] == [("gpu3", "big")]
        assert placed[0]["why"] == "fits without evicting: 24 GB free"
        assert placed[0]["order"] == ["gpu3", "gpu2", "gpu1"]
        assert dict(map(tuple, placed[0]["headroom"])) == {"gpu1": 12, "gpu2": 12, "gpu3": 24}
        assert [r["engine"] for r in host_status(proxy, "gpu2")["resident"]] == ["small"]
        assert [r["engine"] for r in host_status(proxy, "gpu3")["resident"]] == ["big"]
        stream.join(30)
        assert stream.resp.status == 200 and stream.body.count(b"tok") >= 25
        proxy.wait_for(r"placed big on gpu3 for \S+: fits without evicting")
    finally:
        events.close()
        proxy.stop()


def test_a_placement_is_released_when_its_waiting_client_leaves(
        gpu_hosts: list[GPUHost], tmp_path: Path) -> None:
    """Streams hold `small` on gpu1 and gpu2 (no room for `big` anywhere): a request
    for `big` is placed on gpu1 to wait there, and its client leaves. The next request
    for `big` is placed anew ("no room", gpu1 with 12 GB free), not sent to the room
    the client that left had reserved ("engine resident")."""
    proxy = Proxy(config(gpu_hosts[:2], tmp_path), tmp_path)
    events = Events(proxy.port)
    try:
        streams = [BodyReader(post(proxy.port, model, stream=True,
                                   **{"X-Sim-Delay": "0.2", "X-Sim-Tokens": "40"}))
                   for model in ("small1", "small2")]
        deadline = time.monotonic() + 30
        while any(host_status(proxy, h).get("in_flight", 0) < 1 for h in ("gpu1", "gpu2")):
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.1)
        for i in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
            conn.request("POST", "/v1/chat/completions",
                         json.dumps({"model": "big", "stream": False}))
            assert wait_until(lambda i=i: len(of(events, "queue.wait", engine="big")) > i)
            conn.close()                     # the client leaves while it waits
            assert wait_until(lambda i=i: len(of(events, "queue.leave", outcome="gone")) > i)
        placed = placements(events)
        assert [(e["host"], e["why"]) for e in placed] == [
            ("gpu1", "no room on any host: waits for engines to fall idle")] * 2
        assert dict(map(tuple, placed[1]["headroom"]))["gpu1"] == 12
        for stream in streams:
            stream.join(30)
            assert stream.resp.status == 200 and stream.body.count(b"tok") >= 40
    finally:
        events.close()
        proxy.stop()
