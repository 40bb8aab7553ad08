"""Inherited listening sockets with real processes: zero-downtime upgrades on
SIGUSR1 under load, failed candidates, systemd socket activation and its
edge cases, and a restart on a socket that systemd-socket-activate holds."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.procs import (
    ROOT,
    BodyReader,
    Proc,
    Proxy,
    SimEngine,
    env,
    gone,
    kill_if_alive,
    twistd,
    wait_gone,
    wait_new_pid,
)

pytestmark = pytest.mark.integration


ENGINE_MODELS = ("m", "n")   # the `engine` fixture's (conftest.py)


def config(engine: SimEngine, **extra: Any) -> dict[str, Any]:
    return {"hosts": [{"name": "gpu1", "url": engine.url}], "models": {"m": {"host": "gpu1"}},
            **extra}


class Load(threading.Thread):
    """A steady loop of short requests, each on a new connection, counting failures."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.ok = 0
        self.failures: list[str] = []
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        for i in range(5000):
            if self.stopping.is_set():
                return
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                if i % 2:
                    conn.request("GET", "/v1/models")
                else:
                    conn.request("POST", "/v1/chat/completions",
                                 json.dumps({"model": "m", "max_tokens": 2}),
                                 {"X-Sim-Delay": "0"})
                resp = conn.getresponse()
                body = resp.read()
                conn.close()
                if resp.status != 200 or (i % 2 and b'"m"' not in body):
                    self.failures.append(f"{resp.status} {body[:200]!r}")
                else:
                    self.ok += 1
            except Exception as e:   # refused, reset, timeout: all failures
                self.failures.append(repr(e))
            time.sleep(0.01)

    def finish(self) -> None:
        self.stopping.set()
        self.join(15)


class LongStream(BodyReader):
    """A long stream of model m, read in the background."""

    def __init__(self, port: int, tokens: int, delay: float) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.request("POST", "/v1/chat/completions",
                          json.dumps({"model": "m", "stream": True}),
                          {"X-Sim-Delay": str(delay), "X-Sim-Tokens": str(tokens)})
        resp = self.conn.getresponse()
        self.request_id = resp.getheader("X-Request-Id")
        super().__init__(resp)


@pytest.mark.parametrize("with_pidfile", [True, False])
def test_upgrades_under_load_lose_nothing(engine: SimEngine, tmp_path: Path,
                                          with_pidfile: bool) -> None:
    """Several SIGUSR1 in a row under a steady load plus one long stream: zero
    failed or reset requests, the long stream completes on the process that
    started it, /status names the new pid after each upgrade (so does the pid
    file), and every old process exits after its drain."""
    pidfile = tmp_path / "llmproxy.pid" if with_pidfile else None
    proxy = Proxy(config(engine), tmp_path, pidfile=pidfile)
    pids = [proxy.pid]
    try:
        first_prefix = http_request_id(proxy).split("-")[0]
        load = Load(proxy.port)
        stream = LongStream(proxy.port, tokens=30, delay=0.15)
        assert stream.request_id and stream.request_id.startswith(first_prefix + "-")
        for generation in (2, 3, 4):
            os.kill(pids[-1], signal.SIGUSR1)
            pids.append(wait_new_pid(proxy, pids[-1]))
            status = proxy.get_json("/status")
            assert status["generation"] == generation
            assert status["predecessor"]["pid"] == pids[-2]
            if pidfile:
                assert int(pidfile.read_text()) == pids[-1]
            time.sleep(0.3)
        stream.join(20)
        load.finish()
        assert stream.error is None
        assert stream.body.count(b"tok") == 30 and stream.body.rstrip().endswith(b"[DONE]")
        assert proxy.wait_for(rf"{stream.request_id} POST .* outcome=completed")
        assert load.failures == [] and load.ok > 50
        for old in pids[:-1]:
            assert wait_gone(old), f"pid {old} did not exit"
        assert proxy.popen.wait(5) == 0          # the first one exited cleanly
        assert proxy.get_json("/status")["predecessor"]["draining"] is False
    finally:
        last = pids[-1]
        os.kill(last, signal.SIGTERM)
        assert wait_gone(last)
        for pid in pids:
            kill_if_alive(pid)
    if pidfile:
        assert not pidfile.exists()              # removed by the last process only


def http_request_id(proxy: Proxy) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    conn.request("GET", "/healthz")
    resp = conn.getresponse()
    resp.read()
    return str(resp.getheader("X-Request-Id"))


def test_broken_config_candidate_changes_nothing(engine: SimEngine, tmp_path: Path) -> None:
    """SIGUSR1 with a broken config on disk: the candidate exits, the old process
    keeps serving with zero failed requests, says why, and /status shows it; a
    SIGUSR1 during an upgrade is ignored with a log line."""
    proxy = Proxy(config(engine), tmp_path)
    try:
        load = Load(proxy.port)
        proxy.write_config({"hosts": [{"name": "gpu1", "url": "ftp://nope"}]})
        proxy.signal(signal.SIGUSR1)
        proxy.wait_for(r"upgrade: started candidate pid")
        proxy.signal(signal.SIGUSR1)            # while the candidate starts up
        proxy.wait_for(r"upgrade: failed, this process keeps serving: candidate pid \d+ exited "
                       r"with status 78 before it was ready")
        assert "hosts[0].url: not an http(s) URL" in proxy.output()
        assert "upgrade: ignored SIGUSR1: an upgrade is in progress" in proxy.output()
        time.sleep(0.5)
        load.finish()
        assert load.failures == [] and load.ok > 10
        status = proxy.get_json("/status")
        assert status["pid"] == proxy.pid and status["generation"] == 1
        assert status["last_upgrade"]["outcome"] == "failed"
    finally:
        assert proxy.stop() == 0


def test_candidate_that_is_never_ready_is_killed(tmp_path: Path) -> None:
    """A candidate that does not become ready in time (its roster read hangs)
    is killed; the old process keeps serving."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)               # accepts into the queue, never answers
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proxy = Proxy({"hosts": [{"name": "h", "url": url}], "roster_timeout_seconds": 3,
                       "upgrade_timeout_seconds": 1.5}, tmp_path)
        try:
            proxy.signal(signal.SIGUSR1)
            m = proxy.wait_for(r"upgrade: failed, this process keeps serving: candidate pid "
                               r"(\d+) was not ready within 1.5s", timeout=30)
            assert wait_gone(int(m.group(1)), 10)
            assert proxy.get_json("/healthz") == {"status": "alive"}
        finally:
            proxy.stop()
    finally:
        silent.close()


def start_with_socket(sock: socket.socket, tmp_path: Path, config_doc: dict[str, Any],
                      variables: dict[str, str], listen_pid: str = "$$") -> Proc:
    """Start twistd llmproxy with `sock` as fd 3 and the given LISTEN_* variables,
    LISTEN_PID set by the launching shell (its own pid, as systemd does)."""
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(config_doc))
    fd = sock.fileno()
    # bash (not dash: it takes fds above 9) moves the socket to fd 3, as systemd passes it.
    script = f'exec 3<&{fd} {fd}<&-; LISTEN_PID={listen_pid}; export LISTEN_PID; exec "$@"'
    return Proc(["/bin/bash", "-c", script, "sh", twistd(), "-n", "--pidfile=", "llmproxy",
                 "-c", str(path)], cwd=tmp_path, extra_env=variables, pass_fds=(fd,))


def listening_socket() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s


def test_socket_activation_variants(engine: SimEngine, tmp_path: Path) -> None:
    """LISTEN_FDS=2, 0 or not a number is refused with exit status 78 (EX_CONFIG,
    no restart loop) and a message naming it; a LISTEN_PID for another process is
    ignored (it binds `listen` itself); without LISTEN_FDNAMES the socket is still
    adopted and serves, with a warning naming both addresses when the config's
    `listen` is another one."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    try:
        two = start_with_socket(sock, tmp_path, config(engine), {"LISTEN_FDS": "2"})
        assert two.popen.wait(20) == 78
        assert "LISTEN_FDS=2: llmproxy takes exactly one listening socket" in two.output()
        assert "Traceback" not in two.output()
        for bad in ("0", "three"):
            refused = start_with_socket(sock, tmp_path, config(engine), {"LISTEN_FDS": bad})
            assert refused.popen.wait(20) == 78, refused.output()
            assert f"LISTEN_FDS={bad!r}" in refused.output() or f"LISTEN_FDS={bad}" in (
                refused.output()), refused.output()
            assert "Traceback" not in refused.output()

        other = start_with_socket(sock, tmp_path, config(engine), {"LISTEN_FDS": "1"},
                                  listen_pid="1")
        try:
            other.wait_for(r"ready: listening on http://127\.0\.0\.1:(\d+) \(bound\)")
            assert "LISTEN_PID=1 is not this process" in other.output()
        finally:
            other.stop()

        elsewhere = {**config(engine), "listen": "127.0.0.1:9"}
        plain = start_with_socket(sock, tmp_path, elsewhere, {"LISTEN_FDS": "1"})
        try:
            plain.wait_for(rf"ready: listening on http://127\.0\.0\.1:{port} \(inherited fd 3\)")
            assert (f"listen: the config says 127.0.0.1:9 but the inherited socket is "
                    f"127.0.0.1:{port}") in plain.output()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            assert "m" in [x["id"] for x in json.loads(conn.getresponse().read())["data"]]
        finally:
            assert plain.stop() == 0
    finally:
        sock.close()


@pytest.mark.parametrize("value, message", [
    ("0", "LISTEN_FDS=0: llmproxy takes exactly one listening socket"),
    ("three", "LISTEN_FDS='three': not a number"),
])
def test_listen_fds_that_name_no_socket_are_refused(engine: SimEngine, tmp_path: Path,
                                                    value: str, message: str) -> None:
    """LISTEN_FDS=0, or not a number, for this very process: twistd refuses to
    start with a one-line reason naming it, no traceback."""
    sock = listening_socket()
    try:
        proc = start_with_socket(sock, tmp_path, config(engine), {"LISTEN_FDS": value})
        assert proc.popen.wait(20) != 0
    finally:
        sock.close()
    assert message in proc.output()
    assert "Traceback" not in proc.output()


def installed_copy(tmp_path: Path) -> Path:
    """The package copied aside, as a separate install whose files a test may
    change like a new release would (the running process keeps what it imported)."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "llmproxy", site / "llmproxy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


@pytest.mark.parametrize("breakage, why", [
    ("import", r"exited with status 1 before it was ready"),
    ("crash", r"was killed by signal SIGABRT before it was ready"),
])
def test_broken_new_code_is_rolled_back(engine: SimEngine, tmp_path: Path, breakage: str,
                                        why: str) -> None:
    """SIGUSR1 after installing code that cannot be imported (a syntax error in
    the module twistd loads), or that crashes as it starts (abort() while the
    service is built): the candidate dies, the old process says why, serves on
    with zero failed requests, and /status records the failure."""
    site = installed_copy(tmp_path)
    proxy = Proxy(config(engine), tmp_path, extra_env={"PYTHONPATH": str(site)})
    try:
        assert proxy.get_json("/healthz") == {"status": "alive"}
        load = Load(proxy.port)
        if breakage == "import":
            tap = site / "llmproxy" / "tap.py"
            tap.write_text(tap.read_text() + "\ndef broken(:\n")
        else:
            wiring = site / "llmproxy" / "lifecycle" / "assemble.py"
            wiring.write_text(wiring.read_text() + "\nimport os\nos.abort()\n")
        proxy.signal(signal.SIGUSR1)
        m = proxy.wait_for(r"upgrade: failed, this process keeps serving: candidate pid (\d+) "
                           + why, timeout=30)
        assert wait_gone(int(m.group(1)), 10)
        if breakage == "import":
            assert "SyntaxError" in proxy.output()     # the candidate's own words
        time.sleep(0.5)
        load.finish()
        assert load.failures == [] and load.ok > 10
        status = proxy.get_json("/status")
        assert status["pid"] == proxy.pid and status["last_upgrade"]["outcome"] == "failed"
    finally:
        assert proxy.stop() == 0


def test_restart_on_a_held_socket_refuses_nothing(engine: SimEngine, tmp_path: Path) -> None:
    """Under systemd-socket-activate (the socket held by a stand-in manager):
    stop the proxy during a stream and start a new one on the same socket; the
    stream completes from the old process, and a request sent during the drain
    is answered by the new one with the complete model list, nothing refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = tmp_path / "hosts.json"
    cfg.write_text(json.dumps(config(engine, listen=f"127.0.0.1:{port}")))
    log = (tmp_path / "proxies.log").open("w")
    holder = subprocess.Popen(
        ["systemd-socket-activate", "-l", f"127.0.0.1:{port}", "--fdname=http",
         "-E", "PYTHONPATH", "-E", "PATH", "-E", "PYTHONUNBUFFERED",
         sys.executable, str(ROOT / "tests" / "socketholder.py"),
         twistd(), "-n", "--pidfile=", "llmproxy", "-c", str(cfg)],
        env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
        text=True, bufsize=1, cwd=tmp_path)
    assert holder.stdin is not None and holder.stdout is not None
    started: list[int] = []
    try:
        first = threading.Thread(target=lambda: started.append(_start(holder)), daemon=True)
        first.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:   # until systemd-socket-activate listens
            with socket.socket() as knock:   # the first connection makes it exec the holder
                if knock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        first.join(20)
        assert started, "the holder started no proxy"
        stream = LongStream(port, tokens=12, delay=0.2)
        os.kill(started[0], signal.SIGTERM)
        time.sleep(0.3)
        during: list[Any] = []
        asker = threading.Thread(target=_models, args=(port, during), daemon=True)
        asker.start()                        # waits in the held socket's queue
        started.append(_start(holder))       # the next generation
        asker.join(20)
        stream.join(20)
        assert during and during[0] == ["m", "n"], during
        assert stream.error is None and stream.body.count(b"tok") == 12
        assert stream.body.rstrip().endswith(b"[DONE]")
        assert wait_gone(started[0])
    finally:
        for pid in started:
            if not gone(pid):
                os.kill(pid, signal.SIGTERM)
        for pid in started:
            wait_gone(pid, 10)
            kill_if_alive(pid)
        holder.stdin.close()
        holder.wait(10)
        log.close()


def _start(holder: subprocess.Popen[str]) -> int:
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write("start\n")
    holder.stdin.flush()
    line = holder.stdout.readline()
    assert line.startswith("started "), line
    return int(line.split()[1])


def _models(port: int, out: list[Any]) -> None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models")
        out.append(sorted(x["id"] for x in json.loads(conn.getresponse().read())["data"]))
    except Exception as e:
        out.append(e)


def test_sigint_to_both_generations_during_the_drain_cuts_nothing(engine: SimEngine,
                                                                  tmp_path: Path) -> None:
    """Ctrl-C in a terminal reaches both generations: a SIGINT to the old process
    draining after an upgrade is its first signal, not a second one; its stream
    completes and it exits 0, and the new process stops cleanly after it."""
    proxy = Proxy(config(engine), tmp_path)
    old = proxy.pid
    new = old
    try:
        stream = LongStream(proxy.port, tokens=20, delay=0.15)
        proxy.signal(signal.SIGUSR1)
        new = wait_new_pid(proxy, old)
        assert not gone(old)
        os.kill(old, signal.SIGINT)
        os.kill(new, signal.SIGINT)
        stream.join(20)
        assert stream.error is None
        assert stream.body.count(b"tok") == 20 and stream.body.rstrip().endswith(b"[DONE]")
        assert proxy.popen.wait(20) == 0
        assert wait_gone(new, 20)
        assert "outcome=cut" not in proxy.output() and "again during the stop" not in (
            proxy.output())
    finally:
        kill_if_alive(new)
        proxy.stop()
