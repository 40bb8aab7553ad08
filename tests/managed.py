"""A managed host's configuration, in pieces, for the integration tests that run the real
agent over a real sshd (conftest.py's `sshd`): the agent's command, run through ssh from the
checked-out code; a simulated engine as an engine's command; a host; the configuration around
the hosts of one test (its locks and the agent's state under the test's folder)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests.procs import ROOT


def agent_argv(state: Path) -> list[str]:
    """The real agent with its state in `state`, from the checked-out code."""
    return ["env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "llmproxy.agent",
            "--state-dir", str(state)]


def sim_command(port: int, models: str = "m", *extra: str, host: str = "127.0.0.1") -> list[str]:
    """llmproxy-simengine on `port` serving `models` (comma-separated), as an engine command."""
    return [sys.executable, "-c", "from llmproxy.testing.simengine import main; main()",
            "--host", host, "--port", str(port), "--models", models, *extra]


def managed_host(sshd: Any, tmp_path: Path, port: int, engines: dict[str, Any], *,
                 name: str = "gpu1", **extra: Any) -> dict[str, Any]:
    """Host `name` at 127.0.0.1:`port` through `sshd`, its agent's state in tmp_path/agent."""
    return {"name": name, "url": f"http://127.0.0.1:{port}", "ssh": sshd.target,
            "agent": agent_argv(tmp_path / "agent"), "engines": engines, **extra}


def managed_config(sshd: Any, tmp_path: Path, hosts: list[dict[str, Any]],
                   models: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The proxy's configuration for `hosts`, its locks in tmp_path/locks."""
    return {"ssh_command": sshd.ssh_command, "runtime_dir": str(tmp_path / "locks"),
            "hosts": hosts, "models": models, **extra}
