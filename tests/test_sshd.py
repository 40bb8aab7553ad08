"""The sshd test harness is real: OpenSSH on 127.0.0.1 runs commands as root with their stdin
and stdout, runs the real llmproxy-agent, and stop() leaves none of its processes behind.

Skipped when no sshd can run here (openssh-server not installed: run bin/install-test-deps as
root), unless LLMPROXY_REQUIRE_SSHD is set (CI sets it to 1): then every test fails instead.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

import tests.sshd
from tests import needs
from tests.sshd import SSHD, available

REASON = available()
needs.module("sshd", REASON)

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
GRACE = 0.3  # SIGTERM -> SIGKILL in the stop test


def _present(pid: int, start: str) -> bool:
    """Whether the process still exists at all (a zombie counts)."""
    try:
        data = pathlib.Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return False
    return data[data.rindex(")") + 2:].split()[19] == start


def _start_time(pid: int) -> str:
    data = pathlib.Path(f"/proc/{pid}/stat").read_text(errors="replace")
    return data[data.rindex(")") + 2:].split()[19]


def _cmdlines(pids: list[int]) -> list[str]:
    lines = []
    for pid in pids:
        try:
            lines.append(pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode()
                         .replace("\0", " ").strip())
        except OSError:
            continue
    return lines


def _cmdlines_with(text: str) -> list[int]:
    """Pids of live processes whose command line mentions text."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = pathlib.Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def test_started_on_loopback_and_true_works(sshd: SSHD) -> None:
    assert sshd.target == "root@127.0.0.1"
    assert 0 < sshd.port < 65536
    assert sshd.pid is not None and sshd.processes()[0] == sshd.pid
    done = subprocess.run([*sshd.ssh_command, sshd.target, "true"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    # As llmproxy runs it: in a session of its own, no terminal.
    done = subprocess.run(["setsid", "--wait", *sshd.ssh_command, sshd.target, "id", "-u"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
                          check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, "0\n", "")
    # The exit status comes back; a failed remote command is not a failed connection.
    assert sshd.run("exit 3").returncode == 127  # one quoted word: no such command
    assert sshd.run("sh", "-c", "exit 3").returncode == 3


def test_stdin_in_stdout_out_words_unchanged(sshd: SSHD) -> None:
    text = "line one\n{\"op\": \"status\"}\n"
    done = sshd.run("cat", input=text)
    assert (done.returncode, done.stdout, done.stderr) == (0, text, "")
    done = sshd.run("printf", "%s|", "a  b", "$HOME", "it's")
    assert done.stdout == "a  b|$HOME|it's|"


def test_real_agent_over_ssh(sshd: SSHD, tmp_path: pathlib.Path) -> None:
    argv = [*sshd.ssh_command, sshd.target, "env", f"PYTHONPATH={ROOT}", sys.executable, "-m",
            "llmproxy.agent", "--state-dir", str(tmp_path / "agent"), "status"]
    done = subprocess.run(argv, input=json.dumps({"protocol": 4, "op": "status"}),
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["ok"] is True, answer
    assert answer["protocol"] == 4 and answer["engines"] == []
    assert (tmp_path / "agent" / "agent.lock").exists()  # it ran here, as root, over ssh


def test_stop_leaves_no_process(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    needs.need("sshd", REASON)
    monkeypatch.setattr(tests.sshd, "STOP_GRACE", GRACE)
    server = SSHD(tmp_path)
    server.start()
    # Sessions still running when the daemon stops: their handlers and commands go too, even a
    # command that ignores SIGTERM (SIGKILL after the grace).
    remote = [["sleep", "300"], ["trap '' TERM; sleep 301; :"]]
    clients = [subprocess.Popen([*server.ssh_command, server.target, *words],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for words in remote]
    try:
        # (root's ~/.bashrc may run commands of its own, sleeps included)
        wanted = {"sleep 300", "sleep 301"}
        deadline = time.monotonic() + 10
        while (not wanted <= set(_cmdlines(server.processes()))
               and time.monotonic() < deadline):
            time.sleep(0.02)
        tree = server.processes()
        # the listener, each connection's sshd, bash for the second, the two sleeps
        assert wanted <= set(_cmdlines(tree)), _cmdlines(tree)
        idents = [(pid, _start_time(pid)) for pid in tree]
        started = time.monotonic()
        server.stop()
        took = time.monotonic() - started
        assert server.pid is None and server.processes() == []
        # Gone, not even zombies: stop() reaps the orphans itself.
        assert [i for i in idents if _present(*i)] == []
        assert _cmdlines_with(str(server.config)) == []
        assert GRACE <= took < GRACE + 1.5, took
        assert [c.wait(timeout=10) for c in clients] == [255, 255]  # closed under them
        server.stop()  # idempotent
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
                c.wait()
        server.stop()
