"""A simulated GPU host's power state, for the sleep and wake tests (tests/gpuhost.py's
namespace). Run in the host's namespace, on the host's own Python (stdlib only):

- ``wakehost.py listen --mac MAC --port 9 --log FILE --pidfile FILE --sshd SSHD --config
  FILE``: the host's Wake-on-LAN. Bound to 0.0.0.0:PORT with SO_BROADCAST, it reads
  datagrams; one that is the magic packet of MAC (6 bytes 0xff, then the MAC 16 times) while
  sshd is down starts sshd again (``SSHD -D -e -f FILE``) and logs ``woken``; any other
  datagram logs ``ignored``.
- ``wakehost.py sleep --pidfile FILE``: the host's suspend. It stops sshd (the pid in
  FILE) and every process descended from it (the ssh sessions, the agent's watch among
  them), as a suspend cuts them: the host is unreachable until woken.

`Machine` is the test's side: it starts the listener in the namespace and reads its log.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def magic(mac: str) -> bytes:
    return b"\xff" * 6 + bytes.fromhex(mac.replace(":", "").replace("-", "")) * 16


def _parent(pid: int) -> int | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return None
    return int(data[data.rindex(")") + 2:].split()[1])


def _descendants(root: int) -> list[int]:
    parents = {int(e): _parent(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid]
        found += kids
        frontier += kids
    return found


def _mine() -> set[int]:
    """This process and its ancestors: never signalled."""
    out, pid = set(), os.getpid()
    while pid and pid not in out:
        out.add(pid)
        pid = _parent(pid) or 0
    return out


def sleep(pidfile: Path) -> int:
    try:
        sshd = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 1
    spared = _mine()
    for pid in [*_descendants(sshd), sshd]:
        if pid not in spared:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return 0


def _alive(pid: int) -> bool:
    """The process runs (a zombie does not)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return False
    return data[data.rindex(")") + 2:].split()[0] not in ("Z", "X")


def _running(proc: subprocess.Popen[bytes] | None, pidfile: Path | None) -> bool:
    if proc is not None and proc.poll() is None:
        return True
    if pidfile is not None:
        try:
            return _alive(int(pidfile.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            return False
    return False


def listen(mac: str, port: int, log: Path, pidfile: Path | None, argv: list[str]) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    sock.bind(("0.0.0.0", port))
    wanted = magic(mac)
    proc: subprocess.Popen[bytes] | None = None
    with open(log, "a", buffering=1) as out:
        out.write("listening\n")
        while True:
            data, sender = sock.recvfrom(2048)
            if data != wanted:
                out.write(f"ignored {len(data)} bytes from {sender[0]}\n")
                continue
            if _running(proc, pidfile):
                out.write(f"magic from {sender[0]}: awake already\n")
                continue
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            out.write(f"woken by {sender[0]}: sshd {proc.pid}\n")


class Machine:
    """The test's side of a simulated host's power state (see the module docstring)."""

    def __init__(self, host: Any, workdir: Path, port: int = 9) -> None:
        self.host = host
        self.log = workdir / "wakehost.log"
        self.log.write_text("")
        self.port = port
        iface = f"lpx{host.subnet}i"
        self.mac = host.exec("cat", f"/sys/class/net/{iface}/address").stdout.strip()
        self.broadcast = f"10.231.{host.subnet}.255"
        self.popen: subprocess.Popen[bytes] | None = None

    def sleep_command(self) -> list[str]:
        """The host config's sleep.command: this script's sleep, on the host's python3."""
        return ["python3", str(HERE), "sleep", "--pidfile", str(self.host.pidfile)]

    def start(self) -> None:
        sshd = next(a for a in self.host.popen.args if a.endswith("sshd"))
        self.popen = subprocess.Popen(
            [*self.host.prefix, sys.executable, str(HERE), "listen", "--mac", self.mac,
             "--port", str(self.port), "--log", str(self.log), "--pidfile",
             str(self.host.pidfile), "--sshd", sshd, "--config", str(self.host.config)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(self.log.with_suffix(".err"), "wb"))  # noqa: SIM115
        deadline = time.monotonic() + 10
        while "listening" not in self.text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "listening" in self.text(), \
            f"the wake listener did not start: {self.log.with_suffix('.err').read_text()}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def sshd_up(self) -> bool:
        return _running(None, self.host.pidfile)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("op", choices=("listen", "sleep"))
    parser.add_argument("--mac")
    parser.add_argument("--port", type=int, default=9)
    parser.add_argument("--log", type=Path)
    parser.add_argument("--pidfile", type=Path)
    parser.add_argument("--sshd")
    parser.add_argument("--config")
    args = parser.parse_args(argv)
    if args.op == "sleep":
        return sleep(args.pidfile)
    return listen(args.mac, args.port, args.log, args.pidfile,
                  [args.sshd, "-D", "-e", "-f", args.config])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
