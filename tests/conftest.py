import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `both_modes` each test whose path LLMPROXY_SPEEDUPS changes (tests/modes.py):
    the reference run of `make pytest` runs those alone (`-m both_modes`)."""
    from tests import modes

    for item in items:
        if modes.both_modes(item.path, getattr(item, "fixturenames", [])):
            item.add_marker(pytest.mark.both_modes)
    # Longest first, for xdist's file-by-file schedule (`--dist loadfile
    # --no-loadscope-reorder`, Makefile): the integration files, the larger first, then
    # the many short in-memory ones, which fill the end evenly. A file's tests keep
    # their order and stay together (a stable sort on a key of the file alone).
    sizes: dict[Path, int] = {}

    def heavy_first(item: pytest.Item) -> tuple[bool, int]:
        if item.path not in sizes:
            sizes[item.path] = item.path.stat().st_size
        return not item.path.name.startswith("test_integration_"), -sizes[item.path]

    items.sort(key=heavy_first)


# -- what the integration tests share: one definition each (tests/test_layout.py holds that) --
@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real sshd on 127.0.0.1 (tests/sshd.py) for the module's tests. Skipped where none can
    run, unless LLMPROXY_REQUIRE_SSHD is set: then the test fails, saying why."""
    from tests import needs
    from tests import sshd as harness

    needs.need("sshd", harness.available())
    with harness.SSHD(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.fixture
def gpu_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A simulated second machine (tests/gpuhost.py): a network namespace at its own address
    running sshd, with nothing of llmproxy installed; torn down after the test. Skipped where
    it cannot run, unless LLMPROXY_REQUIRE_SSHD is set: then a missing tool fails the test."""
    from tests import gpuhost, needs

    needs.need("sshd", gpuhost.available())
    with gpuhost.GPUHost(tmp_path_factory.mktemp("gpuhost")) as host:
        yield host


@pytest.fixture
def gpu_hosts(gpu_host: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    """Three simulated machines: `gpu_host` and two more like it (each its own network
    namespace, address and sshd), for placement over several machines; torn down after
    the test."""
    from tests import gpuhost

    with gpuhost.GPUHost(tmp_path_factory.mktemp("gpuhost")) as second, \
            gpuhost.GPUHost(tmp_path_factory.mktemp("gpuhost")) as third:
        yield [gpu_host, second, third]


def _sim_engine(request: pytest.FixtureRequest) -> Any:
    from tests.procs import SimEngine

    return SimEngine(list(getattr(request.module, "ENGINE_MODELS", ("m",))))


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A simulated engine process (tests/procs.py's SimEngine) for the module's tests, serving
    the models the module names in ENGINE_MODELS (default: "m")."""
    e = _sim_engine(request)
    yield e
    e.stop()


@pytest.fixture
def fresh_engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    """`engine`, but one for each test: for tests that read what the engine was sent."""
    e = _sim_engine(request)
    yield e
    e.stop()


@pytest.fixture(params=["reference", "speedups"])
def on_both_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test twice, on the reference path and with the speedups, whatever the run's own
    LLMPROXY_SPEEDUPS (a proxy built in the test takes its selection from it); a module
    uses it with `pytestmark = pytest.mark.usefixtures("on_both_paths")`."""
    monkeypatch.setenv("LLMPROXY_SPEEDUPS", "0" if request.param == "reference" else "1")
    return str(request.param)


@pytest_twisted.async_yield_fixture(scope="module")
async def rig() -> AsyncIterator[Any]:
    """The differential tests' rig (tests/differential.py): both paths side by side."""
    from tests.differential import make_rig

    made = make_rig()
    yield made
    await made.close()
