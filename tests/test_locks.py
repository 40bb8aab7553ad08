"""Per-host locks with real files and real flock between processes: naming, de-duplication,
the refusal message, hand-over of a lock to an exec'd successor, and the runtime directory."""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from llmproxy.config import Config, EngineConfig, HostConfig, ListenAddress, parse_config
from llmproxy.hosts.locks import HostLocks, LockHeld, lock_path, managed_targets, runtime_dir

ROOT = Path(__file__).resolve().parent.parent

# A third party trying the lock: prints "locked" or "busy".
PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("locked")
except BlockingIOError:
    print("busy")
"""

# Another llmproxy: takes the locks and prints the refusal, if any.
OTHER = """
import sys
from llmproxy.hosts.locks import HostLocks, LockHeld
try:
    HostLocks(sys.argv[1]).acquire(sys.argv[2:])
    print("acquired")
except LockHeld as e:
    print(e)
"""


def probe(path: str) -> str:
    """Whether another process can take the lock at `path` right now."""
    return subprocess.run([sys.executable, "-c", PROBE, path], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()


def other_llmproxy(directory: Path, *targets: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", OTHER, str(directory), *targets], env=env,
                          capture_output=True, text=True, check=True, timeout=30).stdout.strip()


def test_lock_files_are_named_by_a_hash_of_the_target() -> None:
    """host-<first 16 hex digits of sha256(target)>.lock in the given directory."""
    digest = hashlib.sha256(b"llm@10.0.0.5").hexdigest()[:16]
    assert lock_path("/run/llmproxy", "llm@10.0.0.5") == f"/run/llmproxy/host-{digest}.lock"
    assert lock_path("/d", "a") != lock_path("/d", "b")


def test_each_distinct_target_is_locked_once_and_records_our_pid(tmp_path: Path) -> None:
    """Duplicate targets share one lock; each file says "<pid> <target>"; another process
    can take none of them until they are released."""
    locks = HostLocks(str(tmp_path))
    locks.acquire(["llm@b", "llm@a", "llm@b"])
    assert sorted(locks.fds()) == ["llm@a", "llm@b"]
    assert len(list(tmp_path.iterdir())) == 2
    for target in ("llm@a", "llm@b"):
        path = lock_path(str(tmp_path), target)
        assert Path(path).read_text() == f"{os.getpid()} {target}\n"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert probe(path) == "busy"
    locks.acquire(["llm@a"])  # already held: nothing more
    assert len(locks.fds()) == 2
    locks.release()
    assert locks.fds() == {}
    assert probe(lock_path(str(tmp_path), "llm@a")) == "locked"


def test_a_second_llmproxy_is_refused_with_the_target_lock_and_holders_pid(
        tmp_path: Path) -> None:
    """The refusal names the target, the lock file and the pid of the holder."""
    locks = HostLocks(str(tmp_path))
    locks.acquire(["llm@gpu1"])
    path = lock_path(str(tmp_path), "llm@gpu1")
    assert other_llmproxy(tmp_path, "llm@gpu1") == (
        f"another llmproxy manages llm@gpu1 (lock {path}, pid {os.getpid()})")
    locks.release()
    assert other_llmproxy(tmp_path, "llm@gpu1") == "acquired"


def test_a_refusal_releases_what_the_same_call_took(tmp_path: Path) -> None:
    """Locking a, b where b is held elsewhere: LockHeld, and a is free again."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from llmproxy.hosts.locks import HostLocks; "
         "HostLocks(sys.argv[1]).acquire(['llm@b']); print('ready', flush=True); "
         "sys.stdin.read()", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        locks = HostLocks(str(tmp_path))
        with pytest.raises(LockHeld) as info:
            locks.acquire(["llm@b", "llm@a"])
        assert info.value.pid == holder.pid and info.value.target == "llm@b"
        assert str(info.value).endswith(f"pid {holder.pid})")
        assert locks.fds() == {}
        assert probe(lock_path(str(tmp_path), "llm@a")) == "locked"
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


def test_an_empty_lock_file_gives_an_unknown_pid(tmp_path: Path) -> None:
    """A holder that has not written its pid yet: "pid unknown", not a crash."""
    path = lock_path(str(tmp_path), "t")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # flock locks are per open file description: a second open in this process conflicts.
        with pytest.raises(LockHeld, match=r"\(lock .*, pid unknown\)$"):
            HostLocks(str(tmp_path)).acquire(["t"])
    finally:
        os.close(fd)


def test_an_execd_successor_keeps_the_lock_with_no_gap(tmp_path: Path) -> None:
    """The fd handed to an exec'd child keeps the flock after the parent closes its own
    copy: a third party cannot lock meanwhile; the successor's pid is written; once it
    exits, the lock is free."""
    locks = HostLocks(str(tmp_path))
    locks.acquire(["llm@gpu1"])
    path = lock_path(str(tmp_path), "llm@gpu1")
    fd = os.dup(locks.fds()["llm@gpu1"])  # the inheritable copy a hand-over makes
    successor_code = (
        "import sys; from llmproxy.hosts.locks import HostLocks; "
        "locks = HostLocks(sys.argv[1]); locks.adopt({'llm@gpu1': int(sys.argv[2])}); "
        "print('adopted', flush=True); sys.stdin.read()")
    successor = subprocess.Popen(
        [sys.executable, "-c", successor_code, str(tmp_path), str(fd)], pass_fds=[fd],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        os.close(fd)
        assert successor.stdout is not None
        assert successor.stdout.readline().strip() == "adopted"
        locks.release()  # the predecessor exits
        assert probe(path) == "busy"
        assert Path(path).read_text() == f"{successor.pid} llm@gpu1\n"
        assert other_llmproxy(tmp_path, "llm@gpu1").endswith(f"pid {successor.pid})")
    finally:
        assert successor.stdin is not None
        successor.stdin.close()
        successor.wait(timeout=30)
    assert probe(path) == "locked"


def test_adopting_an_fd_that_does_not_hold_the_lock_is_refused(tmp_path: Path) -> None:
    """adopt() verifies the lock: an fd on a file someone else holds raises LockHeld."""
    holder = HostLocks(str(tmp_path))
    holder.acquire(["t"])
    fd = os.open(lock_path(str(tmp_path), "t"), os.O_RDWR)
    try:
        with pytest.raises(LockHeld, match=f"pid {os.getpid()}"):
            HostLocks(str(tmp_path)).adopt({"t": fd})
    finally:
        os.close(fd)
        holder.release()


def test_only_managed_hosts_take_a_lock_each_target_once() -> None:
    """Hosts without engines take none; two hosts on one target share one."""
    config = parse_config({"hosts": [
        {"name": "a", "url": "http://10.0.0.5:8081", "ssh": "llm@10.0.0.5",
         "engines": {"e": {"command": ["x"]}}},
        {"name": "b", "url": "http://10.0.0.5:8082", "ssh": "llm@10.0.0.5",
         "engines": {"e": {"command": ["y"]}}},
        {"name": "c", "url": "http://10.0.0.6:8081", "ssh": "gpu@10.0.0.6",
         "engines": {"e": {"command": ["z"]}}},
        {"name": "d", "url": "http://10.0.0.7:8081", "ssh": "llm@10.0.0.7"},
        {"name": "e", "url": "http://10.0.0.8:8081"}]})
    assert managed_targets(config) == ["gpu@10.0.0.6", "llm@10.0.0.5"]
    unmanaged = Config(ListenAddress("127.0.0.1", 8080), (
        HostConfig("x", "http://x"), HostConfig("y", "http://y", ssh="y"),
        HostConfig("z", "http://z", engines={"e": EngineConfig("e", ("c",))})))
    assert managed_targets(unmanaged) == []


def test_runtime_dir_prefers_config_then_xdg_then_run_then_tmp(tmp_path: Path) -> None:
    """The order of choice, each created 0700."""
    configured = tmp_path / "conf"
    assert runtime_dir(str(configured), {"XDG_RUNTIME_DIR": "/nowhere"}) == str(configured)
    assert stat.S_IMODE(configured.stat().st_mode) == 0o700
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    assert runtime_dir(None, {"XDG_RUNTIME_DIR": str(xdg)}) == str(xdg / "llmproxy")
    assert stat.S_IMODE((xdg / "llmproxy").stat().st_mode) == 0o700
    run = tmp_path / "run"
    run.mkdir()
    assert runtime_dir(None, {}, run_dir=str(run)) == str(run / "llmproxy")
    readonly = tmp_path / "ro"
    readonly.mkdir(mode=0o500)
    if os.access(readonly, os.W_OK):  # root writes anywhere: fake "not writable" by absence
        readonly = tmp_path / "absent"
    uid = os.geteuid()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    assert runtime_dir(None, {}, run_dir=str(readonly), tmp_dir=str(tmp)) == (
        f"{tmp}/llmproxy-{uid}")
    assert stat.S_IMODE(os.lstat(f"{tmp}/llmproxy-{uid}").st_mode) == 0o700


def test_a_tmp_runtime_dir_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    """/tmp/llmproxy-<uid> made first by another user is not used."""
    with pytest.raises(OSError, match="not a directory owned by uid 12345"):
        runtime_dir(None, {}, run_dir=str(tmp_path / "absent"), tmp_dir=str(tmp_path),
                    uid=12345)
