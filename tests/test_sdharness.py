"""The systemd test harness is real: a systemd >= 254 user manager that socket-activates a
`Type=notify-reload` service, reloads it and stops it, and leaves nothing behind.

Skipped when the harness cannot run here (not root, systemd 254 not fetched with
bin/fetch-systemd254, ...), unless LLMPROXY_REQUIRE_SYSTEMD is set (CI sets it to 1): then an
unavailable harness fails every test instead.
"""

from __future__ import annotations

import os
import pathlib
import socket
import stat
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from tests import needs
from tests.procs import free_port
from tests.sdharness import CGROUP_ROOT, UserManager, available, cgroup_layout

REASON = available()
needs.module("systemd", REASON)

pytestmark = pytest.mark.integration

# A socket-activated Type=notify-reload service: READY=1 at start; on SIGHUP RELOADING=1 with
# MONOTONIC_USEC, then READY=1 with STATUS=reloaded-N; one line per connection on fd 3.
SERVICE = textwrap.dedent("""\
    import os
    import signal
    import socket
    import time

    assert os.environ["LISTEN_PID"] == str(os.getpid()), os.environ.get("LISTEN_PID")
    assert os.environ["LISTEN_FDS"] == "1", os.environ.get("LISTEN_FDS")
    listener = socket.socket(fileno=3)
    reloads = 0


    def notify(*fields):
        addr = os.environ["NOTIFY_SOCKET"]
        if addr.startswith("@"):
            addr = "\\0" + addr[1:]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall("\\n".join(fields).encode())


    def on_hup(signum, frame):
        global reloads
        reloads += 1
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        notify("RELOADING=1", f"MONOTONIC_USEC={usec}")
        print(f"reload {reloads}", flush=True)
        notify("READY=1", f"STATUS=reloaded-{reloads}")


    signal.signal(signal.SIGHUP, on_hup)
    print(f"started pid={os.getpid()} fdnames={os.environ.get('LISTEN_FDNAMES')}", flush=True)
    notify("READY=1", "STATUS=serving")
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(f"hello pid={os.getpid()} reloads={reloads}\\n".encode())
    """)


def ask(port: int, timeout: float = 10) -> str:
    """Connect to 127.0.0.1:port and read the one line the service answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.decode()


def alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def cgroups_named(name: str) -> list[str]:
    """Every cgroup directory, in any mounted hierarchy, whose path contains `name`."""
    found = []
    for top, dirs, _files in os.walk(CGROUP_ROOT):
        found += [os.path.join(top, d) for d in dirs if name in d]
    return found


@pytest.fixture
def manager(tmp_path: pathlib.Path) -> Iterator[UserManager]:
    needs.need("systemd", REASON)
    m = UserManager(tmp_path / "sd")
    m.start()
    try:
        yield m
    finally:
        m.stop()


def test_socket_activated_notify_reload_service(manager: UserManager,
                                                tmp_path: pathlib.Path) -> None:
    """Proves the manager is a real systemd >= 254 driving a real unit: the first connection
    to a .socket unit starts its Type=notify-reload service (active, a MainPID inside the
    harness's own cgroup, the listening socket passed as fd 3), `systemctl --user reload`
    goes through SIGHUP -> RELOADING=1 -> READY=1 and returns 0 with StatusText=reloaded-1
    and the same MainPID, and `systemctl --user stop` stops the service and closes the port."""
    port = free_port()
    script = tmp_path / "demo_service.py"
    script.write_text(SERVICE)
    log = tmp_path / "demo.log"
    (manager.unit_dir / "demo.socket").write_text(textwrap.dedent(f"""\
        [Socket]
        ListenStream=127.0.0.1:{port}
        FileDescriptorName=http
        """))
    (manager.unit_dir / "demo.service").write_text(textwrap.dedent(f"""\
        [Unit]
        Requires=demo.socket
        After=demo.socket

        [Service]
        Type=notify-reload
        ExecStart={sys.executable} {script}
        StandardOutput=append:{log}
        StandardError=inherit
        TimeoutStartSec=10
        """))
    manager.systemctl("daemon-reload")
    manager.systemctl("start", "demo.socket")
    assert manager.show("demo.socket", "ActiveState") == {"ActiveState": "active"}
    assert manager.show("demo.service", "ActiveState") == {"ActiveState": "inactive"}

    first = ask(port)
    manager.wait_for("demo.service", "ActiveState", "active")
    props = manager.show("demo.service", "MainPID", "Type", "StatusText", "SubState")
    pid = int(props["MainPID"])
    assert pid != 0, props
    assert props["Type"] == "notify-reload", props    # systemd 252 would fall back to simple
    assert props["StatusText"] == "serving", props
    assert first == f"hello pid={pid} reloads=0\n"
    assert manager.name in pathlib.Path(f"/proc/{pid}/cgroup").read_text()

    t0 = time.monotonic()
    r = manager.systemctl("reload", "demo.service", check=False, timeout=10)
    reload_s = time.monotonic() - t0
    assert r.returncode == 0, (r.stdout, r.stderr, manager.log_tail())
    assert manager.wait_for("demo.service", "StatusText", "reloaded-1", timeout=5)
    after = manager.show("demo.service", "MainPID", "ActiveState")
    assert after == {"MainPID": str(pid), "ActiveState": "active"}
    assert ask(port) == f"hello pid={pid} reloads=1\n"
    assert reload_s < 5

    manager.systemctl("stop", "demo.service", "demo.socket")
    assert manager.show("demo.service", "ActiveState", "MainPID") == {
        "ActiveState": "inactive", "MainPID": "0"}
    assert manager.show("demo.socket", "ActiveState") == {"ActiveState": "inactive"}
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid)
    with pytest.raises(ConnectionRefusedError):
        ask(port, timeout=2)
    assert log.read_text().splitlines() == [f"started pid={pid} fdnames=http", "reload 1"]


def test_stop_leaves_no_process_and_no_cgroup(tmp_path: pathlib.Path) -> None:
    """Proves the harness is contained and cleans up: the manager runs in a cgroup of its own
    (PID 1's and the test runner's cgroups are untouched) and a mount namespace of its own
    (its /run/systemd tmpfs is invisible here), and after stop() no process it started is left
    (not even a unit's stray child that systemd itself leaves behind with KillMode=process) and
    no cgroup it or systemd created exists in any hierarchy."""
    needs.need("systemd", REASON)
    pid1_before = pathlib.Path("/proc/1/cgroup").read_text()
    self_before = pathlib.Path("/proc/self/cgroup").read_text()
    run_systemd_before = sorted(os.listdir("/run/systemd"))
    m = UserManager(tmp_path / "sd")
    m.start()
    try:
        stray = tmp_path / "stray.pid"
        (m.unit_dir / "stray.service").write_text(textwrap.dedent(f"""\
            [Service]
            Type=oneshot
            RemainAfterExit=yes
            KillMode=process
            ExecStart=/bin/sh -c 'sleep 300 & echo $! > {stray}'
            """))
        m.systemctl("daemon-reload")
        m.systemctl("start", "stray.service")
        stray_pid = int(stray.read_text())
        assert alive(stray_pid)
        started = m.pids()
        assert {m.pid, stray_pid} <= started
        assert m.name in pathlib.Path(f"/proc/{m.pid}/cgroup").read_text()
        assert cgroups_named(m.name), "the harness made no cgroup of its own"
        assert pathlib.Path("/proc/1/cgroup").read_text() == pid1_before
        assert pathlib.Path("/proc/self/cgroup").read_text() == self_before
        assert "llmproxy-test" not in pathlib.Path("/proc/self/mountinfo").read_text()
        assert sorted(os.listdir("/run/systemd")) == run_systemd_before
        assert stat.S_ISCHR(os.stat("/dev/console").st_mode)
    finally:
        m.stop()
    assert not [p for p in started if alive(p)]
    assert stray_pid in m.killed_leftovers
    assert cgroups_named(m.name) == []
    assert pathlib.Path("/proc/1/cgroup").read_text() == pid1_before
    assert pathlib.Path("/proc/self/cgroup").read_text() == self_before
    assert cgroup_layout() in ("unified", "hybrid", "legacy")
