"""`llmproxy doctor` against the simulated second machine (tests/gpuhost.py), reached at its
own address over a real sshd, with nothing of llmproxy installed there: each fault made on
purpose is found (a FAIL row with its fix, exit 1), and a good host passes (exit 0)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent.protocol import HOST_FIELD, PROTOCOL
from llmproxy.config import load_config
from llmproxy.hosts.agentclient import agent_argv
from tests.gpuhost import GPUHost
from tests.procs import ROOT

pytestmark = pytest.mark.integration

PORT = 8081     # the host is a machine of its own: every port there is free


def host_config(host: GPUHost, tmp_path: Path, engine: dict[str, Any],
                **fields: Any) -> dict[str, Any]:
    return {
        "ssh_command": host.ssh_command, "runtime_dir": str(tmp_path / "locks"),
        "hosts": [{"name": "gpu1", "url": host.url(PORT), "ssh": host.target,
                   "engines": {"e": engine}, **fields}],
        "models": {"m": {"host": "gpu1", "engine": "e"}},
    }


def sim(model: Path, bind: str = "0.0.0.0") -> list[str]:
    """A simulated engine on PORT, its command naming `model` (as sh's $0, unused)."""
    return ["sh", "-c", 'exec "$@"', str(model), sys.executable, "-c",
            "from llmproxy.testing.simengine import main; main()",
            "--host", bind, "--port", str(PORT), "--models", "m"]


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


def agent(tmp_path: Path, config: dict[str, Any], order: dict[str, Any]) -> dict[str, Any]:
    """One order to the host's agent, as the proxy sends it (the doctor installed it)."""
    path = tmp_path / "agent.json"
    path.write_text(json.dumps(config))
    loaded = load_config(str(path))
    done = subprocess.run(agent_argv(loaded.ssh_command, loaded.hosts[0]),
                          input=json.dumps({**order, "protocol": PROTOCOL,
                                            HOST_FIELD: "gpu1"}) + "\n",
                          capture_output=True, text=True, timeout=60, check=False)
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["ok"], done.stdout + done.stderr
    return answer


@pytest.fixture
def started(gpu_host: GPUHost, tmp_path: Path) -> Iterator[Any]:
    """Starts engine e on the host through the agent (after a doctor run brought it there)."""
    configs: list[dict[str, Any]] = []

    def start(config: dict[str, Any]) -> None:
        configs.append(config)
        agent(tmp_path, config, {"op": "start", "engine": "e",
                                 "command": config["hosts"][0]["engines"]["e"]["command"],
                                 "health_url": f"http://127.0.0.1:{PORT}/health",
                                 "timeout": 20, "grace": 2})

    yield start
    for config in configs:
        agent(tmp_path, config, {"op": "stop", "grace": 2})


def test_a_good_host_passes_and_an_unknown_host_is_a_usage_error(
        gpu_host: GPUHost, tmp_path: Path, model: Path) -> None:
    done = doctor(tmp_path, host_config(gpu_host, tmp_path, {"command": sim(model)}))
    assert done.returncode == 0, done.stdout + done.stderr
    found = rows(done.stdout)
    assert found["ssh"] == ("ok", f"{gpu_host.target} answers")
    assert found["python3"][0] == "ok"
    assert re.fullmatch(r"3\.\d+\.\d+", found["python3"][1])
    assert found["agent"] == ("ok", f"protocol {PROTOCOL}, running: none")
    assert found["e: executable"] == ("ok", shutil.which("sh", path="/usr/bin:/bin"))
    assert found["e: model"] == ("ok", f"{model} (0.00 GB)")
    assert found["e: port"] == ("ok", f"{PORT} free (the engine starts on demand)")
    assert found["lease"] == ("ok", "free")
    assert done.stdout.rstrip().endswith("llmproxy doctor: ok")

    other = doctor(tmp_path, host_config(gpu_host, tmp_path, {"command": sim(model)}), "gpu9")
    assert other.returncode == 2
    assert "'gpu9' is not a managed host" in other.stderr


def test_each_fault_is_a_failed_row_with_its_fix(gpu_host: GPUHost, tmp_path: Path,
                                                 model: Path) -> None:
    holder = subprocess.Popen(
        ["ip", "netns", "exec", str(gpu_host.netns), sys.executable, "-c",
         "import socket, sys, time\n"
         f"s = socket.create_server(('0.0.0.0', {PORT}))\n"
         "print('listening', flush=True)\ntime.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "listening\n"
        config = host_config(gpu_host, tmp_path, {
            "command": ["no-such-llama-server", "--port", str(PORT), "-m",
                        str(tmp_path / "missing.gguf"), "--mmproj", str(model)],
            "memory_gb": 0.00001, "url": gpu_host.url(PORT)}, memory_gb=1)
        done = doctor(tmp_path, config)
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 1, done.stdout + done.stderr
    found = rows(done.stdout)
    assert found["e: executable"] == (
        "FAIL", "'no-such-llama-server' not found on the host's non-interactive PATH")
    assert "fix: install it, or give its absolute path as engines.e.command[0]" in done.stdout
    assert f"{tmp_path / 'missing.gguf'} not found on the host" in done.stdout
    assert found["e: model"] == ("FAIL", f"{model} is 0.0 GB, more than the engine's "
                                         "memory_gb 1e-05")
    assert found["e: port"] == ("FAIL", f"{PORT} is held by a process that is not e "
                                        "(listening on 0.0.0.0)")
    assert "llmproxy doctor: 4 check(s) failed" in done.stdout


def test_an_unreachable_ssh_target_fails_first(gpu_host: GPUHost, tmp_path: Path,
                                               model: Path) -> None:
    config = host_config(gpu_host, tmp_path, {"command": sim(model)})
    config["hosts"][0]["ssh"] = "root@127.0.0.2"     # nothing listens for ssh there
    done = doctor(tmp_path, config)
    assert done.returncode == 1
    found = rows(done.stdout)
    assert found["ssh"][0] == "FAIL"
    assert "Connection refused" in found["ssh"][1]
    assert "the key in the host's authorized_keys" in done.stdout
    assert list(found) == ["ssh"]


def test_an_engine_the_agent_runs_holds_its_port_and_is_reached(
        gpu_host: GPUHost, tmp_path: Path, model: Path, started: Any) -> None:
    config = host_config(gpu_host, tmp_path, {"command": sim(model)})
    assert doctor(tmp_path, config).returncode == 0
    started(config)
    done = doctor(tmp_path, config)
    assert done.returncode == 0, done.stdout + done.stderr
    found = rows(done.stdout)
    assert found["agent"] == ("ok", f"protocol {PROTOCOL}, running: e")
    assert found["e: port"] == ("ok", f"{PORT} held by e")
    assert found["e: url"] == ("ok", f"{gpu_host.url(PORT)} reachable from here")


def test_an_engine_on_the_hosts_loopback_only_is_found_with_its_fix(
        gpu_host: GPUHost, tmp_path: Path, model: Path, started: Any) -> None:
    config = host_config(gpu_host, tmp_path, {"command": sim(model, bind="127.0.0.1")})
    assert doctor(tmp_path, config).returncode == 0
    started(config)
    done = doctor(tmp_path, config)
    assert done.returncode == 1, done.stdout + done.stderr
    found = rows(done.stdout)
    assert found["e: port"] == ("ok", f"{PORT} held by e")
    assert found["e: url"][0] == "FAIL"
    assert found["e: url"][1].endswith("the engine listens on 127.0.0.1 only")
    assert ("fix: listening on 127.0.0.1 only? add --host 0.0.0.0 to engines.e.command"
            in done.stdout)


def older_python() -> str | None:
    """A CPython older than 3.9 from pyenv, if this machine has one."""
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.[5-8].*/bin/python3")))
    return found[-1] if found else None


def test_a_python3_older_than_3_9_is_refused(gpu_host: GPUHost, tmp_path: Path,
                                            model: Path) -> None:
    old = older_python()
    if old is None:
        pytest.skip("no CPython older than 3.9 here (tests/test_doctor.py covers the check)")
    link = gpu_host.bindir / "python3"
    link.unlink()
    link.symlink_to(old)
    done = doctor(tmp_path, host_config(gpu_host, tmp_path, {"command": sim(model)}))
    assert done.returncode == 1
    found = rows(done.stdout)
    assert found["python3"][0] == "FAIL"
    assert re.fullmatch(r"python3 is 3\.[5-8]\.\d+", found["python3"][1])
    assert list(found) == ["ssh", "python3"]
