"""A host's slots and queue for real: twistd llmproxy in front of a simulated
engine, whose own record (`GET /sim/requests`, with each request's start and
end) says how many requests it served at once and in which order."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.procs import (
    BodyReader,
    Proc,
    Proxy,
    SimEngine,
    env,
    free_port,
    kill_if_alive,
    wait_gone,
    wait_until,
)

pytestmark = pytest.mark.integration


class Client(threading.Thread):
    """One streaming chat request, read to its end on its own thread."""

    def __init__(self, port: int, tag: str, tokens: int = 20) -> None:
        super().__init__(daemon=True)
        self.tag = tag
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body = b""
        self.error: BaseException | None = None
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.request("POST", "/v1/chat/completions",
                          json.dumps({"model": "m", "stream": True, "user": tag}),
                          {"X-Sim-Delay": "0.05", "X-Sim-Tokens": str(tokens)})
        self.start()

    def leave(self) -> None:
        """Close the connection now (the reading thread keeps a reference to the
        socket, so shut it down rather than just close it)."""
        assert self.conn.sock is not None
        self.conn.sock.shutdown(socket.SHUT_RDWR)

    def run(self) -> None:
        try:
            resp = self.conn.getresponse()
            self.status, self.headers = resp.status, dict(resp.getheaders())
            self.body = resp.read()
        except BaseException as e:      # the test reports it
            self.error = e


def capacity(proxy: Proxy) -> dict[str, Any]:
    doc: dict[str, Any] = proxy.get_json("/status")["hosts"][0]["capacity"]
    return doc


def most_at_once(records: list[dict[str, Any]]) -> int:
    """The largest number of requests the engine was serving at one moment."""
    return max(sum(1 for r in records if r["started"] <= t["started"] < r["ended"])
               for t in records)


def send_in_order(proxy: Proxy, engine: SimEngine, n: int, slots: int,
                  tokens: int = 20) -> list[Client]:
    """n clients, each sent once the one before it is in the engine's record (the
    first `slots`) or in the proxy's queue (the rest): their arrival order is known."""
    clients = []
    for i in range(n):
        clients.append(Client(proxy.port, f"c{i}", tokens))
        if i < slots:
            assert wait_until(lambda i=i: len(engine.requests()) == i + 1)
        else:
            assert wait_until(lambda i=i: capacity(proxy)["queued"] == i + 1 - slots)
    return clients


def test_max_concurrent_two_serves_six_streams_two_at_a_time_in_order(
        fresh_engine: SimEngine, tmp_path: Path) -> None:
    """max_concurrent 2 and six concurrent streams: the engine's own record never has
    more than two running at once, it received them in arrival order, and all six
    complete with [DONE]."""
    proxy = Proxy({"hosts": [{"name": "h1", "url": fresh_engine.url, "max_concurrent": 2}],
                   "models": {"m": {"host": "h1"}}}, tmp_path)
    try:
        clients = send_in_order(proxy, fresh_engine, 6, slots=2)
        for c in clients:
            c.join(30)
        assert [(c.error, c.status) for c in clients] == [(None, 200)] * 6
        assert all(c.body.rstrip().endswith(b"data: [DONE]") for c in clients)
        records = sorted(fresh_engine.requests(), key=lambda r: r["id"])
        assert [r["body"]["user"] for r in records] == [f"c{i}" for i in range(6)]
        assert all(r["outcome"] == "completed" for r in records)
        assert most_at_once(records) == 2
    finally:
        proxy.stop()


def test_a_full_queue_answers_429_and_a_client_that_leaves_never_reaches_the_engine(
        fresh_engine: SimEngine, tmp_path: Path) -> None:
    """max_concurrent 2, max_queue 2: two streams run, two wait; the fifth request gets
    429 queue_full with Retry-After. One waiting client then leaves: it is out of the
    queue at once and the engine never sees it; the others complete."""
    proxy = Proxy({"hosts": [{"name": "h1", "url": fresh_engine.url, "max_concurrent": 2,
                              "max_queue": 2}],
                   "models": {"m": {"host": "h1"}}}, tmp_path)
    try:
        clients = send_in_order(proxy, fresh_engine, 4, slots=2, tokens=40)
        refused = Client(proxy.port, "refused")
        refused.join(10)
        assert refused.status == 429 and refused.headers.get("Retry-After") == "5"
        error = json.loads(refused.body)["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
        leaving = clients.pop(2)
        leaving.leave()
        assert wait_until(lambda: capacity(proxy)["queued"] == 1)
        assert capacity(proxy)["in_flight"] == 2      # nothing was served meanwhile
        for c in clients:
            c.join(30)
        assert [(c.error, c.status) for c in clients] == [(None, 200)] * 3
        users = [r["body"]["user"] for r in fresh_engine.requests()]
        assert sorted(users) == ["c0", "c1", "c3"]
        assert "queue of h1 is full (2 waiting): refused" in proxy.output()
    finally:
        proxy.stop()


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", *args], env=env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def one_request(proxy: Proxy, tag: str) -> tuple[int, dict[str, Any]]:
    client = Client(proxy.port, tag, tokens=2)
    client.join(20)
    assert client.error is None
    return client.status or 0, json.loads(client.body) if client.status != 200 else {}


def test_cordon_wait_returns_once_the_stream_ends_and_the_cordon_outlives_the_process(
        fresh_engine: SimEngine, tmp_path: Path) -> None:
    """`llmproxy cordon h1 -c hosts.json --wait` while a stream runs there: no new
    request reaches h1 meanwhile (503 host_cordoned), the command exits 0 once the
    stream has ended (not before), and the stream completes. `--timeout` exits 1
    naming what still runs. The cordon is still in force after a SIGUSR1 upgrade and
    after a restart (runtime_dir/cordons.json)."""
    doc = {"listen": f"127.0.0.1:{free_port()}", "runtime_dir": str(tmp_path / "run"),
           "hosts": [{"name": "h1", "url": fresh_engine.url}], "models": {"m": {"host": "h1"}}}
    proxy = Proxy(doc, tmp_path)
    pids = [proxy.pid]
    try:
        stream = Client(proxy.port, "stream", tokens=30)
        assert wait_until(lambda: len(fresh_engine.requests()) == 1)
        waiter = Proc([sys.executable, "-m", "llmproxy.cli", "cordon", "h1", "-c",
                       str(proxy.config_path), "--wait", "--timeout", "20"])
        waiter.wait_for(r"cordoned h1: 1 in flight, 0 queued")
        status, body = one_request(proxy, "during")
        assert status == 503 and body["error"]["code"] == "host_cordoned"
        assert waiter.popen.poll() is None and stream.is_alive()
        stream.join(30)
        assert waiter.popen.wait(10) == 0 and "h1 has nothing in flight" in waiter.output()
        assert stream.status == 200 and stream.body.rstrip().endswith(b"data: [DONE]")
        assert [r["body"]["user"] for r in fresh_engine.requests()] == ["stream"]

        assert cli("uncordon", "h1", "--url", proxy.url).returncode == 0
        long = Client(proxy.port, "long", tokens=100)
        assert wait_until(lambda: len(fresh_engine.requests()) == 2)
        late = cli("cordon", "h1", "--url", proxy.url, "--wait", "--timeout", "0.5")
        assert late.returncode == 1
        assert "h1 still busy after 0.5s: " in late.stderr and " m (" in late.stderr
        long.conn.sock.shutdown(socket.SHUT_RDWR)     # type: ignore[union-attr]

        proxy.signal(signal.SIGUSR1)
        assert wait_until(lambda: proxy.serving_pid() != pids[0], timeout=20)
        pids.append(proxy.serving_pid())
        assert one_request(proxy, "after-upgrade")[0] == 503
        assert proxy.get_json("/status")["hosts"][0]["capacity"]["cordoned"] is True
    finally:
        proxy.stop()
        for pid in pids[1:]:
            os.kill(pid, signal.SIGTERM)
            wait_gone(pid, 15)
            kill_if_alive(pid)
    restarted = Proxy(doc, tmp_path)
    try:
        assert one_request(restarted, "after-restart")[0] == 503
        assert cli("uncordon", "h1", "--url", restarted.url).returncode == 0
        assert one_request(restarted, "served")[0] == 200
        assert [r["body"]["user"] for r in fresh_engine.requests()][-1] == "served"
    finally:
        restarted.stop()


def chat_once(port: int, model: str = "m", **headers: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": model}),
                 {"X-Sim-Tokens": "2", "X-Sim-Delay": "0.01", **headers})
    resp = conn.getresponse()
    return resp.status, resp.read()


def test_two_hosts_share_a_model_and_the_survivor_takes_over_when_one_dies(
        tmp_path: Path) -> None:
    """One model on two hosts: 20 requests spread over both engines (their own
    records), a session with affinity stays on one, and while one host is cordoned
    the other takes every request; then one engine is killed: its
    stream in flight fails visibly (no [DONE]), and each of the 20 requests sent
    afterwards is served by the other with zero failures."""
    one, two = SimEngine(["m"]), SimEngine(["m"])
    proxy = Proxy({"runtime_dir": str(tmp_path / "run"),
                   "hosts": [{"name": "h1", "url": one.url}, {"name": "h2", "url": two.url}],
                   "models": {"m": {"hosts": ["h1", "h2"], "affinity": "header:X-Session-Id"}}},
                  tmp_path)
    try:
        assert [chat_once(proxy.port)[0] for _ in range(20)] == [200] * 20
        assert (len(one.requests()), len(two.requests())) == (10, 10)
        for _ in range(6):
            assert chat_once(proxy.port, **{"X-Session-Id": "s1"})[0] == 200
        homes = [e for e in (one, two)
                 if any(r["headers"].get("x-session-id") == "s1" for r in e.requests())]
        assert len(homes) == 1
        models = {m["id"]: m["llmproxy"] for m in proxy.get_json("/v1/models")["data"]}
        assert models["m"]["hosts"] == ["h1", "h2"]
        assert cli("cordon", "h1", "--url", proxy.url).returncode == 0
        served = len(one.requests())
        assert [chat_once(proxy.port)[0] for _ in range(4)] == [200] * 4
        assert len(one.requests()) == served                # its replica took them
        assert cli("uncordon", "h1", "--url", proxy.url).returncode == 0

        stream = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        stream.request("POST", "/v1/chat/completions",
                       json.dumps({"model": "h2/m", "stream": True}),
                       {"X-Sim-Tokens": "200", "X-Sim-Delay": "0.05"})
        reader = BodyReader(stream.getresponse())          # `h2/m`: on h2 alone
        assert wait_until(lambda: any(r["outcome"] == "running" for r in two.requests()))
        two.kill()
        reader.join(20)
        assert b"[DONE]" not in reader.body                  # cut, and the client sees it
        before = len(one.requests())
        results = [chat_once(proxy.port, **({"X-Session-Id": "s1"} if i % 2 else {}))
                   for i in range(20)]
        assert [status for status, _ in results] == [200] * 20
        assert len(one.requests()) == before + 20
        assert "h2 unreachable" in proxy.output()
    finally:
        proxy.stop()
        one.stop()
        two.stop()
