"""Placement over two simulated machines (tests/gpuhost.py: network namespaces running real
sshd; the proxy brings its agent; the engines are simulated): one engine that two hosts may run
goes where it fits, the reason published on /api/events; a host full of busy engines is never
chosen over one with room; a host that dies during a placement is skipped."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import gpuhost
from tests.gpuhost import GPUHost, engine_command
from tests.procs import BodyReader, Proxy, free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def second_host(gpu_host: GPUHost, tmp_path: Path) -> Iterator[GPUHost]:
    """A third machine beside `gpu_host` (its own namespace and sshd)."""
    with gpuhost.GPUHost(tmp_path / "second") as host:
        yield host


def config(hosts: list[GPUHost], tmp_path: Path) -> dict[str, Any]:
    """gpu1 and gpu2, 24 GB each: `big` (16 GB) on both, `small` (12 GB) on each;
    model `big` may run on either, `small1` on gpu1 only."""
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
    return {"ssh_command": ssh, "runtime_dir": str(tmp_path / "locks"), "hosts": entries,
            "models": {"big": {"hosts": ["gpu1", "gpu2"], "engine": "big", "upstream": "mbig"},
                       "small1": {"host": "gpu1", "engine": "small", "upstream": "msmall"}}}


def post(port: int, model: str, stream: bool = False, **headers: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": model, "stream": stream}),
                 headers)
    return conn.getresponse()


def host_status(proxy: Proxy, name: str) -> dict[str, Any]:
    """The host's engine state in /status."""
    entry = next(h for h in proxy.get_json("/status")["hosts"] if h["name"] == name)
    return dict(entry["engine"] or {})


class Events(threading.Thread):
    """Reads /api/events for the whole test."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.request("GET", "/api/events")
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.data = bytearray()
        self.start()

    def run(self) -> None:
        try:
            while chunk := self.resp.read1(65536):
                self.data += chunk
        except (OSError, ValueError, http.client.HTTPException):
            pass

    def placed(self, timeout: float = 10) -> list[dict[str, Any]]:
        """The engine.placed events so far (waits for one)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [json.loads(line[6:]) for line in bytes(self.data).decode().splitlines()
                     if line.startswith("data: ") and '"engine.placed"' in line]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def stop(self) -> None:
        if self.conn.sock is not None:
            self.conn.sock.shutdown(2)
        self.join(5)


def test_the_engine_goes_to_the_host_with_room_never_the_busy_one(
        gpu_host: GPUHost, second_host: GPUHost, tmp_path: Path) -> None:
    """A stream holds `small` on gpu1 (12 of 24 GB, busy); a request for `big` (16 GB)
    goes to gpu2, where it fits, and engine.placed on /api/events says so with both
    hosts' headroom; the stream on gpu1 completes in full."""
    proxy = Proxy(config([gpu_host, second_host], tmp_path), tmp_path)
    events = Events(proxy.port)
    try:
        stream = BodyReader(post(proxy.port, "small1", stream=True,
                                 **{"X-Sim-Delay": "0.2", "X-Sim-Tokens": "25"}))
        deadline = time.monotonic() + 30
        while host_status(proxy, "gpu1").get("in_flight", 0) < 1:
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.1)
        answer = post(proxy.port, "big")
        assert answer.status == 200 and b"tok" in answer.read()
        placed = events.placed()
        assert [(e["host"], e["engine"]) for e in placed] == [("gpu2", "big")]
        assert placed[0]["why"] == "fits without evicting: 24 GB free"
        assert dict(map(tuple, placed[0]["headroom"])) == {"gpu1": 12, "gpu2": 24}
        stream.join(30)
        assert stream.resp.status == 200 and stream.body.count(b"tok") >= 25
        proxy.wait_for(r"placed big on gpu2 for \S+: fits without evicting")
    finally:
        events.stop()
        proxy.stop()


def test_a_host_killed_during_placement_is_skipped(
        gpu_host: GPUHost, second_host: GPUHost, tmp_path: Path) -> None:
    """gpu1 holds an idle `small`; gpu2 is empty, so `big` is placed there; gpu2's
    machine is gone (its sshd stopped): nothing was sent, so the request goes to
    gpu1, which evicts its idle engine and answers."""
    proxy = Proxy(config([gpu_host, second_host], tmp_path), tmp_path)
    events = Events(proxy.port)
    try:
        warm = post(proxy.port, "small1")
        assert warm.status == 200 and b"tok" in warm.read()
        second_host.stop()
        answer = post(proxy.port, "big")
        assert answer.status == 200 and b"tok" in answer.read()
        placed = events.placed()
        assert placed[0]["host"] == "gpu2" and placed[0]["order"] == ["gpu2", "gpu1"]
        status = host_status(proxy, "gpu1")
        assert [r["engine"] for r in status["resident"]] == ["big"]
    finally:
        events.stop()
        proxy.stop()
