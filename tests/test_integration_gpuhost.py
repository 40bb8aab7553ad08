"""Managed engines on a second machine, simulated (tests/gpuhost.py): twistd llmproxy reaches the
host at its own address over ssh, brings its own agent (nothing of llmproxy is installed there),
and reaches the engines at the host's url, never through 127.0.0.1. An engine that listens on
the host's loopback only fails, as it would on a real GPU box."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent.protocol import PROTOCOL
from llmproxy.agent.state import records
from llmproxy.hosts.agentbundle import bundle
from tests.gpuhost import GPUHost, engine_command
from tests.procs import BodyReader, Proxy, free_port

pytestmark = pytest.mark.integration


def config(host: GPUHost, tmp_path: Path, *, bind: str = "0.0.0.0",
           start_timeout: float = 20) -> dict[str, Any]:
    port = free_port()
    return {
        "ssh_command": host.ssh_command,
        "runtime_dir": str(tmp_path / "locks"),
        "hosts": [{
            "name": "gpu1", "url": host.url(port), "ssh": host.target,
            "engines": {
                name: {"command": engine_command(port, f"m{name}", bind),
                       "start_timeout_seconds": start_timeout} for name in ("a", "b")},
        }],
        "models": {"ma": {"host": "gpu1", "engine": "a"}, "mb": {"host": "gpu1", "engine": "b"}},
    }


def post(port: int, model: str, stream: bool = False, **headers: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": model, "stream": stream}),
                 headers)
    return conn.getresponse()


def running(host: GPUHost) -> list[str]:
    """The engines the agent's records on the host name for host gpu1 (its default state
    directory keeps each host's engines apart)."""
    return [r["engine"] for r in records(host.cache / "llmproxy-agent" / "hosts" / "gpu1")]


def test_the_host_has_no_llmproxy_and_only_its_own_address(gpu_host: GPUHost) -> None:
    """What the tests below stand on: over ssh, no llmproxy program or module is found, the
    host's python3 is its own, and its address is not this machine's."""
    found = gpu_host.run("sh", "-c", "command -v llmproxy-agent || command -v llmproxy || "
                         "python3 -c 'import llmproxy' 2>/dev/null && echo FOUND")
    assert "FOUND" not in found.stdout and "llmproxy" not in found.stdout
    assert gpu_host.run("python3", "-c", "import sys; print(sys.version_info >= (3, 9))"
                        ).stdout.strip() == "True"
    assert gpu_host.address.startswith("10.231.") and gpu_host.target.endswith(gpu_host.address)


def test_switch_waits_for_the_running_stream(gpu_host: GPUHost, tmp_path: Path) -> None:
    """A stream on engine a is in flight when a request for engine b arrives: the stream
    completes in full, then b starts (over ssh, through the agent the proxy brought) and
    answers; the agent's code is on the host under this proxy's digest."""
    proxy = Proxy(config(gpu_host, tmp_path), tmp_path)
    try:
        first = post(proxy.port, "ma")                      # installs the agent, starts a
        assert first.status == 200 and b"tok" in first.read()
        code = gpu_host.cache / "llmproxy" / "agent-code" / bundle().digest
        assert (code / "llmproxy" / "agent" / "main.py").is_file()
        stream = BodyReader(post(proxy.port, "ma", stream=True, **{"X-Sim-Delay": "0.15",
                                                              "X-Sim-Tokens": "15"}))
        time.sleep(0.5)
        other = post(proxy.port, "mb")                      # waits for the stream
        body = other.read()
        stream.join(30)
        assert stream.error is None and stream.body.count(b"tok") == 15
        assert stream.body.rstrip().endswith(b"[DONE]")
        assert other.status == 200 and json.loads(body)["model"] == "mb"
        proxy.wait_for(r"engine b on gpu1 ready", 10)     # (its line may still be on its way)
        out = proxy.output()
        assert out.index("waiting for 1 request(s) on a") < out.index("engine b on gpu1 ready")
        assert running(gpu_host) == ["b"]
    finally:
        proxy.stop()


def test_an_engine_listening_on_the_hosts_loopback_only_fails(gpu_host: GPUHost,
                                                               tmp_path: Path) -> None:
    """`--host 127.0.0.1` on the GPU host: the engine runs there but cannot be reached at
    the host's url, so its start fails with a 424 naming the host and engine."""
    proxy = Proxy(config(gpu_host, tmp_path, bind="127.0.0.1", start_timeout=4), tmp_path)
    try:
        resp = post(proxy.port, "ma")
        error = json.loads(resp.read())["error"]
        assert resp.status == 424 and error["type"] == "model_unavailable", error
        assert error["message"].startswith("model ma: switching host gpu1 to engine a failed:")
        assert "a not healthy within 4 s" in error["message"]
    finally:
        proxy.stop()


def test_doctor_brings_the_agent_to_a_host_that_has_none(gpu_host: GPUHost,
                                                        tmp_path: Path) -> None:
    """`llmproxy doctor` on a fresh second machine: the host has no agent code, the doctor
    sends the proxy's own (as the proxy would) and its agent row is ok, on the host's python3."""
    from tests.test_integration_doctor import doctor, rows

    code = gpu_host.cache / "llmproxy" / "agent-code" / bundle().digest
    assert not code.exists()
    done = doctor(tmp_path, config(gpu_host, tmp_path))
    found = rows(done.stdout)
    assert found["agent"] == ("ok", f"protocol {PROTOCOL}, running: none"), (
        done.stdout + done.stderr)
    assert found["python3"][0] == "ok"
    assert (code / "llmproxy" / "agent" / "main.py").is_file()
