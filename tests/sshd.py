"""A real OpenSSH sshd on 127.0.0.1 for integration tests, stopped by its own pid.

``bin/install-test-deps`` installs it (Debian's openssh-server) and creates ``/run/sshd``. The
daemon runs in the foreground (``sshd -D -e``, its log in ``<workdir>/sshd.log``) on a free port of
127.0.0.1 only, with a host key, a client key and ``authorized_keys`` generated in ``workdir``:
key authentication only, for root (the tests run as root), no PAM, no forwarding, no environment
from the client. Each ssh call is a separate connection (no ControlMaster).

Usage::

    reason = available()          # None when usable
    with SSHD(tmp_path) as sshd:  # start() waits until a real `ssh ... true` succeeds
        sshd.run("cat", input="hi").stdout                     # "hi"
        argv = [*sshd.ssh_command, sshd.target, "true"]         # llmproxy's `ssh_command` + target

``run`` quotes each word for the remote shell, so the remote side sees exactly the words given;
``ssh_command`` is a plain prefix (ssh joins the words after the target with spaces and the
remote login shell parses them, as with any ssh).

``stop()`` freezes (SIGSTOP) the listener and every process descended from it (connection
handlers, the commands they run), so the tree cannot grow, then SIGTERMs and continues them all,
SIGKILLs what is left after ``STOP_GRACE`` seconds, and waits until every one of them is gone,
zombies included: meanwhile the test process is a child subreaper, so the orphans become its
children and it reaps them (PID 1 here may take seconds). Processes are identified by pid and
start time, so a reused pid is never signalled. A process that had left the tree before (double
forked away to PID 1, like an engine the agent started) cannot be identified and is not touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from types import TracebackType

from tests import needs

_SBIN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
PRIVSEP_DIR = pathlib.Path("/run/sshd")
STOP_GRACE = 3.0  # SIGTERM -> SIGKILL
_Ident = tuple[int, str]  # (pid, start time): a process, robust against pid reuse


def _which(name: str) -> str | None:
    """Absolute path of a program (sshd must be started by absolute path to re-exec)."""
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + _SBIN_PATH)


def required() -> bool:
    """LLMPROXY_REQUIRE_SSHD: the sshd tests fail instead of skipping when no sshd
    can run (CI sets it to 1; unset, empty or 0 means skip): tests/needs.py's switch."""
    return needs.required("sshd")


def available() -> str | None:
    """Why no sshd can be run here, or None when it can."""
    for prog in ("sshd", "ssh", "ssh-keygen"):
        if _which(prog) is None:
            return f"{prog} not found (run bin/install-test-deps as root)"
    if os.geteuid() != 0:
        return "not root (the test sshd logs in as root)"
    if not os.path.exists("/proc/self/stat"):
        return "no /proc (needed to find the daemon's processes)"
    return None


def _parse_stat(data: str) -> tuple[str, int, str]:
    """(state letter, parent pid, start time) from the text of /proc/PID/stat."""
    fields = data[data.rindex(")") + 2:].split()  # the command name may hold spaces
    return fields[0], int(fields[1]), fields[19]


def _stat(pid: int) -> tuple[str, int, str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return _parse_stat(f.read().decode("ascii", "replace"))
    except (OSError, ValueError, IndexError):
        return None


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every live process visible in /proc."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st and st[0] not in ("Z", "X"):
                table[int(entry.name)] = (st[1], st[2])
    return table


def _start_time(pid: int) -> str | None:
    """Start time of a live process (a zombie has finished: None)."""
    st = _stat(pid)
    return st[2] if st and st[0] not in ("Z", "X") else None


def _present(ident: _Ident) -> bool:
    """The process exists, even as a zombie."""
    st = _stat(ident[0])
    return st is not None and st[2] == ident[1]


def _alive(ident: _Ident) -> bool:
    return _start_time(ident[0]) == ident[1]


def _signal(ident: _Ident, sig: int) -> None:
    if _alive(ident):
        with contextlib.suppress(ProcessLookupError):
            os.kill(ident[0], sig)


def _wait_stopped(idents: list[_Ident], timeout: float = 2.0) -> None:
    """Wait until each process is stopped (it can fork no more) or gone."""
    deadline = time.monotonic() + timeout
    for pid, start in idents:
        while time.monotonic() < deadline:
            st = _stat(pid)
            if st is None or st[2] != start or st[0] in ("T", "t", "Z", "X"):
                break
            time.sleep(0.002)


_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
    """While inside, this process is a child subreaper (Linux): a descendant orphaned meanwhile
    becomes its child instead of PID 1's, so its zombie can be reaped at once."""
    libc: ctypes.CDLL | None = None
    old = ctypes.c_int(0)
    with contextlib.suppress(OSError, AttributeError):
        lib = ctypes.CDLL(None, use_errno=True)
        if (lib.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(old), 0, 0, 0) == 0
                and lib.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0):
            libc = lib
    try:
        yield
    finally:
        if libc is not None:
            libc.prctl(_PR_SET_CHILD_SUBREAPER, old.value, 0, 0, 0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssh_version(sshd: str) -> tuple[int, int]:
    """(major, minor) of the sshd binary, (0, 0) when it does not say."""
    out = subprocess.run([sshd, "-V"], capture_output=True, text=True, check=False, timeout=10)
    m = re.search(r"OpenSSH_(\d+)\.(\d+)", out.stdout + out.stderr)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


class SSHD:
    """A real OpenSSH sshd on 127.0.0.1:<free port>, non-daemon (``-D -e``), with generated host
    and client keys in ``workdir``, StrictModes no, key authentication only, for root."""

    user = "root"

    def __init__(self, workdir: pathlib.Path) -> None:
        self.workdir = pathlib.Path(workdir)
        self.host_key = self.workdir / "ssh_host_ed25519_key"
        self.client_key = self.workdir / "client_ed25519"
        self.authorized_keys = self.workdir / "authorized_keys"
        self.config = self.workdir / "sshd_config"
        self.pidfile = self.workdir / "sshd.pid"
        self.log = self.workdir / "sshd.log"
        self.port = 0
        self.address = "127.0.0.1"          # where it listens and callers connect
        self.prefix: list[str] = []          # words before sshd (``ip netns exec NS ...``)
        self.extra_config: list[str] = []    # more sshd_config lines
        self.popen: subprocess.Popen[bytes] | None = None
        self._ident: _Ident | None = None

    # --- what callers use -------------------------------------------------------------------

    @property
    def target(self) -> str:
        return f"{self.user}@{self.address}"

    @property
    def ssh_command(self) -> list[str]:
        """ssh and its options, without the target: usable as llmproxy's ``ssh_command``."""
        return [
            "ssh", "-p", str(self.port), "-i", str(self.client_key),
            "-F", "/dev/null",  # neither ~/.ssh/config nor /etc/ssh/ssh_config (SendEnv, ...)
            "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5",
        ]

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def run(self, *remote: str, input: str | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run the words ``remote`` over ssh (each quoted for the remote shell); stdin is
        ``input`` or empty. Never raises for a non-zero exit status."""
        argv = [*self.ssh_command, self.target, *(shlex.quote(w) for w in remote)]
        return subprocess.run(argv, input=input,
                              stdin=subprocess.DEVNULL if input is None else None,
                              capture_output=True, text=True, timeout=timeout, check=False)

    def processes(self) -> list[int]:
        """Pids of the listener and every process descended from it (connections, commands)."""
        return [pid for pid, _ in self._tree()]

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def _this_log(self) -> str:
        """The log of the current (last) start."""
        return self.log_text().rsplit("--- starting", 1)[-1]

    def pick_port(self) -> int:
        """The port to listen on: a free one of this machine's 127.0.0.1."""
        return _free_port()

    # --- start --------------------------------------------------------------------------------

    def _keys(self) -> None:
        keygen = _which("ssh-keygen") or "ssh-keygen"
        for key in (self.host_key, self.client_key):
            if not key.exists():
                subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", "llmproxy-test",
                                "-f", str(key)], check=True, capture_output=True, timeout=30)
        self.authorized_keys.write_text(self.client_key.with_suffix(".pub").read_text())

    def _write_config(self, sshd: str) -> None:
        lines = [
            f"Port {self.port}",
            f"ListenAddress {self.address}",
            "AddressFamily inet",
            f"HostKey {self.host_key}",
            f"PidFile {self.pidfile}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "StrictModes no",  # the keys live in a temp dir
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "AuthenticationMethods publickey",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "PermitUserEnvironment no",  # and no AcceptEnv: the client's environment stays home
            "MaxStartups 100:30:200",
            "MaxSessions 100",
            "LoginGraceTime 30",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "AllowAgentForwarding no",
            "AllowTcpForwarding no",
            "PermitTunnel no",
            "LogLevel INFO",
        ]
        if _openssh_version(sshd) >= (9, 8):
            # Newer sshd penalise a source address after failed or aborted connections; every
            # test connection comes from 127.0.0.1.
            lines.append("PerSourcePenalties no")
        self.config.write_text("\n".join(lines + self.extra_config) + "\n")

    def start(self, timeout: float = 10) -> None:
        """Start sshd and wait until a real ``ssh ... true`` succeeds."""
        if self.popen is not None:
            raise RuntimeError("sshd already started")
        reason = available()
        if reason:
            raise RuntimeError(f"cannot run sshd: {reason}")
        sshd = _which("sshd")
        assert sshd is not None
        if not PRIVSEP_DIR.is_dir():  # bin/install-test-deps makes it; /run may be a new tmpfs
            PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._keys()
        deadline = time.monotonic() + timeout
        for _attempt in range(5):  # another process may take the free port before sshd binds it
            self.port = self.pick_port()
            self._write_config(sshd)
            with open(self.log, "ab") as log:
                log.write(f"--- starting sshd on {self.address}:{self.port}\n".encode())
                log.flush()
                self.popen = subprocess.Popen(
                    [*self.prefix, sshd, "-D", "-e", "-f", str(self.config)],
                    stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            start = _start_time(self.popen.pid)
            self._ident = (self.popen.pid, start) if start else None
            try:
                if self._wait_ready(deadline):
                    return
            except BaseException:
                self.stop()
                raise
            self.stop()  # exited: the port was taken?
            if "Address already in use" not in self._this_log():
                break
        raise RuntimeError(f"sshd did not start; its log:\n{self.log_text()[-3000:]}")

    def _wait_ready(self, deadline: float) -> bool:
        """True once ``ssh true`` works, False if sshd exited; raises on timeout."""
        assert self.popen is not None
        last = ""
        while True:
            if self.popen.poll() is not None:
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"sshd on port {self.port} not ready in time; last ssh: "
                                   f"{last!r}; its log:\n{self.log_text()[-3000:]}")
            # sshd says so once it listens (a bare TCP probe would log an aborted kex)
            listening = f"listening on {self.address} port {self.port}." in self._this_log()
            if listening:
                try:
                    done = self.run("true", timeout=max(remaining, 0.5))
                except subprocess.TimeoutExpired:
                    continue
                if done.returncode == 0:
                    return True
                last = done.stderr.strip()
            time.sleep(0.02)

    # --- stop ---------------------------------------------------------------------------------

    def _tree(self) -> list[_Ident]:
        """The listener and its live descendants, as (pid, start time)."""
        if self._ident is None or not _alive(self._ident):
            return []
        children: dict[int, list[tuple[int, str]]] = {}
        for pid, (ppid, start) in _proc_table().items():
            children.setdefault(ppid, []).append((pid, start))
        tree = [self._ident]
        i = 0
        while i < len(tree):
            tree.extend(children.get(tree[i][0], ()))
            i += 1
        return tree

    def stop(self) -> None:
        """Stop sshd and every process descended from it; wait until all are gone."""
        if self.popen is None:
            return
        frozen: list[_Ident] = []
        seen: set[_Ident] = set()
        # Freeze the tree (a stopped process forks nothing), growing it until nothing new shows.
        while True:
            new = [ident for ident in self._tree() if ident not in seen]
            if not new:
                break
            for ident in new:
                _signal(ident, signal.SIGSTOP)
                seen.add(ident)
                frozen.append(ident)
            _wait_stopped(new)
        for ident in frozen:
            _signal(ident, signal.SIGTERM)
        with _subreaper():  # orphans come to us, not to PID 1, and we reap them at once
            for ident in frozen:
                _signal(ident, signal.SIGCONT)
            self._reap(frozen)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        self.popen = None
        self._ident = None

    def _reap(self, frozen: list[_Ident]) -> None:
        """Wait until the processes are gone (SIGKILL after STOP_GRACE), reaping those that are
        our children: the listener and the orphans _subreaper gave us."""
        assert self.popen is not None
        me = os.getpid()
        deadline = time.monotonic() + STOP_GRACE
        killed = False
        while True:
            self.popen.poll()
            for ident in frozen:
                st = _stat(ident[0])
                if ident != self._ident and st and st[2] == ident[1] and st[1] == me:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(ident[0], os.WNOHANG)
            alive = [ident for ident in frozen if _alive(ident)]
            if not alive and not any(_present(ident) for ident in frozen):
                return
            if time.monotonic() >= deadline:
                if not alive:
                    return  # only zombies another parent (PID 1) has yet to reap
                if killed:
                    raise RuntimeError(f"processes of sshd left after SIGKILL: {alive}")
                for ident in alive:
                    _signal(ident, signal.SIGKILL)
                killed = True
                deadline = time.monotonic() + 10
            time.sleep(0.005)

    def __enter__(self) -> SSHD:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
