"""Per-host locks: a flock per managed ssh target keeps two llmproxy instances off one host.

Each lock is a file ``host-<sha256(target)[:16]>.lock`` in the runtime directory holding
``"<pid> <target>"`` of its holder. The lock belongs to the open file description, so a
successor process that inherited the fd (an upgrade) keeps it with no gap in between.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
from collections.abc import Iterable, Mapping

from twisted.logger import Logger

from llmproxy.config import Config


class LockHeld(Exception):
    """Another process holds a host's lock; str() is
    ``another llmproxy manages TARGET (lock PATH, pid N)``."""

    def __init__(self, target: str, path: str, pid: int | None) -> None:
        self.target = target
        self.path = path
        self.pid = pid
        shown = str(pid) if pid is not None else "unknown"
        super().__init__(f"another llmproxy manages {target} (lock {path}, pid {shown})")


def runtime_dir(config_dir: str | None, environ: Mapping[str, str], *,
                run_dir: str = "/run", tmp_dir: str = "/tmp", uid: int | None = None,
                create: bool = True) -> str:
    """Where lock files (and cordons) live, created 0700: the config's `runtime_dir`,
    else ``$XDG_RUNTIME_DIR/llmproxy``, else ``/run/llmproxy`` when /run is writable
    (root), else ``/tmp/llmproxy-<uid>`` (which must then be a directory owned by us).
    Without `create`, only the path (to read from). The keyword arguments exist for
    tests."""
    uid = os.geteuid() if uid is None else uid
    if config_dir:
        path = config_dir
    elif environ.get("XDG_RUNTIME_DIR"):
        path = os.path.join(environ["XDG_RUNTIME_DIR"], "llmproxy")
    elif os.access(run_dir, os.W_OK):
        path = os.path.join(run_dir, "llmproxy")
    else:
        path = os.path.join(tmp_dir, f"llmproxy-{uid}")
        if not create and not os.path.lexists(path):
            return path
        if create:
            os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
        # In a world-writable /tmp, someone else could have made it first.
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            raise OSError(errno.EPERM, f"{path} is not a directory owned by uid {uid}")
        if create:
            os.chmod(path, 0o700)
        return path
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def lock_path(directory: str, target: str) -> str:
    """The lock file of ssh target `target` in `directory`."""
    return f"{directory}/host-{hashlib.sha256(target.encode()).hexdigest()[:16]}.lock"


def managed_targets(config: Config) -> list[str]:
    """The distinct ssh targets of managed hosts, sorted (hosts without engines or ssh take
    no lock)."""
    return sorted({host.ssh for host in config.hosts if host.managed and host.ssh})


def _holder(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(os.pread(fd, 200, 0).split()[0])
    return None


def _write_pid(fd: int, target: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {target}\n".encode(), 0)


class HostLocks:
    """The locks this process holds, one open fd per ssh target."""

    log = Logger()

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._fds: dict[str, int] = {}

    def acquire(self, targets: Iterable[str]) -> None:
        """Lock each distinct target once, in sorted order (so two proxies never deadlock);
        LockHeld if another process holds one, after releasing what this call took."""
        taken: list[str] = []
        try:
            for target in sorted(set(targets)):
                if target in self._fds:
                    continue
                self._fds[target] = self._lock(target)
                taken.append(target)
        except BaseException:
            for target in taken:
                os.close(self._fds.pop(target))
            raise
        for target in taken:
            self.log.info("locked host {target} ({path})", target=target,
                          path=lock_path(self.directory, target))

    def _lock(self, target: str) -> int:
        path = lock_path(self.directory, target)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockHeld(target, path, _holder(fd)) from None
            _write_pid(fd, target)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def fds(self) -> dict[str, int]:
        """target -> the open fd holding its lock (not inheritable: the handover makes
        inheritable copies)."""
        return dict(self._fds)

    def adopt(self, fds: Mapping[str, int]) -> None:
        """Take over already-locked open fds inherited from a predecessor process; the
        lock is checked (LockHeld if the fd does not hold it) and our pid written."""
        for target, fd in sorted(fds.items()):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a no-op if it holds the lock
            except BlockingIOError:
                raise LockHeld(target, lock_path(self.directory, target), _holder(fd)) from None
            os.set_inheritable(fd, False)
            _write_pid(fd, target)
            old = self._fds.get(target)
            if old is not None and old != fd:
                os.close(old)
            self._fds[target] = fd
            self.log.info("adopted the lock of host {target} (fd {fd})", target=target, fd=fd)

    def release(self) -> None:
        """Close every lock fd (a lock another process inherited stays held by it)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
