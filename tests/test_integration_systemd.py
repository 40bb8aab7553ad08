"""The shipped units under a real systemd 254 user manager (tests/sdharness.py).

etc/llmproxy.socket and etc/llmproxy.service are installed as shipped, with only what must
change on a test machine substituted (the port, the launcher's path, the config's path), plus a
drop-in for PYTHONPATH and the log file. Each test proves one behaviour of issue 5 (socket
activation, reload that tells the truth, stop that drains) or issue 4 (upgrade on SIGUSR1 that
moves MainPID, stop right after an upgrade), against a SimEngine on 127.0.0.1.

Skipped when the harness cannot run here (not root, systemd 254 not fetched with
bin/fetch-systemd254, ...), unless LLMPROXY_REQUIRE_SYSTEMD is set: then an unavailable
harness fails every test instead.
"""

from __future__ import annotations

import http.client
import json
import pathlib
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests import needs
from tests.procs import ROOT, SimEngine, free_port, gone
from tests.sdharness import UserManager, available

REASON = available()
needs.module("systemd", REASON)

pytestmark = pytest.mark.integration

SERVICE = "llmproxy.service"
SOCKET = "llmproxy.socket"
SHIPPED_SERVICE = ROOT / "etc" / "llmproxy.service"
SHIPPED_SOCKET = ROOT / "etc" / "llmproxy.socket"
LAUNCHER = ROOT / "bin" / "llmproxy-twistd"
# What the shipped service says about these, as `systemctl show` spells it.
SHIPPED_PROPS = {"Type": "notify-reload", "NotifyAccess": "main", "KillMode": "mixed",
                 "TimeoutStopUSec": "3min 20s", "LimitNOFILE": "65536",
                 "LimitNOFILESoft": "65536"}


def substitute(text: str, old: str, new: str) -> str:
    """sed s|old|new|g on a shipped unit; the string must be there."""
    assert old in text, f"the shipped unit no longer contains {old!r}"
    return text.replace(old, new)


@dataclass
class Deployment:
    """The shipped units installed into a running harness, and how to talk to them."""

    manager: UserManager
    port: int
    config_path: pathlib.Path
    log: pathlib.Path
    config: dict[str, Any] = field(default_factory=dict)

    def write_config(self, config: dict[str, Any]) -> None:
        self.config = config
        self.config_path.write_text(json.dumps(config, indent=2))

    def get_json(self, path: str, timeout: float = 15) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                    timeout=timeout) as r:
            return json.load(r)

    def model_ids(self) -> list[str]:
        return sorted(m["id"] for m in self.get_json("/v1/models")["data"])

    def show(self, *props: str) -> dict[str, str]:
        return self.manager.show(SERVICE, *props)

    def main_pid(self) -> int:
        return int(self.show("MainPID")["MainPID"])

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def assert_no_traceback(self) -> None:
        text = self.log_text()
        assert "Traceback" not in text, text

    def assert_shipped_settings(self) -> None:
        """The settings this suite is about are in effect exactly as shipped."""
        props = self.show(*SHIPPED_PROPS, "ExecStart", "SuccessExitStatus", "Restart")
        assert {k: props[k] for k in SHIPPED_PROPS} == SHIPPED_PROPS, props
        assert f"path={LAUNCHER} ;" in props["ExecStart"], props["ExecStart"]
        assert f"-c {self.config_path} " in props["ExecStart"], props["ExecStart"]
        assert props["SuccessExitStatus"].split() == ["3"], props
        assert props["Restart"] == "on-failure", props
        more = self.show("RestartPreventExitStatus", "ExecStartPre", "Wants", "Requires")
        assert more["RestartPreventExitStatus"].split() == ["78"], more
        assert f"llmproxy.cli check -c {self.config_path} " in more["ExecStartPre"], more
        assert "ignore_errors=yes" in more["ExecStartPre"], more
        assert SOCKET in more["Wants"].split() and SOCKET not in more["Requires"].split()

    def activate(self) -> int:
        """Start the socket, then the service with a first request; return MainPID."""
        self.manager.systemctl("start", SOCKET)
        assert self.get_json("/healthz") == {"status": "alive"}
        self.manager.wait_for(SERVICE, "ActiveState", "active")
        pid = self.main_pid()
        assert pid > 0
        return pid

    def context(self) -> str:
        return (f"--- llmproxy.log\n{self.log_text()[-4000:]}\n"
                f"--- manager.log\n{self.manager.log_tail(30)}")


@pytest.fixture
def deployed(engine: SimEngine, tmp_path: pathlib.Path) -> Iterator[Deployment]:
    needs.need("systemd", REASON)
    manager = UserManager(tmp_path / "sd")
    manager.start()
    try:
        port = free_port()
        d = Deployment(manager, port, tmp_path / "hosts.json", tmp_path / "llmproxy.log")
        d.write_config({"listen": f"127.0.0.1:{port}",
                        "hosts": [{"name": "gpu1", "url": engine.url}],
                        "models": {"m": {"host": "gpu1"}}})
        socket_unit = substitute(SHIPPED_SOCKET.read_text(), "ListenStream=127.0.0.1:8080",
                                 f"ListenStream=127.0.0.1:{port}")
        service_unit = SHIPPED_SERVICE.read_text()
        service_unit = substitute(service_unit, "/opt/llmproxy/bin/llmproxy-twistd",
                                  str(LAUNCHER))
        service_unit = substitute(service_unit, "/opt/llmproxy/bin/llmproxy check",
                                  f"{sys.executable} -m llmproxy.cli check")
        service_unit = substitute(service_unit, "/etc/llmproxy/hosts.json", str(d.config_path))
        (manager.unit_dir / SOCKET).write_text(socket_unit)
        (manager.unit_dir / SERVICE).write_text(service_unit)
        dropin = manager.unit_dir / f"{SERVICE}.d"
        dropin.mkdir()
        (dropin / "test.conf").write_text(
            "[Service]\n"
            f"Environment=PYTHONPATH={ROOT}\n"
            f"StandardOutput=append:{d.log}\n"
            "StandardError=inherit\n")
        manager.systemctl("daemon-reload")
        d.assert_shipped_settings()
        yield d
    finally:
        manager.stop()
    d.assert_no_traceback()


class Stream(threading.Thread):
    """One streamed chat completion, sent and read chunk by chunk in a background thread."""

    def __init__(self, port: int, tokens: int = 15, delay: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.port, self.tokens, self.delay = port, tokens, delay
        self.status: int | None = None
        self.request_id: str | None = None
        self.body = b""
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self.start()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions",
                         json.dumps({"model": "m", "stream": True,
                                     "messages": [{"role": "user", "content": "hi"}]}),
                         {"Content-Type": "application/json", "X-Sim-Delay": str(self.delay),
                          "X-Sim-Tokens": str(self.tokens)})
            resp = conn.getresponse()
            self.status = resp.status
            self.request_id = resp.getheader("X-Request-Id")
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                with self._lock:
                    self.body += chunk
        except BaseException as e:   # reset, timeout, incomplete read: all recorded
            self.error = e
        finally:
            conn.close()

    def received(self) -> list[int]:
        """The numbers of the content tokens received so far ("tok0 ", "tok1 ", ...)."""
        with self._lock:
            return [int(n) for n in re.findall(rb'"tok(\d+) "', self.body)]

    def wait_tokens(self, n: int, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while len(self.received()) < n:
            assert self.is_alive(), f"stream ended early: {self.error!r} {self.body[-300:]!r}"
            assert time.monotonic() < deadline, f"fewer than {n} tokens: {self.body[-300:]!r}"
            time.sleep(0.02)

    def assert_complete(self, d: Deployment, timeout: float = 20) -> None:
        self.join(timeout)
        assert not self.is_alive(), f"stream still running\n{d.context()}"
        assert self.error is None, f"{self.error!r} {self.body[-300:]!r}\n{d.context()}"
        assert self.status == 200
        assert self.received() == list(range(self.tokens)), self.body[-300:]
        assert self.body.rstrip().endswith(b"data: [DONE]"), self.body[-300:]


class StatePoller(threading.Thread):
    """Samples (ActiveState, MainPID) of the service until stopped."""

    def __init__(self, d: Deployment) -> None:
        super().__init__(daemon=True)
        self.d = d
        self.samples: list[tuple[str, str]] = []
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stopping.is_set():
            p = self.d.show("ActiveState", "MainPID")
            self.samples.append((p["ActiveState"], p["MainPID"]))
            time.sleep(0.05)

    def finish(self) -> list[tuple[str, str]]:
        self.stopping.set()
        self.join(10)
        return self.samples


def wait_gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def upgrade(d: Deployment, old: int) -> int:
    """SIGUSR1 to the main process the way the unit's comment says; the new MainPID."""
    d.manager.systemctl("kill", "--kill-whom=main", "-s", "SIGUSR1", SERVICE)
    new = int(d.manager.wait_for(SERVICE, "MainPID", lambda v: v not in ("", "0", str(old)),
                                 timeout=20))
    assert new != old
    # The old process stops accepting just after it sent MAINPID=: wait for that, so that what
    # follows talks to the new process only.
    deadline = time.monotonic() + 10
    while f"(TCP Port {d.port} Closed)" not in d.log_text():
        assert time.monotonic() < deadline, f"the old process still accepts\n{d.context()}"
        time.sleep(0.02)
    return new


def in_flight_ids(d: Deployment) -> list[str]:
    return [r["id"] for r in d.get_json("/status")["in_flight"]]


# --- issue 5 -------------------------------------------------------------------------------------


def test_first_request_starts_the_service_with_the_full_model_list(
        deployed: Deployment) -> None:
    """Proves socket activation with the shipped units: once llmproxy.socket is started the
    port accepts while llmproxy.service stays inactive (no process); the first request,
    GET /v1/models, starts the service and is answered with the complete model list (the host's
    roster already read: `m` available), and the unit is then active with Type=notify-reload
    (and NotifyAccess/KillMode/TimeoutStopSec as shipped) in effect."""
    d = deployed
    d.manager.systemctl("start", SOCKET)
    assert d.manager.show(SOCKET, "ActiveState") == {"ActiveState": "active"}
    time.sleep(0.5)
    assert d.show("ActiveState", "MainPID") == {"ActiveState": "inactive", "MainPID": "0"}
    assert not d.log.exists()

    models = d.get_json("/v1/models")["data"]
    assert [(m["id"], m["llmproxy"]["host"], m["llmproxy"]["available"]) for m in models] == [
        ("m", "gpu1", True)], models
    props = d.show("ActiveState", "SubState", "MainPID", "Type", "StatusText")
    assert props["ActiveState"] == "active" and props["SubState"] == "running", props
    assert props["Type"] == "notify-reload", props
    assert props["StatusText"].startswith("ready: "), props
    pid = int(props["MainPID"])
    assert d.get_json("/status")["pid"] == pid
    assert d.manager.name in pathlib.Path(f"/proc/{pid}/cgroup").read_text()
    assert f"127.0.0.1:{d.port} (inherited fd 3 (http))" in d.log_text(), d.context()
    # LimitNOFILE= sets both limits (a user manager clamps them to its own hard limit).
    assert re.search(r"open files: soft limit \d+ \(the hard limit\)", d.log_text()), d.context()
    d.assert_shipped_settings()
    d.assert_no_traceback()


def test_reload_applies_or_says_what_it_kept(deployed: Deployment) -> None:
    """Proves `systemctl --user reload` through Type=notify-reload tells the truth: after an
    alias is added to the config it returns 0, StatusText starts with `reload: applied` and the
    alias is served in /v1/models; after a refused change (drain_seconds and hosts[0].url) it
    still returns 0 (systemctl cannot know) but StatusText says `reload: kept the running
    config:` naming both fields, and the running config (alias included) stays; MainPID never
    changes."""
    d = deployed
    pid = d.activate()
    assert d.model_ids() == ["m"]

    d.write_config({**d.config, "aliases": {"coder": "m"}})
    r = d.manager.systemctl("reload", SERVICE, check=False, timeout=20)
    assert r.returncode == 0, (r.stdout, r.stderr, d.context())
    props = d.show("StatusText", "MainPID", "ActiveState")
    assert props["StatusText"].startswith("reload: applied"), props
    assert "aliases (+coder)" in props["StatusText"], props
    assert props["MainPID"] == str(pid) and props["ActiveState"] == "active", props
    assert d.model_ids() == ["coder", "m"]

    good = d.config
    d.write_config({**good, "drain_seconds": 5,
                    "hosts": [{"name": "gpu1", "url": "http://127.0.0.1:9/"}]})
    r = d.manager.systemctl("reload", SERVICE, check=False, timeout=20)
    assert r.returncode == 0, (r.stdout, r.stderr, d.context())
    props = d.show("StatusText", "MainPID", "ActiveState")
    status = props["StatusText"]
    assert status.startswith("reload: kept the running config:"), props
    assert "drain_seconds changed: restart to apply" in status, props
    assert "hosts[0].url changed: restart to apply" in status, props
    assert props["MainPID"] == str(pid) and props["ActiveState"] == "active", props
    assert d.model_ids() == ["coder", "m"]
    answer = d.get_json("/status")
    assert answer["pid"] == pid and answer["config"]["last_reload"]["outcome"] == "kept"
    log = d.log_text()
    assert "reload: applied aliases (+coder)" in log and "reload: kept the running config" in log
    d.assert_no_traceback()


def test_stop_during_a_stream_drains_it(deployed: Deployment) -> None:
    """Proves `systemctl --user stop` drains with the shipped KillMode/TimeoutStopSec: a
    stream running when the stop begins (15 tokens, 0.2 s apart) completes with every token and
    [DONE], systemctl returns once it has, and the unit ends inactive (not failed), its
    process gone."""
    d = deployed
    pid = d.activate()
    stream = Stream(d.port, tokens=15, delay=0.2)
    stream.wait_tokens(2)
    t0 = time.monotonic()
    d.manager.systemctl("stop", SERVICE, timeout=60)
    stop_s = time.monotonic() - t0
    stream.assert_complete(d)
    props = d.show("ActiveState", "SubState", "Result", "MainPID", "ExecMainStatus")
    assert props["ActiveState"] == "inactive", (props, d.context())
    assert props["Result"] == "success" and props["ExecMainStatus"] == "0", props
    assert props["MainPID"] == "0", props
    assert wait_gone(pid, 5)
    assert 1.0 < stop_s < 10, stop_s          # it waited for the stream, not for SIGKILL
    log = d.log_text()
    assert "received SIGTERM: stopping gracefully" in log, d.context()
    assert "drained, exiting" in log and "outcome=cut" not in log, d.context()
    assert re.search(rf"{stream.request_id} POST /v1/chat/completions .*outcome=completed", log)
    d.assert_no_traceback()


# --- issue 4 -------------------------------------------------------------------------------------


def test_sigusr1_upgrade_moves_mainpid_and_keeps_the_stream(deployed: Deployment) -> None:
    """Proves the upgrade under systemd: SIGUSR1 to the main process (`systemctl kill
    --kill-whom=main -s SIGUSR1`) moves the unit's MainPID to a new process while the unit stays
    active the whole time (sampled every 50 ms), a stream running across the upgrade completes
    on the old process, /status on the port then reports the new pid and generation 2, and the
    old process exits once drained while the unit stays active."""
    d = deployed
    old = d.activate()
    stream = Stream(d.port, tokens=15, delay=0.2)
    stream.wait_tokens(2)
    assert stream.request_id in in_flight_ids(d)
    poller = StatePoller(d)
    new = upgrade(d, old)
    status = d.get_json("/status")
    assert status["pid"] == new and status["generation"] == 2, status
    assert status["predecessor"]["pid"] == old, status
    assert stream.request_id not in in_flight_ids(d)   # the old process serves it
    stream.assert_complete(d)
    assert wait_gone(old), f"old main pid {old} did not exit\n{d.context()}"
    time.sleep(0.3)
    samples = poller.finish()
    assert {state for state, _pid in samples} == {"active"}, samples
    assert {int(p) for _s, p in samples} <= {old, new}, samples
    props = d.show("ActiveState", "SubState", "MainPID", "StatusText")
    assert props["ActiveState"] == "active" and props["SubState"] == "running", props
    assert props["MainPID"] == str(new), props
    assert props["StatusText"] == f"upgraded: pid {new} serves generation 2", props
    assert d.get_json("/status")["predecessor"]["draining"] is False
    assert d.model_ids() == ["m"]
    log = d.log_text()
    assert f"upgrade: handed over to pid {new} (generation 2)" in log, d.context()
    assert "outcome=cut" not in log
    d.assert_no_traceback()


def test_stop_right_after_an_upgrade_drains_both_generations(deployed: Deployment) -> None:
    """Proves a `systemctl --user stop` right after an upgrade cuts nothing: one stream on the
    old (draining) process and one on the new main process both complete with every token and
    [DONE]; the new main process waits for its predecessor before it exits, so KillMode=mixed's
    final SIGKILL finds no process to kill; the unit ends inactive (not failed) and no process
    is left in the unit's cgroup."""
    d = deployed
    old = d.activate()
    cgroup = d.show("ControlGroup")["ControlGroup"]
    assert cgroup.endswith(f"/{SERVICE}"), cgroup
    before = Stream(d.port, tokens=30, delay=0.2)  # 6 s: outlives a slow upgrade
    before.wait_tokens(2)
    assert before.request_id in in_flight_ids(d)
    new = upgrade(d, old)
    after = Stream(d.port, tokens=8, delay=0.2)
    after.wait_tokens(1)
    inflight = in_flight_ids(d)
    assert after.request_id in inflight and before.request_id not in inflight, inflight
    assert not gone(old), "the predecessor was already gone: nothing proven"

    t0 = time.monotonic()
    d.manager.systemctl("stop", SERVICE, timeout=60)
    stop_s = time.monotonic() - t0
    before.assert_complete(d)
    after.assert_complete(d)
    props = d.show("ActiveState", "Result", "MainPID", "ExecMainPID", "ExecMainStatus")
    assert props["ActiveState"] == "inactive", (props, d.context())
    assert props["Result"] == "success" and props["ExecMainStatus"] == "0", props
    assert props["ExecMainPID"] == str(new), props
    assert gone(old) and gone(new)
    assert d.manager.pids() == {d.manager.pid}, (d.manager.pids(), d.context())
    assert stop_s < 10, stop_s
    log = d.log_text()
    assert "waiting up to" in log and f"for predecessor pid {old} to finish draining" in log, (
        d.context())
    assert "outcome=cut" not in log and "drain time over" not in log, d.context()
    for s in (before, after):
        assert re.search(rf"{s.request_id} POST /v1/chat/completions .*outcome=completed", log)
    manager_log = d.manager.log_path.read_text(errors="replace")
    assert not re.search(r"llmproxy\.service: Killing process \d+ .*SIGKILL", manager_log), (
        manager_log[-3000:])
    d.assert_no_traceback()


def test_stop_after_a_finished_upgrade_drains(deployed: Deployment) -> None:
    """Proves a `systemctl --user stop` of a service that was upgraded earlier (the predecessor
    long gone, the new process now the unit's only one) still drains like a never-upgraded one:
    a stream running when the stop begins completes with every token and [DONE], systemctl
    waits for it, and the unit ends inactive (not failed) with nothing SIGKILLed."""
    d = deployed
    old = d.activate()
    new = upgrade(d, old)
    assert wait_gone(old), f"old main pid {old} did not exit\n{d.context()}"
    stream = Stream(d.port, tokens=10, delay=0.2)
    stream.wait_tokens(2)
    assert stream.request_id in in_flight_ids(d)
    t0 = time.monotonic()
    d.manager.systemctl("stop", SERVICE, timeout=60)
    stop_s = time.monotonic() - t0
    stream.assert_complete(d)
    props = d.show("ActiveState", "Result", "ExecMainPID", "ExecMainStatus")
    assert props["ActiveState"] == "inactive", (props, d.context())
    assert props["Result"] == "success" and props["ExecMainStatus"] == "0", props
    assert props["ExecMainPID"] == str(new), props
    assert 1.0 < stop_s < 10, stop_s
    log = d.log_text()
    assert "outcome=cut" not in log and "drain time over" not in log, d.context()
    assert re.search(rf"{stream.request_id} POST /v1/chat/completions .*outcome=completed", log)
    manager_log = d.manager.log_path.read_text(errors="replace")
    assert not re.search(r"llmproxy\.service: Killing process \d+ .*SIGKILL", manager_log), (
        manager_log[-3000:])
    d.assert_no_traceback()


def wait_settled(d: Deployment, seconds: float = 4.0) -> dict[str, str]:
    """The unit's state after it failed, once more than RestartSec (2 s) has passed:
    long enough for a restart to have happened if one were coming."""
    try:
        d.manager.wait_for(SERVICE, "ActiveState", "failed")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{d.context()}") from None
    time.sleep(seconds)
    return d.show("ActiveState", "Result", "NRestarts", "ExecMainStatus", "ExecMainPID")


def test_a_bad_config_fails_the_unit_once_with_78(deployed: Deployment) -> None:
    """A bad config with the shipped unit: ExecStartPre's `llmproxy check` names every
    error first; twistd refuses the file before it serves anything and exits 78; the
    unit is failed and not restarted (RestartPreventExitStatus=78), not looping."""
    d = deployed
    d.write_config({**d.config, "models": {"m": {"host": "gpu9"}}})
    d.manager.systemctl("start", SOCKET)
    started = d.manager.systemctl("start", SERVICE, check=False)
    assert started.returncode != 0
    props = wait_settled(d)
    assert props["ExecMainStatus"] == "78" and props["NRestarts"] == "0", props
    assert props["Result"] == "exit-code", props
    log = d.log_text()
    check = log.index(f"llmproxy check: {d.config_path}: 1 error")
    refusal = log.index(f"llmproxy: invalid config {d.config_path}")
    assert check < refusal and "models.m.host: no host named 'gpu9'" in log, d.context()
    assert "ready: listening" not in log, d.context()


def test_a_host_lock_held_elsewhere_exits_78_and_is_not_restarted(
        deployed: Deployment, tmp_path: pathlib.Path) -> None:
    """Another llmproxy manages the host (the test holds its lock): the service exits
    78 naming the target and the lock, and systemd does not restart it."""
    from llmproxy.hosts.locks import HostLocks

    d = deployed
    locks_dir = tmp_path / "locks"
    locks_dir.mkdir()
    target = "llm@127.0.0.1"
    d.write_config({**d.config, "runtime_dir": str(locks_dir),
                    "hosts": [*d.config["hosts"],
                              {"name": "gpu2", "url": "http://127.0.0.1:9", "ssh": target,
                               "engines": {"e": {"command": ["true"]}}}]})
    held = HostLocks(str(locks_dir))
    held.acquire([target])
    try:
        d.manager.systemctl("start", SOCKET)
        d.manager.systemctl("start", SERVICE, check=False)
        props = wait_settled(d)
        assert props["ExecMainStatus"] == "78" and props["NRestarts"] == "0", props
        assert f"another llmproxy manages {target}" in d.log_text(), d.context()
    finally:
        held.release()
