"""The processes of a run: the engine, the Twisted floor, nginx; and their /proc figures.

(llmproxy under twistd, in each of its modes: bench/proxies.py.) Every process is
started here, in its own session, with the open-file limit raised, and stopped by its
own pid (SIGTERM; nginx with SIGQUIT, its graceful stop). Their output goes to files
in the run's work directory, kept when something fails.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.stats import parse_cpu_ticks, parse_status_kib

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
NOFILE_WANTED = 65536
CLK_TCK = os.sysconf("SC_CLK_TCK")


class StartError(RuntimeError):
    """A process of the run did not come up; the message says why."""


def raise_nofile() -> None:
    """preexec for the children (and called for this process): open-file soft limit up
    to the hard limit (both to NOFILE_WANTED when allowed, as root is)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for limits in ((NOFILE_WANTED, max(hard, NOFILE_WANTED)), (hard, hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            return
        except (ValueError, OSError):
            continue


def nofile_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    """A loopback port nothing listens on right now (for nginx's listen directive)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    """The direct children of a process, from /proc."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        return [int(p) for p in text.split()]
    except OSError:
        found = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_text()
                except OSError:
                    continue
                if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                    found.append(int(d.name))
        return found


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes, summed, in seconds."""
    ticks = 0
    for pid in pids:
        try:
            ticks += parse_cpu_ticks(Path(f"/proc/{pid}/stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
    return ticks / CLK_TCK


def runqueue_wait_seconds(pids: list[int]) -> float:
    """How long these processes' threads waited runnable for a CPU, summed (the second
    field of /proc/PID/task/TID/schedstat): how much the machine, not the process's own
    work, held them back."""
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def memory_kib(pids: list[int], key: str) -> int:
    """A /proc/PID/status figure (VmHWM, VmRSS) summed over these processes, in KiB."""
    total = 0
    for pid in pids:
        try:
            total += parse_status_kib(Path(f"/proc/{pid}/status").read_text(), key) or 0
        except OSError:
            continue
    return total


def reset_peak_rss(pids: list[int]) -> bool:
    """Reset VmHWM to the current RSS (writing 5 to clear_refs, Linux >= 4.0)."""
    ok = True
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            ok = False
    return ok


@dataclass
class Process:
    """A child process of the run, its output in a file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    stop_signal: int = signal.SIGTERM

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> int | None:
        """Stop it by its pid (stop_signal, then SIGKILL if it lingers); its exit status."""
        if self.popen.poll() is None:
            os.kill(self.pid, self.stop_signal)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait()
        return self.popen.returncode


def _spawn(name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None,
           stop_signal: int = signal.SIGTERM) -> Process:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        # preexec_fn is safe here: the bench starts its processes before any thread exists.
        popen = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT,
                                 preexec_fn=raise_nofile,  # noqa: PLW1509
                                 start_new_session=True)
    return Process(name, popen, log, stop_signal)


def _wait_line(proc: Process, pattern: str, timeout: float) -> re.Match[str]:
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = proc.log.read_text(errors="replace")
        except OSError:
            text = ""
        m = rx.search(text)
        if m:
            return m
        if not proc.alive():
            raise StartError(f"{proc.name} exited with status {proc.popen.returncode} before "
                             f"it was ready; its output:\n{proc.output()}")
        if time.monotonic() > deadline:
            raise StartError(f"{proc.name} was not ready within {timeout:g}s; its output:\n"
                             f"{proc.output()}")
        time.sleep(0.05)


def _wait_port(proc: Process, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((HOST, port), timeout=1):
                return
        except OSError:
            pass
        if not proc.alive():
            raise StartError(f"{proc.name} exited with status {proc.popen.returncode}; "
                             f"its output:\n{proc.output()}")
        if time.monotonic() > deadline:
            raise StartError(f"{proc.name} did not accept on port {port} within {timeout:g}s")
        time.sleep(0.05)


def child_env() -> dict[str, str]:
    """The environment of Python children: the checked-out code first on their path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Target:
    """Where the client sends its requests, and whose processes it measures."""

    name: str
    port: int
    process: Process | None = None
    extra: dict[str, str] = field(default_factory=dict)
    engine: Process | None = None
    # A llmproxy target's `speedups` field of its /status (bench/proxies.py).
    speedups: dict[str, Any] | None = None

    def pids(self) -> list[int]:
        """The processes whose CPU and memory count for this target (none for direct)."""
        if self.process is None or not self.process.alive():
            return []
        return [self.process.pid, *children(self.process.pid)]

    def engine_pids(self) -> list[int]:
        """The bench engine behind it (its CPU is the harness's, not the target's)."""
        return [self.engine.pid] if self.engine is not None and self.engine.alive() else []


def start_listening(name: str, argv: list[str], workdir: Path, ready: str,
                    timeout: float, env: dict[str, str] | None = None) -> tuple[Process, int]:
    """Start a process (its environment `env`, else `child_env()`) and wait for its
    `ready` line, whose group is its port; stopped again if it never comes."""
    proc = _spawn(name, argv, workdir, child_env() if env is None else env)
    try:
        m = _wait_line(proc, ready, timeout)
    except BaseException:
        proc.stop()
        raise
    return proc, int(m.group(1))


def start_engine(workdir: Path) -> tuple[Process, int]:
    return start_listening("engine", [sys.executable, "-m", "bench.engine", "--host", HOST,
                                      "--port", "0"], workdir,
                           r"bench engine listening on 127\.0\.0\.1:(\d+)", 15)


def start_floor(workdir: Path, engine_port: int) -> Target:
    """The Twisted floor (bench/floor.py) in front of the engine, on a free port."""
    proc, port = start_listening(
        "twisted", [sys.executable, "-m", "bench.floor", "--engine-port", str(engine_port),
                    "--port", "0"], workdir, r"bench floor listening on 127\.0\.0\.1:(\d+)", 15)
    return Target("twisted", port, proc)


NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{
    worker_connections {connections};
}}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    upstream engine {{
        server 127.0.0.1:{engine_port};
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    """nginx on PATH or in /usr/sbin, if installed."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def nginx_version(binary: str) -> str:
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    m = re.search(r"nginx/(\S+)", out.stderr + out.stdout)
    return m.group(1) if m else "unknown"


def start_nginx(workdir: Path, engine_port: int, binary: str) -> Target:
    """nginx as a streaming reverse proxy, one worker, private prefix, `daemon off;`."""
    prefix = workdir / "nginx"
    (prefix / "tmp").mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_CONF.format(prefix=prefix, engine_port=engine_port, port=port,
                                      nofile=NOFILE_WANTED, connections=8192))
    proc = _spawn("nginx", [binary, "-p", str(prefix), "-e", str(prefix / "error.log"),
                            "-c", str(conf)], workdir, stop_signal=signal.SIGQUIT)
    try:
        _wait_port(proc, port, 15)
    except BaseException:
        proc.stop()
        raise
    return Target("nginx", port, proc, {"version": nginx_version(binary)})
