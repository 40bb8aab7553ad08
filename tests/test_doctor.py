"""`llmproxy doctor`'s checks on facts given by fakes (the ssh call, the connection from
here, the agent): the faults a real host cannot be made to show here (no python3, an old one,
an engine on loopback only, a firewall, an agent of another protocol, nvidia-smi's answers).
The real host is tests/test_integration_doctor.py's."""

from __future__ import annotations

import json
import socket
import subprocess
from typing import Any

from llmproxy.agent import gpus
from llmproxy.cli import doctor, doctorprobe
from llmproxy.config import Config, HostConfig
from llmproxy.config.values import EngineConfig, ListenAddress

ENGINE = EngineConfig(name="big", command=("llama-server", "--port", "8081", "-m", "/m/q.gguf"))
HOST = HostConfig(name="gpu1", url="http://10.0.0.5:8081", ssh="llm@10.0.0.5",
                  engines={"big": ENGINE})


def config() -> Config:
    return Config(listen=ListenAddress("127.0.0.1", 8080), hosts=(HOST,))


def facts(**changes: Any) -> dict[str, Any]:
    found = {"python": "3.11.2",
             "engines": {"big": {"executable": "/usr/bin/llama-server",
                                 "models": [{"path": "/m/q.gguf", "bytes": 2_000_000_000}]}},
             "listening": [], "nvidia_smi": None, "gpus": None, "gpu_error": None}
    return found | changes


def ssh(returncode: int = 0, stdout: str = "", stderr: str = "") -> Any:
    calls = []

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append((argv, kwargs))
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)

    run.calls = calls  # type: ignore[attr-defined]
    return run


def agent(running: tuple[str, ...] = (), error: str | None = None) -> Any:
    def call(config: Config, host: HostConfig) -> tuple[dict[str, Any] | None, str | None]:
        if error:
            return None, error
        return {"ok": True, "protocol": 3, "engines": [{"engine": e} for e in running],
                "lease": None}, None
    return call


def refused(address: tuple[str, int], timeout: float) -> socket.socket:
    raise ConnectionRefusedError(111, "Connection refused")


def connected(address: tuple[str, int], timeout: float) -> socket.socket:
    return socket.socket()


def check(found: dict[str, Any] | None = None, *, running: tuple[str, ...] = (),
          connect: Any = connected, agent_error: str | None = None,
          run: Any = None) -> dict[str, doctor.Row]:
    run = run or ssh(stdout=json.dumps(found or facts()) + "\n")
    return {r.check: r for r in doctor.check_host(config(), HOST, run=run, connect=connect,
                                                  agent=agent(running, agent_error))}


def test_the_probe_runs_on_the_hosts_python3_through_ssh_command() -> None:
    run = ssh(stdout=json.dumps(facts()))
    doctor.check_host(config(), HOST, run=run, connect=connected, agent=agent())
    argv, kwargs = run.calls[0]
    assert argv == [*config().ssh_command, "llm@10.0.0.5", "python3", "-"]
    assert kwargs["input"].startswith('"""What ``llmproxy doctor``')
    assert kwargs["input"].endswith("report(json.loads(" + json.dumps(json.dumps(
        {"engines": {"big": list(ENGINE.command)}})) + "))\n")
    assert kwargs["timeout"] == doctor.TIMEOUT


def test_the_probe_asks_nvidia_smi_what_the_agent_reads() -> None:
    assert doctorprobe.GPU_QUERY == gpus.QUERY


def test_no_python3_and_an_old_one_end_the_checks_with_a_fix() -> None:
    missing = check(run=ssh(127, stderr="bash: line 1: python3: command not found"))
    assert list(missing) == ["ssh", "python3"]
    assert missing["python3"].detail == "python3 not found on the host's non-interactive PATH"
    old = check(facts(python="3.8.10"))
    assert old["python3"].status == "FAIL"
    assert old["python3"].fix == "install python3 3.9 or later"
    assert list(old) == ["ssh", "python3"]


def test_an_engine_listening_on_loopback_only_is_named_with_the_flag_that_fixes_it() -> None:
    rows = check(facts(listening=[{"address": "127.0.0.1", "port": 8081}]), running=("big",),
                 connect=refused)
    assert rows["big: port"].status == "ok"
    assert rows["big: url"].status == "FAIL"
    assert "listens on 127.0.0.1 only" in rows["big: url"].detail
    assert rows["big: url"].fix == ("listening on 127.0.0.1 only? add --host 0.0.0.0 to "
                                    "engines.big.command")


def test_an_engine_on_every_address_but_unreachable_points_at_a_firewall() -> None:
    rows = check(facts(listening=[{"address": "0.0.0.0", "port": 8081}]), running=("big",),
                 connect=refused)
    assert rows["big: url"].status == "FAIL"
    assert "firewall" in rows["big: url"].fix


def test_an_agent_of_another_protocol_fails_its_row() -> None:
    rows = check(agent_error="the agent on gpu1 speaks protocol 2, this proxy speaks 3")
    assert rows["agent"].status == "FAIL"
    assert "protocol 2" in rows["agent"].detail
    assert "lease" not in rows


def test_nvidia_smi_figures_and_failures() -> None:
    line = "0, NVIDIA RTX 4090, 1024, 24564, 3, 40, 30.5\n"
    rows = check(facts(nvidia_smi="/usr/bin/nvidia-smi", gpus=line))
    assert rows["gpus"].status == "ok"
    assert rows["gpus"].detail == "GPU 0 NVIDIA RTX 4090: 1.0 of 24.0 GiB used"
    bad = check(facts(nvidia_smi="/usr/bin/nvidia-smi", gpus="garbage\n"))
    assert bad["gpus"].status == "FAIL"
    failing = check(facts(nvidia_smi="/usr/bin/nvidia-smi",
                          gpu_error="nvidia-smi exited 9: NVIDIA-SMI has failed"))
    assert failing["gpus"].status == "FAIL"
    assert check()["gpus"].status == "warn"


def test_the_table_puts_a_fix_under_each_failure() -> None:
    text = doctor.table([doctor.Row("gpu1", "ssh", "ok", "answers"),
                         doctor.Row("gpu1", "big: url", "FAIL", "unreachable", "add --host")])
    assert text.splitlines() == ["gpu1  ssh       ok    answers",
                                 "gpu1  big: url  FAIL  unreachable",
                                 "                      fix: add --host"]


def test_listening_addresses_read_from_proc_net() -> None:
    assert doctorprobe._address("0100007F") == "127.0.0.1"
    assert doctorprobe._address("00000000") == "0.0.0.0"
    assert doctorprobe._address("00000000000000000000000001000000") == "::1"
    assert doctorprobe._address("00000000000000000000000000000000") == "::"
    assert doctorprobe._address("0000000000000000FFFF00000100007F") == "::ffff:127.0.0.1"


def test_model_files_come_from_model_flags_and_gguf_words() -> None:
    found = doctorprobe._models(["llama-server", "-m", "/nope/a.gguf", "--mmproj", "/nope/b.gguf",
                                 "--model=/nope/c.bin"])
    assert [m["path"] for m in found] == ["/nope/a.gguf", "/nope/b.gguf", "/nope/c.bin"]
    assert all(m["bytes"] is None for m in found)
    assert doctorprobe._models(["python3", "-m", "some.module"]) == []
