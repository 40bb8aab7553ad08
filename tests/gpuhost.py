"""A second machine, simulated: a GPU host in a network namespace of its own, reached over a veth
pair at its own address, never through 127.0.0.1.

`GPUHost` makes a namespace ``llmproxy-t<N>`` with the address 10.231.N.2 (this machine's end of
the pair is 10.231.N.1), its own loopback, and a real sshd on 10.231.N.2:22 (tests/sshd.py). As
on a fresh GPU box, nothing of llmproxy is installed there: the ssh user's PATH is a folder of
the host's own (`bindir`, with ``python3``: the oldest Python 3.9+ found here, see `host_python`)
then ``/usr/sbin:/usr/bin:/sbin:/bin``, its shell reads no rc file of this machine's, and its
``~/.cache`` (where the proxy's agent code and the agent's state land) is a folder of the test's.
A process started over ssh to that address runs in the namespace: an engine that binds
127.0.0.1 there cannot be reached from the proxy, exactly as on a real GPU box.

``stop()`` stops sshd and every process of the namespace (by pid, all created by the test),
then deletes the namespace and this machine's end of the pair: only what `start` created.

Usage (the ``gpu_host`` fixture in conftest.py does this)::

    reason = available()           # None when usable
    with GPUHost(tmp_path) as host:
        host.address               # "10.231.N.2"
        host.url(8081)             # "http://10.231.N.2:8081"
        host.ssh_command, host.target   # llmproxy's ssh_command and a host's "ssh"
"""

from __future__ import annotations

import contextlib
import glob
import os
import pathlib
import random
import shutil
import signal
import subprocess
import time

from tests import sshd as sshd_harness
from tests.managed import sim_command

_NAME = "llmproxy-t{n}"


def available() -> str | None:
    """Why no second machine can be simulated here, or None when it can."""
    reason = sshd_harness.available()
    if reason:
        return reason
    if shutil.which("ip", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
        return "ip (iproute2) not found"
    return None


def host_python() -> str:
    """The GPU host's python3: $LLMPROXY_HOST_PYTHON, else the oldest CPython 3.9 or later
    found among pyenv's (the agent promises 3.9), else this machine's /usr/bin/python3."""
    given = os.environ.get("LLMPROXY_HOST_PYTHON")
    if given:
        return given
    for minor in range(9, 14):
        found = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}.*/bin/python3")))
        if found:
            return found[-1]
    return "/usr/bin/python3"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    ip = shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin") or "ip"
    return subprocess.run([ip, *args], capture_output=True, text=True, check=check, timeout=30)


class GPUHost(sshd_harness.SSHD):
    """A simulated GPU host: a network namespace at 10.231.N.2 running sshd (see the module)."""

    def __init__(self, workdir: pathlib.Path) -> None:
        super().__init__(workdir)
        self.netns: str | None = None
        self.subnet = 0
        self.bindir = self.workdir / "bin"
        self.cache = self.workdir / "cache"       # the host's ~/.cache
        self.empty = self.workdir / "empty"       # what the host's shell reads as rc files
        self._link: str | None = None

    def url(self, port: int) -> str:
        return f"http://{self.address}:{port}"

    def pick_port(self) -> int:
        return 22        # the namespace is a machine of its own: every port is free

    def exec(self, *argv: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """Run `argv` in the host's namespace (not over ssh)."""
        assert self.netns is not None
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], capture_output=True,
                              text=True, check=False, timeout=30, **kwargs)  # type: ignore[call-overload]

    def _claim(self) -> None:
        """Create a namespace of a free number: `ip netns add` refuses a name that exists, so
        runs side by side never share one."""
        for n in random.sample(range(1, 255), 254):
            if _ip("netns", "add", _NAME.format(n=n), check=False).returncode == 0:
                self.netns, self.subnet = _NAME.format(n=n), n
                return
        raise RuntimeError("no free namespace llmproxy-t1..254")

    def _network(self) -> None:
        assert self.netns is not None
        n = self.subnet
        outer, inner = f"lpx{n}o", f"lpx{n}i"
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._link = outer
        _ip("link", "set", inner, "netns", self.netns)
        _ip("addr", "add", f"10.231.{n}.1/24", "dev", outer)
        _ip("link", "set", outer, "up")
        for args in (("addr", "add", f"10.231.{n}.2/24", "dev", inner),
                     ("link", "set", inner, "up"), ("link", "set", "lo", "up")):
            _ip("-n", self.netns, *args)
        self.address = f"10.231.{n}.2"

    def _home(self) -> None:
        for d in (self.bindir, self.cache):
            d.mkdir(parents=True, exist_ok=True)
        self.empty.write_text("")
        python = self.bindir / "python3"
        if not python.exists():
            python.symlink_to(host_python())
        home = pathlib.Path.home()
        # ip netns exec gives sshd a mount namespace of its own (slave to this one's), so
        # these binds are seen by the host's processes only.
        binds = [f'mount --bind {self.cache} {home}/.cache']
        binds += [f'mount --bind {self.empty} {home}/{rc}' for rc in (".bashrc", ".profile")
                  if (home / rc).exists()]
        assert self.netns is not None
        self.prefix = ["ip", "netns", "exec", self.netns, "sh", "-ec",
                       " && ".join([*binds, 'exec "$@"']), "sh"]
        self.extra_config = [f"SetEnv PATH={self.bindir}:/usr/sbin:/usr/bin:/sbin:/bin"]

    def start(self, timeout: float = 10) -> None:
        """Create the namespace and its link, then start sshd in it (see SSHD.start)."""
        self._claim()
        try:
            self._network()
            self._home()
            super().start(timeout)
        except BaseException:
            self.stop()
            raise

    def namespace_pids(self) -> list[int]:
        if self.netns is None:
            return []
        done = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in done.stdout.split() if p.isdigit()]

    def stop(self) -> None:
        """sshd and its sessions, every process left in the namespace, the namespace, the link."""
        super().stop()
        deadline = time.monotonic() + 5
        while (pids := self.namespace_pids()) and time.monotonic() < deadline:
            for pid in pids:  # engines the agent started: they left sshd's tree on purpose
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if self.netns is not None:
            _ip("netns", "del", self.netns, check=False)
            self.netns = None
        if self._link is not None:
            _ip("link", "del", self._link, check=False)
            self._link = None


def engine_command(port: int, model: str, host: str = "0.0.0.0") -> list[str]:
    """A simulated engine, as a host's engine command (this machine's python, which the host
    shares as its engine install)."""
    return sim_command(port, model, host=host)
