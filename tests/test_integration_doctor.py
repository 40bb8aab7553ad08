"""`llmproxy doctor` against a real host reached over a real sshd: each fault made on purpose is
found (a FAIL row with its fix, exit 1), and a good host passes (exit 0)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmproxy.hosts.agentclient import PROTOCOL
from tests import sshd as sshd_harness
from tests.procs import ROOT, free_port

pytestmark = pytest.mark.integration

if sshd_harness.available() and not sshd_harness.required():
    pytest.skip(f"no sshd: {sshd_harness.available()}", allow_module_level=True)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sshd_harness.SSHD]:
    sshd_harness.require()
    with sshd_harness.SSHD(tmp_path_factory.mktemp("sshd")) as server:
        yield server


def host_config(sshd: sshd_harness.SSHD, tmp_path: Path, port: int,
                engine: dict[str, Any], **host: Any) -> dict[str, Any]:
    return {
        "ssh_command": sshd.ssh_command, "runtime_dir": str(tmp_path / "locks"),
        "hosts": [{"name": "gpu1", "url": f"http://127.0.0.1:{port}", "ssh": sshd.target,
                   "agent": ["env", f"PYTHONPATH={ROOT}", sys.executable, "-m",
                             "llmproxy.agent", "--state-dir", str(tmp_path / "agent")],
                   "engines": {"e": engine}, **host}],
        "models": {"m": {"host": "gpu1", "engine": "e"}},
    }


def sim(port: int, model: Path) -> list[str]:
    """A simulated engine on `port`, its command naming `model` (as sh's $0, unused)."""
    return ["sh", "-c", 'exec "$@"', str(model), sys.executable, "-c",
            "from llmproxy.testing.simengine import main; main()",
            "--host", "127.0.0.1", "--port", str(port), "--models", "m"]


def doctor(tmp_path: Path, config: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "llmproxy.cli", "doctor", "-c", str(path),
                           *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          check=False)


def rows(out: str) -> dict[str, tuple[str, str]]:
    """check -> (status, detail) of each table row (the last one of a repeated check)."""
    found = {}
    for line in out.splitlines():
        parts = line.split(None, 1)
        if parts and parts[0] == "gpu1":
            check, status, detail = [p.strip() for p in parts[1].split("  ") if p.strip()][:3]
            found[check] = (status, detail)
    return found


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(20_000))
    return path


def test_a_good_host_passes_and_an_unknown_host_is_a_usage_error(
        sshd: sshd_harness.SSHD, tmp_path: Path, model: Path) -> None:
    port = free_port()
    done = doctor(tmp_path, host_config(sshd, tmp_path, port, {"command": sim(port, model)}))
    assert done.returncode == 0, done.stdout + done.stderr
    found = rows(done.stdout)
    assert found["ssh"][0] == "ok"
    assert found["python3"][0] == "ok"
    assert re.fullmatch(r"3\.\d+\.\d+", found["python3"][1])
    assert found["agent"] == ("ok", f"protocol {PROTOCOL}, running: none")
    assert found["e: executable"] == ("ok", shutil.which("sh"))
    assert found["e: model"] == ("ok", f"{model} (0.00 GB)")
    assert found["e: port"] == ("ok", f"{port} free (the engine starts on demand)")
    assert found["lease"] == ("ok", "free")
    assert done.stdout.rstrip().endswith("llmproxy doctor: ok")

    other = doctor(tmp_path, host_config(sshd, tmp_path, port, {"command": sim(port, model)}),
                   "gpu9")
    assert other.returncode == 2
    assert "'gpu9' is not a managed host" in other.stderr


def test_each_fault_is_a_failed_row_with_its_fix(sshd: sshd_harness.SSHD, tmp_path: Path,
                                                 model: Path) -> None:
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        config = host_config(sshd, tmp_path, port, {
            "command": ["no-such-llama-server", "--port", str(port), "-m",
                        str(tmp_path / "missing.gguf"), "--mmproj", str(model)],
            "memory_gb": 0.00001, "url": f"http://127.0.0.1:{port}"}, memory_gb=1)
        done = doctor(tmp_path, config)
    finally:
        holder.close()
    assert done.returncode == 1, done.stdout + done.stderr
    found = rows(done.stdout)
    assert found["e: executable"] == (
        "FAIL", "'no-such-llama-server' not found on the host's non-interactive PATH")
    assert "fix: install it, or give its absolute path as engines.e.command[0]" in done.stdout
    assert f"{tmp_path / 'missing.gguf'} not found on the host" in done.stdout
    assert found["e: model"] == ("FAIL", f"{model} is 0.0 GB, more than the engine's "
                                         "memory_gb 1e-05")
    assert found["e: port"] == ("FAIL", f"{port} is held by a process that is not e "
                                        "(listening on 127.0.0.1)")
    assert "llmproxy doctor: 4 check(s) failed" in done.stdout


def test_an_unreachable_ssh_target_fails_first(sshd: sshd_harness.SSHD, tmp_path: Path,
                                               model: Path) -> None:
    port = free_port()
    config = host_config(sshd, tmp_path, port, {"command": sim(port, model)})
    config["hosts"][0]["ssh"] = "root@127.0.0.2"     # the test sshd listens on 127.0.0.1
    done = doctor(tmp_path, config)
    assert done.returncode == 1
    found = rows(done.stdout)
    assert found["ssh"][0] == "FAIL"
    assert "Connection refused" in found["ssh"][1]
    assert "the key in the host's authorized_keys" in done.stdout
    assert list(found) == ["ssh"]


def test_an_engine_the_agent_runs_holds_its_port(sshd: sshd_harness.SSHD, tmp_path: Path,
                                                 model: Path) -> None:
    port = free_port()
    config = host_config(sshd, tmp_path, port, {"command": sim(port, model)})
    host = config["hosts"][0]
    order = {"protocol": PROTOCOL, "op": "start", "engine": "e", "command": sim(port, model),
             "health_url": f"http://127.0.0.1:{port}/health", "timeout": 20, "grace": 2}
    argv = [*sshd.ssh_command, sshd.target, *host["agent"]]
    started = subprocess.run(argv, input=json.dumps(order) + "\n", capture_output=True,
                             text=True, timeout=60, check=False)
    assert json.loads(started.stdout)["ok"], started.stdout + started.stderr
    try:
        done = doctor(tmp_path, config)
        assert done.returncode == 0, done.stdout + done.stderr
        found = rows(done.stdout)
        assert found["agent"] == ("ok", f"protocol {PROTOCOL}, running: e")
        assert found["e: port"] == ("ok", f"{port} held by e")
        assert found["e: url"] == ("ok", f"http://127.0.0.1:{port} reachable from here")
    finally:
        stop = {"protocol": PROTOCOL, "op": "stop", "grace": 2}
        subprocess.run(argv, input=json.dumps(stop) + "\n", capture_output=True, text=True,
                       timeout=60, check=False)
