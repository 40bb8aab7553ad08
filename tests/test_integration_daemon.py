"""A daemonized twistd (no -n) upgraded on SIGUSR1, for real: the successor keeps the log
file (twistd's default twistd.log, or a --logfile given relative to where twistd started)
and the pid file, the upgrade line names the daemon's pid (not the pid twistd had before
it forked), and both generations' lines are in the log whole, none written over."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.procs import SimEngine, env, gone, kill_if_alive, twistd, wait_until

pytestmark = pytest.mark.integration

STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} \[")


def pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def chat(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "m", "max_tokens": 2}),
                 {"X-Sim-Delay": "0"})
    resp = conn.getresponse()
    resp.read()
    return resp.status


@pytest.mark.parametrize("logfile", [None, "proxy.log"])
def test_a_daemons_successor_keeps_its_log_and_pid_file(engine: SimEngine, tmp_path: Path,
                                                        logfile: str | None) -> None:
    """twistd daemonizes (its pid file names the daemon); SIGUSR1 to it: the upgrade line
    names that pid, the pid file then names the successor, the successor's own lines (its
    ready line, a request's access line) land in the same log file, the predecessor's
    drain lines too, every line whole; a SIGTERM to the successor ends it and removes the
    pid file."""
    (tmp_path / "hosts.json").write_text(json.dumps({
        "listen": "127.0.0.1:0", "hosts": [{"name": "gpu1", "url": engine.url}],
        "models": {"m": {"host": "gpu1"}}}))
    pidfile = tmp_path / "run" / "llmproxy.pid"
    pidfile.parent.mkdir()
    log = tmp_path / (logfile or "twistd.log")
    argv = [twistd(), "--pidfile=run/llmproxy.pid",
            *([f"--logfile={logfile}"] if logfile else []), "llmproxy", "-c", "hosts.json"]
    pids: list[int] = []
    try:
        started = subprocess.run(argv, cwd=tmp_path, env=env(), capture_output=True,
                                 text=True, timeout=30, check=False)
        assert started.returncode == 0, started.stdout + started.stderr
        ready = wait_until(lambda: re.search(r"ready: listening on http://127\.0\.0\.1:(\d+)",
                                             text(log)), timeout=15)
        assert ready, text(log)
        port = int(ready.group(1))
        daemon = pid_in(pidfile)
        assert daemon is not None and not gone(daemon)
        pids.append(daemon)
        assert chat(port) == 200
        os.kill(daemon, signal.SIGUSR1)
        upgraded = wait_until(lambda: re.search(
            r"upgrade: \S+ \(pid (\d+)\) -> \S+ \(pid (\d+)\) ready in", text(log)), timeout=20)
        assert upgraded, text(log)
        successor = int(upgraded.group(2))
        pids.append(successor)
        assert int(upgraded.group(1)) == daemon, upgraded.group(0)
        assert wait_until(lambda: pid_in(pidfile) == successor, timeout=10), pidfile
        assert wait_until(lambda: gone(daemon), timeout=15)
        assert pid_in(pidfile) == successor       # the predecessor's exit left it alone
        assert chat(port) == 200
        lines = text(log).splitlines()
        assert any("upgrade: generation 2 ready; predecessor pid " f"{daemon}" in line
                   for line in lines), lines
        assert any("drained, exiting" in line for line in lines), lines
        # Each generation's access line for its request (one before, one after).
        assert wait_until(lambda: text(log).count(" POST /v1/chat/completions model=m ") == 2,
                          timeout=5), text(log)
        broken = [line for line in text(log).splitlines()
                  if not STAMP.match(line) and not line.startswith("\t")]
        assert broken == [], broken
        os.kill(successor, signal.SIGTERM)
        assert wait_until(lambda: gone(successor), timeout=15)
        assert wait_until(lambda: not pidfile.exists(), timeout=5)
    finally:
        for pid in pids:
            kill_if_alive(pid)
