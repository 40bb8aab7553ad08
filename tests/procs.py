"""Real processes for integration tests: simulated engines and twistd llmproxy,
on 127.0.0.1, each stopped by its own pid."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def env() -> dict[str, str]:
    """The environment of a child: the checked-out code first on its path."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["PYTHONUNBUFFERED"] = "1"
    return e


def twistd() -> str:
    """The twistd of the interpreter running the tests."""
    path = BIN / "twistd"
    return str(path) if path.exists() else "twistd"


class Proc:
    """A child process whose output is collected line by line as it comes."""

    def __init__(self, argv: list[str], cwd: Path | None = None,
                 extra_env: dict[str, str] | None = None, **popen: Any) -> None:
        self.argv = argv
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.popen = subprocess.Popen(
            argv, cwd=cwd, env={**env(), **(extra_env or {})}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, **popen)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 15.0) -> re.Match[str]:
        """The first output line matching `pattern`, waiting for it if need be."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r} from {self.argv}; "
                                         "output:\n" + self.output())
                self._cond.wait(min(left, 0.2))

    def output(self) -> str:
        """What it printed so far; once it has exited, all of it (its last lines
        may still be on their way through the reader when its exit is seen)."""
        if self.popen.poll() is not None:
            self._reader.join(timeout=5)
        with self._cond:
            return "\n".join(self.lines)

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL, and wait until it has exited: the kernel closes a dying
        process's sockets one by one, so until then its listening socket may
        still take a connection (and reset it) after another socket of its
        has closed."""
        self.popen.kill()
        self.popen.wait(10)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it lingers; returns the exit status."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


class SimEngine(Proc):
    """`llmproxy-simengine` on an ephemeral port."""

    def __init__(self, models: list[str], *extra: str) -> None:
        super().__init__([sys.executable, "-m", "llmproxy.testing.simengine",
                          "--host", "127.0.0.1", "--port", "0", "--models", ",".join(models),
                          *extra])
        try:
            m = self.wait_for(r"listening on (https?://127\.0\.0\.1:(\d+))")
        except BaseException:
            self.stop()
            raise
        self.url = m.group(1)
        self.port = int(m.group(2))

    def requests(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.url + "/sim/requests", timeout=5) as r:
            records: list[dict[str, Any]] = json.load(r)
            return records


class Proxy(Proc):
    """`twistd -n --pidfile= llmproxy -c CONFIG` on an ephemeral port."""

    def __init__(self, config: dict[str, Any], workdir: Path, *, wait_ready: bool = True,
                 extra_env: dict[str, str] | None = None, launcher: bool = False,
                 pidfile: Path | None = None, prefix: tuple[str, ...] = (),
                 options: tuple[str, ...] = (), **popen: Any) -> None:
        config = {"listen": "127.0.0.1:0", **config}
        self.config_path = workdir / "hosts.json"
        self.write_config(config)
        # launcher: started the way the shipped unit starts it (SIGHUP ignored);
        # prefix: a command that runs it (e.g. prlimit with its limits); options: more of
        # llmproxy's own (--standby).
        start = [*prefix, str(ROOT / "bin" / "llmproxy-twistd") if launcher else twistd()]
        env = {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(extra_env or {})}
        pid_option = f"--pidfile={pidfile}" if pidfile else "--pidfile="
        super().__init__([*start, "-n", pid_option, "llmproxy", "-c", str(self.config_path),
                          *options],
                         cwd=workdir, extra_env=env, **popen)
        if wait_ready:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()       # never leave a process behind a failed start
                raise

    def write_config(self, config: dict[str, Any]) -> None:
        self.config_path.write_text(json.dumps({"listen": "127.0.0.1:0", **config}, indent=2))

    def wait_ready(self) -> None:
        m = self.wait_for(r"ready: listening on (https?)://127\.0\.0\.1:(\d+)")
        self.port = int(m.group(2))
        self.url = f"{m.group(1)}://127.0.0.1:{self.port}"

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return json.load(r)

    def serving_pid(self) -> int:
        """The pid of the process that answers /status now (upgrades change it)."""
        return int(self.get_json("/status")["pid"])


def one_host(engine: SimEngine, upstream: str | None = None, **extra: Any) -> dict[str, Any]:
    """A configuration of one unmanaged host, gpu1, at `engine`; with `upstream`, its model `m`
    under that upstream name (else the engine's own model list)."""
    models = {"models": {"m": {"host": "gpu1", "upstream": upstream}}} if upstream else {}
    return {"hosts": [{"name": "gpu1", "url": engine.url}], **models, **extra}


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def kill_if_alive(pid: int) -> None:
    """SIGKILL a process this test started, if it is still there."""
    if not gone(pid):
        os.kill(pid, signal.SIGKILL)


def stop_successor(successor: int | None, timeout: float = 20) -> None:
    """End an upgrade's successor this test caused, if there is one: SIGTERM, then
    SIGKILL if it is still there after `timeout` seconds (a test's teardown; the
    test that checks a successor's clean exit asserts it itself)."""
    if successor is None:
        return
    os.kill(successor, signal.SIGTERM)
    wait_gone(successor, timeout)
    kill_if_alive(successor)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to a port-0 bind or an outgoing connection."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORT_BLOCKS = 8
_PORTS_LOW = 10000
_PORTS_HIGH = max(_PORTS_LOW + _PORT_BLOCKS * 100, _ephemeral_low())


def _port_sequence() -> Iterator[int]:
    """Ports in this process's block, each once until the block wraps: the xdist
    worker's own block (gwN), or one picked by pid outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() \
        else os.getpid()
    size = (_PORTS_HIGH - _PORTS_LOW) // _PORT_BLOCKS
    low = _PORTS_LOW + (index % _PORT_BLOCKS) * size
    start = os.getpid() % size
    while True:
        for i in range(size):
            yield low + (start + i) % size


_ports = _port_sequence()


def free_port() -> int:
    """A port nothing is bound to right now, for something to listen on next.
    Below the kernel's ephemeral range, so no port-0 listener or outgoing
    connection takes it meanwhile; from this worker's block, so no other xdist
    worker names it; never one this process handed out before (until its block
    of some 2,700 ports wraps). For a port that must stay refused, use
    refusing_port."""
    for port in _ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("unreachable: the port sequence never ends")


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections for as long as it is held
    (bound, never listening: nothing else can take it meanwhile), for a host
    that is down or a proxy that is not there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def wait_gone(pid: int, timeout: float = 20) -> bool:
    """Whether the process exits within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


class BodyReader(threading.Thread):
    """Reads a whole response body in the background; keeps what failed."""

    def __init__(self, resp: Any) -> None:
        super().__init__(daemon=True)
        self.resp = resp
        self.body = b""
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.body = self.resp.read()
        except BaseException as e:  # the test inspects it
            self.error = e


def wait_until(check: Any, timeout: float = 15.0, every: float = 0.05) -> Any:
    """Poll `check` until it gives a true value or `timeout` passes; its last value
    (so `assert wait_until(...)` fails when it never came true)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def wait_new_pid(proxy: Proxy, old: int, timeout: float = 20) -> int:
    """The pid that answers /status once it is not `old` (an upgrade's successor)."""
    def new_pid() -> int:
        pid = proxy.serving_pid()
        return pid if pid != old else 0

    pid = wait_until(new_pid, timeout)
    if not pid:
        raise AssertionError(f"no new pid after SIGUSR1 to {old}:\n{proxy.output()}")
    return int(pid)


class RawServer:
    """A server on a raw socket on 127.0.0.1 (a hostile or scripted engine):
    each accepted connection goes to `serve(conn)` in a thread of its own;
    `stop` closes the listening socket."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.sock.close()
