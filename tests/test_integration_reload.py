"""SIGHUP reload of a real `twistd -n llmproxy`: it never kills the process,
applies only what may change, refuses the rest by name, keeps the running config
on a bad file, and says so in the log, to `llmproxy reload` and to systemd."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.notifysock import NotifyReceiver
from tests.procs import Proxy, SimEngine, env, refusing_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[SimEngine, SimEngine]]:
    a, b = SimEngine(["m"]), SimEngine(["m"])
    yield a, b
    a.stop()
    b.stop()


def base(engines: tuple[SimEngine, SimEngine], listen: str = "127.0.0.1:0") -> dict[str, Any]:
    a, b = engines
    return {"listen": listen,
            "hosts": [{"name": "a", "url": a.url}, {"name": "b", "url": b.url}],
            "models": {"m": {"host": "a"}}, "aliases": {}}


def model_ids(proxy: Proxy) -> list[str]:
    return [m["id"] for m in proxy.get_json("/v1/models")["data"]]


def cli_reload(proxy: Proxy) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", "reload", "--url", proxy.url],
                          capture_output=True, text=True, env=env(), timeout=30, check=False)


@pytest.mark.parametrize("delay", [0.05, 0.3, 1.0])
def test_sighup_early_in_start_up_never_kills_the_process(
        engines: tuple[SimEngine, SimEngine], tmp_path: Path, delay: float) -> None:
    """Started as the unit starts it (bin/llmproxy-twistd), a SIGHUP 0.05 s, 0.3 s
    or 1 s after the process starts never kills it: it becomes ready and serves."""
    proxy = Proxy(base(engines), tmp_path, wait_ready=False, launcher=True)
    try:
        time.sleep(delay)
        proxy.signal(signal.SIGHUP)
        proxy.wait_ready()
        assert proxy.popen.poll() is None
        assert "m" in model_ids(proxy)
    finally:
        assert proxy.stop() == 0


def test_without_the_launcher_an_early_sighup_kills(engines: tuple[SimEngine, SimEngine],
                                                    tmp_path: Path) -> None:
    """The control for the test above: plain twistd dies of a SIGHUP that lands
    before llmproxy's handler exists (the window the launcher closes)."""
    proxy = Proxy(base(engines), tmp_path, wait_ready=False)
    try:
        time.sleep(0.02)
        proxy.signal(signal.SIGHUP)
        assert proxy.popen.wait(10) == -signal.SIGHUP
    finally:
        if proxy.popen.poll() is None:      # it survived: not left running
            proxy.stop()


def test_reload_kinds(engines: tuple[SimEngine, SimEngine], tmp_path: Path) -> None:
    """Applied (visible in /v1/models), refused naming every field, invalid JSON
    and an unreadable file: each does what it says, in one log line each, and
    `llmproxy reload` exits 0 only when applied."""
    config = base(engines)
    proxy = Proxy(config, tmp_path, launcher=True)
    try:
        proxy.write_config({**config, "aliases": {"coder": "m"}})
        done = cli_reload(proxy)
        assert done.returncode == 0 and done.stdout.strip() == "reload: applied aliases (+coder)"
        assert "coder" in model_ids(proxy)

        proxy.write_config({**config, "listen": "127.0.0.1:1", "drain_seconds": 3,
                            "aliases": {"other": "m"}})
        proxy.signal(signal.SIGHUP)
        proxy.wait_for("reload: kept the running config: listen changed: restart to apply; "
                       "drain_seconds changed: restart to apply")
        assert "other" not in model_ids(proxy) and "coder" in model_ids(proxy)
        refused = cli_reload(proxy)
        assert refused.returncode == 1 and "listen changed" in refused.stderr

        proxy.config_path.write_text("{not json")
        proxy.signal(signal.SIGHUP)
        proxy.wait_for(r"reload: kept the running config: the file is invalid: .*not valid JSON")
        proxy.config_path.unlink()
        proxy.signal(signal.SIGHUP)
        proxy.wait_for(r"reload: kept the running config: the file is invalid: .*cannot read")
        assert "coder" in model_ids(proxy)
        status = proxy.get_json("/status")["config"]
        assert status["generation"] == 2 and status["last_reload"]["outcome"] == "kept"
    finally:
        assert proxy.stop() == 0


def own_address() -> str | None:
    """An IPv4 address of this machine other than loopback (`ip`'s global ones)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\binet (\d+\.\d+\.\d+\.\d+)/", out)
    return m.group(1) if m else None


def post_from(source: str, port: int, path: str) -> tuple[int, dict[str, Any]]:
    """POST `path` to the proxy on 127.0.0.1, the connection's source being
    `source` (a local address: nothing leaves the machine)."""
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.sock = sock
        conn.request("POST", path, b"")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        sock.close()


def test_admin_reload_answers_loopback_only(engines: tuple[SimEngine, SimEngine],
                                            tmp_path: Path) -> None:
    """POST /admin/reload from a non-loopback address of this machine is 403
    and reloads nothing (no reload line, generation unchanged); from loopback
    it reloads."""
    source = own_address()
    if source is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    proxy = Proxy(base(engines), tmp_path)
    try:
        status, doc = post_from(source, proxy.port, "/admin/reload")
        assert status == 403 and doc["error"]["code"] == "forbidden"
        assert "loopback only" in doc["error"]["message"]
        assert proxy.get_json("/status")["config"]["generation"] == 1
        assert "reload: " not in proxy.output()
        status, doc = post_from("127.0.0.1", proxy.port, "/admin/reload")
        assert status == 200 and doc["outcome"] == "applied"
    finally:
        assert proxy.stop() == 0


def test_llmproxy_reload_exits_2_when_it_cannot_ask(tmp_path: Path) -> None:
    """`llmproxy reload` with nobody listening where the config (or --url) says:
    exit 2, saying it cannot reach the proxy."""
    with refusing_port() as port:
        path = tmp_path / "hosts.json"
        path.write_text(json.dumps({"listen": f"127.0.0.1:{port}",
                                    "hosts": [{"name": "a", "url": "http://127.0.0.1:9"}]}))
        for where in (["-c", str(path)], ["--url", f"http://127.0.0.1:{port}"]):
            done = subprocess.run([sys.executable, "-m", "llmproxy.cli", "reload", *where],
                                  capture_output=True, text=True, env=env(), timeout=30,
                                  check=False)
            assert done.returncode == 2, (where, done)
            assert f"llmproxy reload: cannot reach http://127.0.0.1:{port}" in done.stderr


def test_request_across_a_reload_keeps_its_routing(engines: tuple[SimEngine, SimEngine],
                                                   tmp_path: Path) -> None:
    """A stream running across a reload that moves its model to another host
    completes from the old host; the next request goes to the new one."""
    a, b = engines
    config = base(engines)
    proxy = Proxy(config, tmp_path)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=20)
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": "m", "stream": True}),
                     {"X-Sim-Delay": "0.1", "X-Sim-Tokens": "15", "X-Test": "across"})
        resp = conn.getresponse()
        proxy.write_config({**config, "models": {"m": {"host": "b"}}})
        proxy.signal(signal.SIGHUP)
        proxy.wait_for(r"reload: applied models \(~m\)")
        body = resp.read()
        assert body.count(b"tok") == 15 and body.rstrip().endswith(b"data: [DONE]")
        across = [r for r in a.requests() if r["headers"].get("x-test") == "across"]
        assert across and across[0]["outcome"] == "completed"
        conn2 = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=20)
        conn2.request("POST", "/v1/chat/completions", json.dumps({"model": "m"}),
                      {"X-Test": "after"})
        assert conn2.getresponse().status == 200
        assert any(r["headers"].get("x-test") == "after" for r in b.requests())
    finally:
        proxy.stop()


def test_systemd_notifications_in_order(engines: tuple[SimEngine, SimEngine],
                                        tmp_path: Path) -> None:
    """A NOTIFY_SOCKET receiver sees READY, then RELOADING with MONOTONIC_USEC,
    then READY with the reload's STATUS, then STOPPING, in that order."""
    with NotifyReceiver(tmp_path) as notify:
        config = base(engines)
        proxy = Proxy(config, tmp_path, extra_env={"NOTIFY_SOCKET": notify.address})
        notify.wait_for(lambda m: m.get("READY") == "1")
        proxy.write_config({**config, "aliases": {"coder": "m"}})
        proxy.signal(signal.SIGHUP)
        notify.wait_for(lambda m: m.get("STATUS", "").startswith("reload: applied"))
        proxy.signal(signal.SIGTERM)
        assert proxy.popen.wait(20) == 0
        notify.wait_for(lambda m: m.get("STOPPING") == "1")
        kinds = []
        for m in notify.messages:
            if "RELOADING" in m:
                assert int(m["MONOTONIC_USEC"]) > 0
                kinds.append("RELOADING")
            elif "STOPPING" in m:
                kinds.append("STOPPING")
            elif m.get("READY") == "1":
                kinds.append("READY+STATUS" if m.get("STATUS", "").startswith("reload")
                             else "READY")
        assert kinds == ["READY", "RELOADING", "READY+STATUS", "STOPPING"]


def test_sighup_during_start_up_is_folded_into_it(engines: tuple[SimEngine, SimEngine],
                                                  tmp_path: Path) -> None:
    """SIGHUPs during a start-up whose roster read takes 2 s (a host that accepts
    and never answers): one 0.05 s after the process starts, two more 0.1 s and
    1 s into the roster read: nothing says READY=1 or RELOADING=1 before the proxy
    serves; the process never dies; after the first READY=1 the folded reload
    reads the file again (changed meanwhile) and reports it."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    config = {**base(engines), "roster_timeout_seconds": 2,
              "hosts": [*base(engines)["hosts"],
                        {"name": "mute", "url": f"http://127.0.0.1:{silent.getsockname()[1]}"}]}
    try:
        with NotifyReceiver(tmp_path) as notify:
            proxy = Proxy(config, tmp_path, wait_ready=False, launcher=True,
                          extra_env={"NOTIFY_SOCKET": notify.address})
            try:
                time.sleep(0.05)
                proxy.signal(signal.SIGHUP)         # before the config is even read
                # Once the config is read (the roster read, 2 s, has begun), change
                # the file and send two more while the start-up goes on.
                proxy.wait_for(r"reading the rosters of 3 host\(s\)")
                t0 = time.monotonic()
                proxy.write_config({**config, "aliases": {"coder": "m"}})
                for at in (0.1, 1.0):
                    time.sleep(max(0.0, t0 + at - time.monotonic()))
                    proxy.signal(signal.SIGHUP)
                assert proxy.popen.poll() is None
                assert not any("READY" in m or "RELOADING" in m for m in notify.messages), (
                    notify.messages)
                proxy.wait_ready()
                assert "m" in model_ids(proxy)
                notify.wait_for(lambda m: m.get("STATUS", "").startswith("reload:"))
                first_ready = next(i for i, m in enumerate(notify.messages)
                                   if m.get("READY") == "1")
                assert not any("RELOADING" in m for m in notify.messages[:first_ready])
                reloaded = [m for m in notify.messages if m.get("STATUS", "").startswith(
                    "reload:")]
                assert reloaded[0]["STATUS"].startswith("reload: applied aliases (+coder)")
                assert "coder" in model_ids(proxy)
                assert proxy.popen.poll() is None
            finally:
                assert proxy.stop() == 0
    finally:
        silent.close()
