"""Hosts that sleep and wake, for real: a simulated GPU host in a network namespace
(tests/gpuhost.py) whose "suspend" (its sleep command, tests/wakehost.py) stops its sshd and
every ssh session, and whose Wake-on-LAN listener, in the namespace, starts sshd again when
a real magic packet for the namespace's MAC reaches it on the namespace's broadcast
address. twistd llmproxy puts the idle host to sleep, wakes it for a request, gives up with
a 424 when it does not wake, and never wakes it when another host serves the model."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import test_integration_page as page
from tests.gpuhost import GPUHost, engine_command
from tests.procs import Proxy, SimEngine, env, free_port, wait_until
from tests.wakehost import Machine

pytestmark = pytest.mark.integration
ENGINE_MODELS = ("ma",)
driver = page.driver


@pytest.fixture
def machine(gpu_host: GPUHost, tmp_path: Path) -> Iterator[Machine]:
    """The host's power state: its wake listener runs (stopped with the namespace)."""
    m = Machine(gpu_host, tmp_path)
    m.start()
    yield m


def config(host: GPUHost, machine: Machine, tmp_path: Path, *, mac: str | None = None,
           timeout: float = 30, after: float = 2) -> dict[str, Any]:
    port = free_port()
    return {
        "ssh_command": host.ssh_command,
        "runtime_dir": str(tmp_path / "locks"),
        "hosts": [{
            "name": "gpu1", "url": host.url(port), "ssh": host.target,
            "engines": {"a": {"command": engine_command(port, "ma"),
                              "start_timeout_seconds": 20}},
            "wake": {"mac": mac or machine.mac, "broadcast": machine.broadcast, "port": 9,
                     "timeout_seconds": timeout},
            "sleep": {"after_seconds": after, "command": machine.sleep_command()},
        }],
        "models": {"ma": {"host": "gpu1", "engine": "a"}},
    }


def post(port: int, model: str, stream: bool = False, **headers: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=90)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": model, "stream": stream}),
                 headers)
    return conn.getresponse()


def asleep(proxy: Proxy, machine: Machine) -> None:
    """Wait until the proxy put the idle host to sleep and its sshd is down."""
    proxy.wait_for(r"host gpu1 sent to sleep: idle for \d+s", timeout=40)
    assert wait_until(lambda: not machine.sshd_up(), 10), "sshd still runs"


def engine_doc(proxy: Proxy) -> Any:
    hosts = proxy.get_json("/status")["hosts"]
    return next(h for h in hosts if h["name"] == "gpu1")["engine"]


def metrics(proxy: Proxy) -> str:
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=5) as r:
        return str(r.read().decode())


def host_state(proxy: Proxy) -> Any:
    return engine_doc(proxy)["sleep"]["state"]


def test_an_idle_host_sleeps_and_a_request_wakes_it_and_streams(
        gpu_host: GPUHost, machine: Machine, tmp_path: Path) -> None:
    """Idle for after_seconds with no engine: the agent runs the sleep command (sshd
    stops); /status and /v1/models say asleep. A streaming request for its model sends
    a magic packet, the listener starts sshd, the engine starts and the answer streams in
    full, the client hearing keep-alive comments meanwhile; the wake's duration is logged."""
    proxy = Proxy(config(gpu_host, machine, tmp_path), tmp_path)
    try:
        asleep(proxy, machine)
        assert wait_until(lambda: host_state(proxy) == "asleep", 5)
        models = proxy.get_json("/v1/models")["data"]
        assert [m["llmproxy"]["state"] for m in models if m["id"] == "ma"] == ["asleep"]
        assert 'llmproxy_host_sleep_state{host="gpu1",state="asleep"} 1.0' in metrics(proxy)
        assert 'llmproxy_host_sleeps_total{host="gpu1",why="idle"} 1.0' in metrics(proxy)
        resp = post(proxy.port, "ma", stream=True, **{"X-Sim-Tokens": "5"})
        body = resp.read()
        assert resp.status == 200, body
        assert body.count(b"tok") == 5 and body.rstrip().endswith(b"[DONE]"), body
        assert body.startswith(b": waiting for host gpu1 to wake\n\n"), body   # keep-alive
        assert f"woken by 10.231.{gpu_host.subnet}.1" in machine.text()
        proxy.wait_for(r"waking host gpu1 \(a request for a\): magic packet sent to "
                       + machine.mac.replace(":", ""))
        proxy.wait_for(r"host gpu1 woke in \d+\.\d+s")
        assert host_state(proxy) == "awake"
        assert 'llmproxy_host_wakes_total{host="gpu1",outcome="done"} 1.0' in metrics(proxy)
    finally:
        proxy.stop()


def test_a_wake_that_times_out_answers_424_and_backs_off(
        gpu_host: GPUHost, machine: Machine, tmp_path: Path) -> None:
    """The packets name another MAC, so the host never wakes: after timeout_seconds the
    request gets a 424 naming the host and the timeout; the next one is refused at once
    (the backoff), no packet sent for it."""
    proxy = Proxy(config(gpu_host, machine, tmp_path, mac="02:00:00:00:00:01", timeout=3),
                  tmp_path)
    try:
        asleep(proxy, machine)
        resp = post(proxy.port, "ma")
        error = json.loads(resp.read())["error"]
        assert resp.status == 424 and error["type"] == "model_unavailable", error
        assert error["message"] == ("model ma: host gpu1 did not wake within 3s "
                                    "(wake.timeout_seconds)")
        assert "ignored 102 bytes" in machine.text() and "woken" not in machine.text()
        packets = machine.text().count("ignored")
        again = post(proxy.port, "ma")
        message = json.loads(again.read())["error"]["message"]
        assert again.status == 424 and "no new wake for" in message, message
        assert machine.text().count("ignored") == packets
        assert not machine.sshd_up()
    finally:
        proxy.stop()


def test_an_asleep_host_is_not_chosen_when_another_serves_the_model(
        gpu_host: GPUHost, machine: Machine, engine: SimEngine, tmp_path: Path) -> None:
    """Model ma on the sleeping host and on an awake one: every request goes to the awake
    host, no magic packet is sent and the sleeping host stays asleep."""
    doc = config(gpu_host, machine, tmp_path)
    doc["hosts"].append({"name": "local", "url": engine.url})
    doc["models"]["ma"] = {"hosts": ["gpu1", "local"], "engine": "a"}
    proxy = Proxy(doc, tmp_path)
    try:
        asleep(proxy, machine)
        for _ in range(3):
            resp = post(proxy.port, "ma")
            assert resp.status == 200, resp.read()
            resp.read()
        assert len(engine.requests()) == 3
        assert "woken" not in machine.text() and "ignored" not in machine.text()
        assert not machine.sshd_up() and host_state(proxy) == "asleep"
    finally:
        proxy.stop()


def cli(proxy: Proxy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", *args, "--url", proxy.url],
                          env=env(), capture_output=True, text=True, timeout=120, check=False)


def test_an_operator_puts_a_host_to_sleep_and_wakes_it(
        gpu_host: GPUHost, machine: Machine, tmp_path: Path) -> None:
    """`llmproxy sleep gpu1` on an idle host: the agent runs the sleep command; `llmproxy
    wake gpu1` sends the packet and returns once the agent answers; with an engine
    running, `llmproxy sleep` is refused, saying so."""
    proxy = Proxy(config(gpu_host, machine, tmp_path, after=3600), tmp_path)
    try:
        assert wait_until(lambda: engine_doc(proxy)["watch"]["lease"]["held"] is True, 20)
        slept = cli(proxy, "sleep", "gpu1")
        assert slept.returncode == 0 and slept.stdout.strip() == "gpu1: asleep", slept
        assert wait_until(lambda: not machine.sshd_up(), 10)
        woke = cli(proxy, "wake", "gpu1")
        assert woke.returncode == 0 and woke.stdout.strip() == "gpu1: awake", woke
        assert machine.sshd_up() and "woken by" in machine.text()
        resp = post(proxy.port, "ma")
        assert resp.status == 200, resp.read()
        refused = cli(proxy, "sleep", "gpu1")
        assert refused.returncode == 1 and "engines run: a" in refused.stderr, refused
        assert machine.sshd_up()
    finally:
        proxy.stop()


BADGES = ("return [...document.querySelectorAll('#hosts [data-host=\"gpu1\"] .host-head .badge')]"
          ".map((b) => b.innerText)")
MODEL_STATE = ("const r = document.querySelector('#models [data-model=\"ma\"]');"
               "return r ? r.querySelector('td.state').innerText : null")
EVENTS = "return document.getElementById('events').innerText"


def test_the_page_shows_a_host_asleep_and_its_wake(
        driver: Any, gpu_host: GPUHost, machine: Machine, tmp_path: Path) -> None:
    """In a real browser, live from the event stream: gpu1 gets an `asleep` badge and its
    model the state `asleep` when it is sent to sleep, and the events list says so; a
    request wakes it, the badge goes and the list says how long the wake took."""
    proxy = Proxy(config(gpu_host, machine, tmp_path, after=3600), tmp_path)
    try:
        assert wait_until(lambda: engine_doc(proxy)["watch"]["lease"]["held"] is True, 20)
        mark, loaded_at = page.open_page(driver, proxy)
        page.wait_js(driver, MODEL_STATE, what="ma in the models table")
        assert cli(proxy, "sleep", "gpu1").returncode == 0
        page.wait_until(lambda: "asleep" in driver.execute_script(BADGES), driver,
                        "gpu1 asleep", timeout=10)
        page.wait_until(lambda: driver.execute_script(MODEL_STATE) == "asleep", driver,
                        "ma asleep", timeout=10)
        assert "gpu1: sent to sleep by an operator" in driver.execute_script(EVENTS)
        assert wait_until(lambda: not machine.sshd_up(), 10)
        resp = post(proxy.port, "ma")
        assert resp.status == 200, resp.read()
        page.wait_until(lambda: "asleep" not in driver.execute_script(BADGES), driver,
                        "gpu1 awake", timeout=10)
        page.wait_until(lambda: "gpu1: woke in" in driver.execute_script(EVENTS), driver,
                        "the wake in the events", timeout=10)
        page.not_reloaded(driver, mark, loaded_at)
    finally:
        proxy.stop()
