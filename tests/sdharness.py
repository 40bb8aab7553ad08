"""A real systemd >= 254 `--user` manager for integration tests, without touching the system.

The manager comes from ``bin/fetch-systemd254`` (unpacked, never installed). It runs:

* in a private mount namespace (``unshare -m --propagation private``), where a tmpfs over
  ``/run/systemd`` makes it believe the machine was booted with systemd;
* in cgroups of its own, created before it starts: the launcher moves itself there and checks it
  did before it execs systemd, because a ``systemd --user`` started from the root cgroup takes
  over the whole machine's cgroup tree;
* with a hermetic configuration: unit search path = ``unit_dir`` + the unpacked 254 user units
  (nothing from the host's /etc/systemd/user), no generators, no journald (units log with
  ``StandardOutput=append:/path``), an explicit ``PATH`` that starts with the test venv's bin.

``stop()`` stops every unit and exits the manager, kills (by pid) anything still in its cgroups,
removes every cgroup it created (depth-first, including those systemd created below) and asserts
that no process it started is left.

Usage::

    reason = available()          # None when usable
    with UserManager(tmp_path) as m:
        (m.unit_dir / "x.service").write_text(...)
        m.systemctl("daemon-reload")
        m.systemctl("start", "x.service")
        m.wait_for("x.service", "ActiveState", "active")
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tty
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_SD_DIR = os.environ.get("LLMPROXY_SD254", "/var/cache/llmproxy-test/sd254")
MIN_MAJOR = 254
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
# The hierarchies systemd tracks processes in (v1 named hierarchy, v2 unified).
_TRACKING = ("name=systemd", "")
# A fresh v1 cpuset cgroup has no CPUs or memory nodes; systemd does not use v1 cpuset anyway.
_SKIP_V1 = {"cpuset"}
_SUN_PATH_MAX = 107
# In the manager's environment for its own sake; units do not inherit them.
_MANAGER_ONLY_ENV = ("LD_LIBRARY_PATH", "SYSTEMD_LOG_TARGET", "SYSTEMD_LOG_LEVEL",
                     "SYSTEMD_COLORS", "SYSTEMD_UNIT_PATH", "SYSTEMD_GENERATOR_PATH",
                     "SYSTEMD_ENVIRONMENT_GENERATOR_PATH")


# --- the unpacked systemd ------------------------------------------------------------------------


def _sd_root(sd_dir: str) -> pathlib.Path:
    return pathlib.Path(sd_dir) / "root"


def _lib_path(root: pathlib.Path) -> str:
    """LD_LIBRARY_PATH for the unpacked libsystemd-shared-*.so and libsystemd.so.0."""
    dirs: list[str] = []
    for pattern in ("libsystemd-shared-*.so", "libsystemd.so.0"):
        for lib in sorted(root.glob(f"usr/lib/*/**/{pattern}")) + sorted(
                root.glob(f"usr/lib/*/{pattern}")):
            if str(lib.parent) not in dirs:
                dirs.append(str(lib.parent))
    return ":".join(dirs)


def _sd_version(sd_dir: str) -> int | None:
    """Major version of the unpacked systemd, or None if it is missing or does not run."""
    root = _sd_root(sd_dir)
    binary = root / "lib/systemd/systemd"
    if not os.access(binary, os.X_OK):
        return None
    try:
        out = subprocess.run([str(binary), "--version"], check=False, capture_output=True,
                             text=True, timeout=10,
                             env={"LD_LIBRARY_PATH": _lib_path(root)}).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"systemd (\d+)", out)
    return int(m.group(1)) if m else None


# --- cgroups -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy and where this process sits in it."""

    key: str                 # "" for v2 unified, else the v1 controllers ("cpu", "name=systemd")
    mountpoint: pathlib.Path
    current: str             # this process's cgroup path in it, relative to the mount ("/...")

    @property
    def version(self) -> int:
        return 2 if self.key == "" else 1


def _hierarchies(pid: int | str = "self") -> list[Hierarchy]:
    """Every mounted cgroup hierarchy and the cgroup of `pid` in each."""
    paths: dict[str, str] = {}
    for line in pathlib.Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hid, controllers, path = line.split(":", 2)
        paths[controllers] = path
    found: list[Hierarchy] = []
    seen: set[str] = set()
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) < 3 or rfields[0] not in ("cgroup", "cgroup2"):
            continue
        mount_root, mountpoint = fields[3], fields[4].replace("\\040", " ")
        if rfields[0] == "cgroup2":
            key = ""
        else:
            opts = rfields[2].split(",")
            names = [o for o in opts if o.startswith("name=")]
            known = {c for c in paths if c}
            key = next((k for k in known if set(k.split(",")) <= set(opts)
                        and (not names or names[0] in k.split(","))), "")
            if not key:
                continue
        if key in seen or key not in paths:
            continue
        seen.add(key)
        rel = paths[key]
        if mount_root != "/" and rel.startswith(mount_root):
            rel = rel[len(mount_root):] or "/"
        found.append(Hierarchy(key, pathlib.Path(mountpoint), rel))
    return found


def cgroup_layout() -> str:
    """'unified' (v2 only), 'hybrid' (v1 controllers + v2 unified) or 'legacy' (v1 only)."""
    try:
        fstype = subprocess.run(["stat", "-fc", "%T", str(CGROUP_ROOT)], check=False,
                                capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        fstype = "?"
    if fstype in ("cgroup2fs", "cgroup2"):
        return "unified"
    kinds = {h.version for h in _hierarchies()}
    return "hybrid" if kinds == {1, 2} else "legacy" if kinds == {1} else f"unknown ({fstype})"


def _plan_cgroups(name: str) -> list[tuple[Hierarchy, pathlib.Path]]:
    """The cgroups (not yet created) that the manager's launcher moves itself into.

    The tracking hierarchies (v1 name=systemd, v2 unified) always get a child of this process's
    own cgroup. A v1 controller hierarchy gets one only where this process sits at the same path
    as in name=systemd: systemd uses the same relative path in every v1 hierarchy and ignores
    controllers where that path does not exist, so the launcher is never moved out of a cgroup it
    was placed in by whoever runs the tests (e.g. a memory cgroup at a different path).
    """
    hs = _hierarchies()
    tracking = [h for h in hs if h.key in _TRACKING]
    if not tracking:
        raise RuntimeError("no name=systemd or cgroup2 hierarchy mounted")
    base = next((h.current for h in hs if h.key == "name=systemd"), tracking[0].current)
    return [(h, h.mountpoint / h.current.lstrip("/") / name) for h in hs
            if h.key in _TRACKING
            or (h.current == base and not set(h.key.split(",")) & _SKIP_V1)]


def _subtree(top: pathlib.Path) -> list[pathlib.Path]:
    """`top` and every cgroup below it, deepest first."""
    if not top.is_dir():
        return []
    out = [pathlib.Path(d) for d, _, _ in os.walk(top, topdown=False)]
    return out


def _procs(top: pathlib.Path) -> set[int]:
    pids: set[int] = set()
    for d in _subtree(top):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
    return pids


def _alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


# --- availability --------------------------------------------------------------------------------


def available(sd_dir: str = DEFAULT_SD_DIR) -> str | None:
    """None if a UserManager can run here, else the reason why not."""
    if sys.platform != "linux":
        return "not Linux"
    if os.geteuid() != 0:
        return "not root (moving processes between cgroups and mounting need root)"
    for tool in ("unshare", "stat"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    version = _sd_version(sd_dir)
    if version is None:
        return f"systemd >= {MIN_MAJOR} not fetched into {sd_dir} (run bin/fetch-systemd254)"
    if version < MIN_MAJOR:
        return f"{sd_dir} holds systemd {version}, need {MIN_MAJOR} (run bin/fetch-systemd254)"
    if not os.access(_sd_root(sd_dir) / "bin/systemctl", os.X_OK):
        return f"{sd_dir}/root/bin/systemctl missing (run bin/fetch-systemd254)"
    try:
        planned = _plan_cgroups(f"llmproxy-test-probe-{os.getpid()}-{secrets.token_hex(4)}")
    except (OSError, RuntimeError) as e:
        return f"no usable cgroup hierarchy: {e}"
    probe = next(d for h, d in planned if h.key in _TRACKING)
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cgroup fs not writable ({probe.parent}: {e.strerror})"
    try:
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                           check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unshare -m failed: {e}"
    if r.returncode != 0:
        return f"unshare -m failed: {r.stderr.strip()}"
    return None


# --- the manager ---------------------------------------------------------------------------------


class SystemctlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return (f"{' '.join(map(str, self.cmd))} exited {self.returncode}\n"
                f"stdout: {self.stdout}\nstderr: {self.stderr}")


_LAUNCHER = """\
#!/bin/sh
# Run as: unshare -m --propagation private <this script>. Moves itself into the test cgroups,
# checks it is there, then execs the user manager. Never execs systemd anywhere else.
set -eu
for d in {cgroups}; do
    echo $$ > "$d/cgroup.procs"
done
for want in {tracking}; do
    grep -qx "$want" /proc/self/cgroup || {{
        echo "launcher: not in cgroup $want; refusing to start systemd" >&2; exit 97; }}
done
if [ -d /run/systemd ]; then
    mount -t tmpfs -o mode=755 llmproxy-test /run/systemd
else
    mount -t tmpfs -o mode=755 llmproxy-test /run
    mkdir -p /run/systemd
fi
mkdir -p /run/systemd/system
# systemd --user logs to /dev/console: in this namespace that is the harness's pty.
if [ -e /dev/console ]; then mount --bind {console} /dev/console; fi
exec env -i {env} {systemd} --user
"""


def _q(s: str | os.PathLike[str]) -> str:
    return "'" + str(s).replace("'", "'\\''") + "'"


class UserManager:
    """systemd 254 `--user` manager in a private mount namespace and its own cgroup."""

    def __init__(self, workdir: pathlib.Path, sd_dir: str = DEFAULT_SD_DIR,
                 path: str | None = None, log_level: str = "info") -> None:
        self.workdir = pathlib.Path(workdir).resolve()
        self.sd_root = _sd_root(sd_dir)
        self.lib_path = _lib_path(self.sd_root)
        self.name = f"llmproxy-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.config_home = self.workdir / "config"
        self.unit_dir = self.config_home / "systemd" / "user"
        self.home = self.workdir / "home"
        self.log_path = self.workdir / "manager.log"
        self.path = path or os.pathsep.join(
            [str(pathlib.Path(sys.executable).parent),
             "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
        self.log_level = log_level
        self.runtime_dir = self.workdir / "run"
        self._own_runtime = False
        self.cgroups: list[pathlib.Path] = []
        self.popen: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self.seen_pids: set[int] = set()    # every pid seen in our cgroups
        self.killed_leftovers: set[int] = set()
        self.timings: dict[str, float] = {}
        self._stopped = False
        self._harness_units = self.workdir / "harness-units"
        self._console: tuple[int, int] | None = None     # pty (master, slave) fds
        self._console_reader: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        """Environment of systemctl and of the manager (which units inherit, minus the libs)."""
        return {
            "PATH": self.path,
            "HOME": str(self.home),
            "XDG_RUNTIME_DIR": str(self.runtime_dir),
            "XDG_CONFIG_HOME": str(self.config_home),
            "SYSTEMD_UNIT_PATH": os.pathsep.join(
                [str(self.unit_dir), str(self._harness_units),
                 f"{self.sd_root}/usr/lib/systemd/user"]),
            "SYSTEMD_GENERATOR_PATH": str(self.workdir / "no-generators"),
            "SYSTEMD_ENVIRONMENT_GENERATOR_PATH": str(self.workdir / "no-generators"),
            "LD_LIBRARY_PATH": self.lib_path,
            "LANG": "C.UTF-8",
            "SYSTEMD_COLORS": "0",
        }

    def start(self, timeout: float = 20) -> None:
        reason = available(str(self.sd_root.parent))
        if reason:
            raise RuntimeError(f"systemd harness unavailable: {reason}")
        if self.popen is not None:
            raise RuntimeError("already started")
        t0 = time.monotonic()
        for d in (self.unit_dir, self.home, self.workdir / "no-generators",
                  self._harness_units / "service.d"):
            d.mkdir(parents=True, exist_ok=True)
        # What the manager needs in its own environment is none of the units' business.
        (self._harness_units / "service.d" / "00-sdharness.conf").write_text(
            "[Service]\nUnsetEnvironment=" + " ".join(_MANAGER_ONLY_ENV) + "\n")
        if len(str(self.runtime_dir / "systemd" / "private")) > _SUN_PATH_MAX - 20:
            self.runtime_dir = pathlib.Path(tempfile.mkdtemp(prefix="llmproxy-sd-", dir="/tmp"))
            self._own_runtime = True
        self.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.runtime_dir.chmod(0o700)
        (self.config_home / "systemd" / "user.conf").write_text(
            "[Manager]\nDefaultTimeoutStartSec=15s\nDefaultTimeoutStopSec=5s\n")

        planned = _plan_cgroups(self.name)
        try:
            for _h, d in planned:
                d.mkdir()
                self.cgroups.append(d)
            # grep -x patterns for the /proc/self/cgroup lines the launcher must then show.
            tracking = [f"[0-9]*:{h.key}:{h.current.rstrip('/')}/{self.name}"
                        for h, _d in planned if h.key in _TRACKING]
            env = " ".join(f"{k}={_q(v)}" for k, v in self._env().items())
            env += f" SYSTEMD_LOG_TARGET=console SYSTEMD_LOG_LEVEL={_q(self.log_level)}"
            console = self._open_console()
            launcher = self.workdir / "launch-manager.sh"
            launcher.write_text(_LAUNCHER.format(
                cgroups=" ".join(_q(d) for d in self.cgroups),
                tracking=" ".join(_q(t) for t in tracking),
                console=_q(console), env=env, systemd=_q(self.sd_root / "lib/systemd/systemd")))
            launcher.chmod(0o755)
            with self.log_path.open("ab") as log:
                self.popen = subprocess.Popen(
                    ["unshare", "-m", "--propagation", "private", str(launcher)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
            self.pid = self.popen.pid
            self.seen_pids.add(self.pid)
            self._wait_ready(t0 + timeout)
            # The user manager replaces $PATH with its own default: give units ours.
            self.systemctl("set-environment", f"PATH={self.path}")
        except BaseException:
            self.stop()
            raise
        self.timings["start"] = time.monotonic() - t0

    def _open_console(self) -> str:
        """A pty whose output goes to manager.log; the launcher binds it over /dev/console.

        systemd --user logs to /dev/console (not stderr), which would be the machine's console.
        """
        master, slave = os.openpty()
        tty.setraw(slave)           # no \n -> \r\n translation
        self._console = (master, slave)
        path = os.ttyname(slave)

        def pump() -> None:
            with self.log_path.open("ab") as log:
                while True:
                    try:
                        chunk = os.read(master, 65536)
                    except OSError:     # EIO: every slave end is closed
                        return
                    if not chunk:
                        return
                    log.write(chunk)
                    log.flush()

        self._console_reader = threading.Thread(target=pump, name="sd-console", daemon=True)
        self._console_reader.start()
        return path

    def _close_console(self) -> None:
        if self._console is None:
            return
        master, slave = self._console
        self._console = None
        os.close(slave)
        if self._console_reader is not None:
            self._console_reader.join(timeout=2)
        os.close(master)

    def _wait_ready(self, deadline: float) -> None:
        """Until the manager answers on its private socket and has reached default.target."""
        assert self.popen is not None
        last = ""
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"user manager exited with {self.popen.returncode}:\n"
                                   + self.log_tail())
            if (self.runtime_dir / "systemd" / "private").exists():
                r = self.systemctl("show", "-p", "SystemState", "--value", check=False,
                                   timeout=5)
                last = r.stdout.strip() or r.stderr.strip()
                if r.returncode == 0 and last in ("running", "degraded"):
                    self._check_cgroup()
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"user manager not ready: {last}\n" + self.log_tail())
            time.sleep(0.02)

    def _check_cgroup(self) -> None:
        """The manager really runs in our cgroups: the safety property of the whole harness."""
        assert self.pid is not None
        procs = _procs(self.cgroups[0])
        if self.pid not in procs or not self.cgroups[0].is_relative_to(CGROUP_ROOT):
            raise RuntimeError(f"manager {self.pid} is not in {self.cgroups[0]}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # -- driving it -----------------------------------------------------------------------------

    def systemctl(self, *args: str, check: bool = True,
                  timeout: float = 30) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.sd_root / "bin/systemctl"), "--user", "--no-pager", *args]
        r = subprocess.run(cmd, check=False, env=self._env(), capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise SystemctlError(r.returncode, cmd, r.stdout, r.stderr)
        return r

    def show(self, unit: str, *props: str) -> dict[str, str]:
        args = ["show", unit]
        for p in props:
            args += ["-p", p]
        out: dict[str, str] = {}
        for line in self.systemctl(*args).stdout.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                out[key] = value
        return out

    def wait_for(self, unit: str, prop: str, value: str | Callable[[str], bool],
                 timeout: float = 15) -> str:
        """Wait until `prop` of `unit` equals `value` (or satisfies it); return the value."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.show(unit, prop).get(prop, "")
            if (value(got) if callable(value) else got == value):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{unit} {prop}={got!r}, waited {timeout}s for {value!r}")
            time.sleep(0.05)

    def pids(self) -> set[int]:
        """Every process now in the manager's cgroups (manager and units)."""
        pids: set[int] = set()
        for d in self.cgroups:
            pids |= _procs(d)
        self.seen_pids |= pids
        return pids

    # -- teardown -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every unit, exit the manager, kill leftovers, remove our cgroups; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        t0 = time.monotonic()
        try:
            self._stop_manager()
        finally:
            self._sweep()
            self._remove_cgroups()
            self._close_console()
            if self._own_runtime:
                shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self.timings["stop"] = time.monotonic() - t0
        left = [p for p in self.seen_pids if _alive(p) and self._ours(p)]
        assert not left, f"processes started by the harness still alive: {left}"
        assert not [d for d in self.cgroups if d.exists()], "cgroups left behind"

    def _ours(self, pid: int) -> bool:
        """Whether `pid` still sits in one of our cgroups (guards against pid reuse)."""
        try:
            text = pathlib.Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return False
        return f"/{self.name}" in text or pid == self.pid

    def _stop_manager(self) -> None:
        """Stop the units, kill their leftovers while the manager can still reap them, then
        make the manager exit (systemctl exit; then SIGTERM, SIGKILL by its pid)."""
        popen = self.popen
        if popen is None or popen.poll() is not None:
            return
        self.pids()
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            # Triggers first (they could start services again), then what they trigger.
            for types in ("socket,timer,path", "service,scope,mount,swap"):
                units = [line.split()[0] for line in self.systemctl(
                    "list-units", "--all", "--plain", "--no-legend", f"--type={types}",
                    check=False, timeout=10).stdout.splitlines() if line.split()]
                units = [u for u in units if u != "init.scope"]
                if units:
                    self.systemctl("stop", *units, check=False, timeout=30)
            # What a unit left behind (KillMode=process, ...): the manager, as subreaper, reaps.
            self._sweep(keep=popen.pid, timeout=3)
            # exit.target conflicts with every unit: systemd stops whatever is left and exits.
            self.systemctl("exit", check=False, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=15)
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if popen.poll() is not None:
                return
            os.kill(popen.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=wait)
                return

    def _sweep(self, keep: int | None = None, timeout: float = 5) -> None:
        """SIGKILL, by pid, whatever is left in our cgroups but `keep` (all of it was started by
        us) until they are empty."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.pids() - {keep}
            if keep is None and self.popen is not None and self.popen.poll() is None:
                left.add(self.popen.pid)
            if not left:
                break
            for pid in left:
                self.killed_leftovers.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if self.popen is not None and keep is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=0.1)
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)

    def _remove_cgroups(self, timeout: float = 5) -> None:
        """rmdir every cgroup below and including ours, deepest first (stop() checks it)."""
        deadline = time.monotonic() + timeout
        for top in self.cgroups:
            while True:
                busy = False
                for d in _subtree(top):
                    try:
                        d.rmdir()
                    except FileNotFoundError:
                        pass
                    except OSError:
                        busy = True
                if not busy or time.monotonic() > deadline:
                    break
                time.sleep(0.05)

    def __enter__(self) -> UserManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
