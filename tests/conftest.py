import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Tests always exercise the checked-out code, whatever copy is installed.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _hangup_ignored(signum: int, frame: object) -> None:
    """What the suite does with a SIGHUP when it was started ignoring them."""


# The processes the tests start get SIGHUP's default action, as under a service
# manager, even when the suite itself runs with SIGHUP ignored (under nohup): an
# ignored signal stays ignored across exec, a handled one is reset to its
# default. Without this, the test that an early SIGHUP kills plain twistd fails
# under nohup, and the one that the launcher survives it proves nothing.
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, _hangup_ignored)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Any]:
    """An llmproxy-agent on a fresh state directory (tests/agentrun.py's Agent), its
    engines cleaned up after the test: the agent tests' shared fixture."""
    from tests.agentrun import Agent

    agent = Agent(tmp_path / "state")
    try:
        yield agent
    finally:
        agent.cleanup()


@pytest.fixture
def streams() -> Iterator[list[Any]]:
    """Where a test keeps the agent watch and log calls it opens (tests/agentrun.py's
    Stream); each is killed after the test."""
    opened: list[Any] = []
    try:
        yield opened
    finally:
        for s in opened:
            s.kill()


@pytest.fixture
def gpu_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A simulated second machine (tests/gpuhost.py): a network namespace at its own address
    running sshd, with nothing of llmproxy installed; torn down after the test. Skipped where
    it cannot run, unless LLMPROXY_REQUIRE_SSHD is set: then a missing tool fails the test."""
    from tests import gpuhost, sshd

    reason = gpuhost.available()
    if reason and sshd.required():
        pytest.fail(f"LLMPROXY_REQUIRE_SSHD is set but no second machine can be simulated: "
                    f"{reason}")
    if reason:
        pytest.skip(f"no simulated second machine: {reason}")
    with gpuhost.GPUHost(tmp_path_factory.mktemp("gpuhost")) as host:
        yield host
