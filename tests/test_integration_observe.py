"""Watching a real proxy: the event stream, the metrics and the status and upgrade
commands, against real twistd processes and simulated engines on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import (
    ROOT,
    Proxy,
    SimEngine,
    env,
    kill_if_alive,
    one_host,
    refusing_port,
    wait_gone,
    wait_until,
)

pytestmark = pytest.mark.integration


ENGINE_MODELS = ("m-up", "other")   # the `engine` fixture's (conftest.py)


class Events(threading.Thread):
    """An /api/events client: every message it received, in order."""

    def __init__(self, port: int, last_id: int | None = None) -> None:
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {} if last_id is None else {"Last-Event-ID": str(last_id)}
        self.conn.request("GET", "/api/events", headers=headers)
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        assert self.response.getheader("content-type") == "text/event-stream"
        self.messages: list[dict[str, Any]] = []
        self.ended = threading.Event()
        self._cond = threading.Condition()
        self.start()

    def run(self) -> None:
        message: dict[str, Any] = {}
        try:
            for raw in self.response:
                line = raw.decode().rstrip("\n")
                if not line:
                    if "data" in message:
                        message["data"] = json.loads(message["data"])
                        with self._cond:
                            self.messages.append(message)
                            self._cond.notify_all()
                    message = {}
                elif not line.startswith(":"):
                    key, _, value = line.partition(": ")
                    message[key] = value
        except (OSError, AttributeError, ValueError):
            pass        # closed under the reader (AttributeError: http.client's fp is gone)
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def wait(self, predicate: Any, timeout: float = 15) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [m for m in self.messages if predicate(m)]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                assert left > 0 and not self.ended.is_set(), (
                    f"no such event in {[m['event'] for m in self.messages]}")
                self._cond.wait(left)

    def count(self, predicate: Any) -> int:
        with self._cond:
            return sum(1 for m in self.messages if predicate(m))

    def of(self, request_id: str) -> list[str]:
        with self._cond:
            return [m["event"] for m in self.messages
                    if m["data"].get("request_id") == request_id]

    def close(self) -> None:
        # shutdown, not just close: the reader thread is blocked in recv on it.
        if self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self.ended.wait(5)


def post(port: int, model: str = "m", *, stream: bool = False,
         headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, Any] | bytes]:
    """One chat completion: (status, request id, JSON body or the raw stream)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body: dict[str, Any] = {"model": model, "stream": stream,
                            "messages": [{"role": "user", "content": "a b c"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    rid = resp.getheader("x-request-id") or ""
    return resp.status, rid, (data if stream else json.loads(data))


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", *args], env=env(),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


def test_a_client_sees_its_request_start_and_end_then_a_reload(engine: SimEngine,
                                                                tmp_path: Path) -> None:
    """request.start then request.end for the client's own request (id, model, host,
    status, outcome), ids increasing, and a SIGHUP reload as a `reload` event."""
    proxy = Proxy(one_host(engine, "m-up"), tmp_path)
    try:
        events = Events(proxy.port)
        status, rid, _ = post(proxy.port)
        assert status == 200
        end = events.wait(lambda m: m["event"] == "request.end"
                          and m["data"]["request_id"] == rid)
        start = events.wait(lambda m: m["event"] == "request.start"
                            and m["data"]["request_id"] == rid)
        assert events.of(rid) == ["request.start", "request.end"]
        assert int(start["id"]) < int(end["id"])
        assert start["data"]["model"] == "m" and start["data"]["host"] == "gpu1"
        assert end["data"]["status"] == 200 and end["data"]["outcome"] == "completed"
        assert isinstance(end["data"]["time"], float) and end["data"]["type"] == "request.end"
        proxy.write_config(one_host(engine, "m-up", aliases={"coder": "m"}))
        proxy.signal(signal.SIGHUP)
        reload = events.wait(lambda m: m["event"] == "reload")
        assert reload["data"]["outcome"] == "applied"
        assert "aliases (+coder)" in reload["data"]["message"]
        events.close()
    finally:
        proxy.stop()


def test_resuming_with_last_event_id_loses_nothing(engine: SimEngine, tmp_path: Path) -> None:
    """A client that drops and reconnects with Last-Event-ID gets every event it
    missed, in order, with no gap in the ids; an id the proxy never gave gets `reset`."""
    proxy = Proxy(one_host(engine, "m-up"), tmp_path)
    try:
        first = Events(proxy.port)
        _, rid, _ = post(proxy.port)
        seen = first.wait(lambda m: m["data"].get("request_id") == rid
                          and m["event"] == "request.end")
        first.close()
        missed = [post(proxy.port)[1] for _ in range(5)]
        again = Events(proxy.port, last_id=int(seen["id"]))
        again.wait(lambda m: m["data"].get("request_id") == missed[-1]
                   and m["event"] == "request.end")
        ids = [int(m["id"]) for m in again.messages]
        assert ids == list(range(int(seen["id"]) + 1, ids[-1] + 1))
        for rid in missed:
            assert again.of(rid) == ["request.start", "request.end"]
        again.close()
        stranger = Events(proxy.port, last_id=5)
        assert stranger.wait(lambda m: True)["event"] == "reset"
        stranger.close()
    finally:
        proxy.stop()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_subscriber_that_never_reads_is_dropped(engine: SimEngine, tmp_path: Path) -> None:
    """A client that opens /api/events and never reads: past 1 MiB queued it is
    dropped, the proxy's memory stays bounded, and a reading client next to it
    gets every event."""
    proxy = Proxy(one_host(engine, "m-up"), tmp_path)
    stalled = socket.create_connection(("127.0.0.1", proxy.port))
    try:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reader = Events(proxy.port)
        assert wait_until(lambda: proxy.get_json("/status")["event_streams"] == 2)
        before = rss_kib(proxy.pid)
        # A made-up model at the longest a name may be: a 404, and an event of
        # over 256 bytes each.
        name = "x" * 256
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        for _ in range(4000):   # over 1 MiB of events, past the bound
            conn.request("POST", "/v1/chat/completions", json.dumps({"model": name}))
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 404
        conn.close()
        assert wait_until(lambda: proxy.get_json("/status")["event_streams"] == 1)
        growth = rss_kib(proxy.pid) - before
        assert growth < 20 * 1024, f"RSS grew by {growth} KiB"
        assert wait_until(lambda: reader.count(
            lambda m: m["event"] == "request.end" and m["data"]["model"] == name) == 4000)
        reader.close()
    finally:
        stalled.close()
        proxy.stop()


def test_sigterm_with_three_event_streams_exits_at_once(engine: SimEngine,
                                                         tmp_path: Path) -> None:
    """Event streams are not requests in flight: with three open and no request,
    SIGTERM exits 0 at once; each stream gets the `stop` event, then its end."""
    proxy = Proxy(one_host(engine, "m-up"), tmp_path)
    streams = [Events(proxy.port) for _ in range(3)]
    assert wait_until(lambda: proxy.get_json("/status")["event_streams"] == 3)
    t0 = time.monotonic()
    proxy.signal(signal.SIGTERM)
    assert proxy.popen.wait(timeout=10) == 0
    assert time.monotonic() - t0 < 3
    for s in streams:
        assert s.ended.wait(5)
        assert [m["data"]["stage"] for m in s.messages if m["event"] == "stop"][:2] == [
            "signal", "begun"]


def test_metrics_count_exactly_what_was_sent(engine: SimEngine, tmp_path: Path) -> None:
    """/metrics, parsed with prometheus_client's own parser: the request counter
    moved by exactly the requests sent, the histograms have their observations,
    tokens add up to the engines' usage, and a made-up model name is never a label."""
    proxy = Proxy(one_host(engine, "m-up"), tmp_path)
    try:
        usage = [post(proxy.port)[2]["usage"] for _ in range(4)]   # type: ignore[index]
        streamed = post(proxy.port, stream=True, headers={"X-Sim-Tokens": "7"})[2]
        assert isinstance(streamed, bytes) and b'"usage"' in streamed
        made_up = "no-such-model-4711"
        for _ in range(2):
            assert post(proxy.port, made_up)[0] == 404
        with urllib_open(proxy.url + "/metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        assert made_up not in text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}

        def sample(name: str, **labels: str) -> float:
            return samples[(name, tuple(sorted(labels.items())))]

        assert sample("llmproxy_requests_total", model="m", host="gpu1", status="200",
                      outcome="completed") == 5
        assert sample("llmproxy_requests_total", model="unknown", host="-", status="404",
                      outcome="completed") == 2
        assert sample("llmproxy_request_duration_seconds_count", model="m") == 5
        assert sample("llmproxy_time_to_first_byte_seconds_count", model="m") == 5
        assert sample("llmproxy_tokens_total", model="m", kind="prompt") == sum(
            u["prompt_tokens"] for u in usage) + 3
        assert sample("llmproxy_tokens_total", model="m", kind="completion") == sum(
            u["completion_tokens"] for u in usage) + 7
        assert sample("llmproxy_roster_reads_total", host="gpu1", outcome="ok") >= 1
        assert sample("llmproxy_generation") == 1
        assert sample("llmproxy_build_info", version=proxy.get_json("/status")["version"]) == 1
        assert sample("llmproxy_relayed_bytes_total", host="gpu1") > 0
    finally:
        proxy.stop()


FAST = {"X-Sim-Delay": "0", "X-Sim-Tokens": "4"}


def test_requests_leave_no_garbage_for_the_collector(engine: SimEngine, tmp_path: Path) -> None:
    """What a request makes (its record, the relay, the engine's response, the
    connections) is freed by reference counts when it ends: across 120 answers,
    streamed and not, on kept-alive and fresh connections, the garbage
    collector finds next to nothing (it found about 46 objects per request when
    the relay and the engine's response kept each other). Read from the process
    metrics /metrics has (python_gc_*, process_*).

    A property of the engine_client speedup, so it runs with the speedups on in
    both of the suite's runs: on the reference path, Twisted 26.10's own client
    leaves a cycle per chunked response (its _ChunkedTransferDecoder keeps its
    parser's finish callback, the parser keeps the decoder), which only the
    collector frees (docs/performance.md)."""
    proxy = Proxy(one_host(engine, "m-up"), tmp_path, extra_env={"LLMPROXY_SPEEDUPS": "1"})
    try:
        def collected() -> float:
            with urllib_open(proxy.url + "/metrics") as r:
                text = r.read().decode()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            assert families["process_resident_memory_bytes"].samples[0].value > 0
            return sum(s.value for s in families["python_gc_objects_collected"].samples)

        for _ in range(5):
            post(proxy.port, stream=True, headers=FAST)
        before = collected()
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        for i in range(100):
            body = {"model": "m", "stream": i % 2 == 0, "messages": [{"role": "user",
                                                                       "content": "a b c"}]}
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Content-Type": "application/json", **FAST})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read()
        conn.close()
        for _ in range(20):
            assert post(proxy.port, stream=True, headers=FAST)[0] == 200
        assert collected() - before < 60
    finally:
        proxy.stop()


def urllib_open(url: str) -> Any:
    import urllib.request

    return urllib.request.urlopen(url, timeout=10)


def test_status_command_exit_codes(engine: SimEngine, tmp_path: Path) -> None:
    """`llmproxy status`: 0 with a summary when ready, 1 while up but draining
    (prestop), 2 when nothing answers."""
    proxy = Proxy(one_host(engine, "m-up", prestop_seconds=5), tmp_path)
    try:
        ok = cli("status", "--url", proxy.url)
        assert ok.returncode == 0, ok.stderr
        assert ": ready (pid" in ok.stdout and "gpu1" in ok.stdout
        as_json = cli("status", "-c", str(proxy.config_path), "--url", proxy.url, "--json")
        assert json.loads(as_json.stdout)["state"] == "ready"
        proxy.signal(signal.SIGTERM)
        assert wait_until(lambda: cli("status", "--url", proxy.url).returncode == 1)
        draining = cli("status", "--url", proxy.url)
        assert ": draining (pid" in draining.stdout
    finally:
        proxy.stop()
    with refusing_port() as port:
        nobody = cli("status", "--url", f"http://127.0.0.1:{port}")
    assert nobody.returncode == 2 and "cannot reach" in nobody.stderr


def test_upgrade_command_tells_the_truth(engine: SimEngine, tmp_path: Path) -> None:
    """`llmproxy upgrade`: exit 0 naming both pids once the new process serves and
    the old one drained, both generations recording it; exit 1 with the reason
    when the candidate's config is broken (the old process serves on); exit 2
    with no proxy. The event stream shows the upgrade as it happens."""
    proxy = Proxy(one_host(engine, "m-up"), tmp_path)
    old = new = proxy.pid
    try:
        events = Events(proxy.port)
        done = cli("upgrade", "--url", proxy.url, "--timeout", "30")
        assert done.returncode == 0, done.stdout + done.stderr
        new = proxy.serving_pid()
        assert new != old
        assert f"(pid {old}) -> " in done.stdout and f"(pid {new}), generation 2" in done.stdout
        assert f"pid {old} drained and exited" in done.stdout
        stages = [m["data"]["stage"] for m in events.messages if m["event"] == "upgrade"]
        assert stages[:3] == ["started", "ready", "handed_over"]
        assert events.ended.wait(10)      # the old process ended its streams
        status = proxy.get_json("/status")
        assert status["generation"] == 2 and status["last_upgrade"]["old_pid"] == old
        assert status["last_upgrade"]["new_pid"] == new
        assert "upgrade: " in proxy.output() and f"(pid {new}) ready in" in proxy.output()

        proxy.config_path.write_text("{ not json")
        failed = cli("upgrade", "--url", proxy.url, "--timeout", "30")
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert "failed" in failed.stderr and f"pid {new} keeps serving" in failed.stderr
        assert proxy.serving_pid() == new
        assert proxy.get_json("/status")["last_upgrade"]["outcome"] == "failed"
    finally:
        proxy.stop()
        if new != old:          # the successor is not the test's child
            os.kill(new, signal.SIGTERM)
            if not wait_gone(new, 20):
                kill_if_alive(new)
        assert wait_gone(new, 20)
    with refusing_port() as port:
        nobody = cli("upgrade", "--url", f"http://127.0.0.1:{port}")
    assert nobody.returncode == 2


def test_an_upgrade_ends_event_streams_cleanly_with_its_last_events(engine: SimEngine,
                                                                    tmp_path: Path) -> None:
    """An event stream open during a SIGUSR1 upgrade, next to an idle keep-alive
    connection and with no request in flight (the old process's stop then ends in
    one turn): it still gets the hand-over and the stop event, then the end of its
    chunked body, before the old process exits."""
    proxy = Proxy(one_host(engine, "m-up"), tmp_path)
    new = proxy.pid
    idle = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    raw = socket.create_connection(("127.0.0.1", proxy.port))
    try:
        idle.request("GET", "/healthz")
        idle.getresponse().read()                  # kept alive, idle
        raw.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert wait_until(lambda: proxy.get_json("/status")["event_streams"] == 1)
        proxy.signal(signal.SIGUSR1)
        raw.settimeout(20)
        data = b""
        while chunk := raw.recv(65536):
            data += chunk
        assert b'"stage":"handed_over"' in data and b'"stage":"begun"' in data
        assert data.endswith(b"\r\n0\r\n\r\n"), data[-200:]
        assert proxy.popen.wait(20) == 0
        new = proxy.serving_pid()
    finally:
        raw.close()
        idle.close()
        proxy.stop()
        if new != proxy.pid:
            os.kill(new, signal.SIGTERM)
            wait_gone(new, 20)
