"""Running llmproxy-agent for its tests: as a real program on a state directory, or
in-process; simulated engines for it to start; and process checks read from /proc
independently of the agent's own."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from llmproxy.agent import main as agent
from llmproxy.agent.protocol import decode
from tests import procs
from tests.managed import sim_command  # noqa: F401 (the agent tests take it from here)

PROTOCOL = 4

# An engine that serves GET /health -> 200 at once, like the simulated one, but
# ignores SIGTERM (so a stop needs its grace, then SIGKILL).
STUBBORN = """
import signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
signal.signal(signal.SIGTERM, signal.SIG_IGN)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def order(op: str, **fields: Any) -> dict[str, Any]:
    """An order as the proxy sends it: with the protocol."""
    return {"protocol": PROTOCOL, "op": op, **fields}


def start_order(engine: str, command: list[str], port: int, timeout: float = 20,
                **fields: Any) -> dict[str, Any]:
    return order("start", engine=engine, command=command,
                 health_url=f"http://127.0.0.1:{port}/health", timeout=timeout, **fields)


def alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie has exited), read from /proc independently."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return data[data.rindex(")") + 2] not in "ZX"


def gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def group_members(pgid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            data = Path(f"/proc/{name}/stat").read_text()
            fields = data[data.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                pids.append(int(name))
    return pids


def running(answer: dict[str, Any]) -> dict[str, int]:
    """{engine: pid} of a status answer."""
    return {e["engine"]: e["pid"] for e in answer["engines"]}


class Agent:
    """Runs llmproxy-agent as a subprocess on one state directory; kills what is left after."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.pids: list[int] = []

    def popen(self, order: dict[str, Any] | str | None, *argv: str) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-m", "llmproxy.agent", "--state-dir",
                              str(self.state_dir), *argv], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=procs.env())
        assert p.stdin is not None
        p.stdin.write(order if isinstance(order, str) else "" if order is None else
                      json.dumps(order))
        p.stdin.close()
        return p

    def answer(self, p: subprocess.Popen[str]) -> tuple[int, dict[str, Any]]:
        assert p.stdout is not None
        out = p.stdout.read()
        status = p.wait(60)
        assert out.count("\n") == 1, out
        result: dict[str, Any] = json.loads(out)
        assert result["protocol"] == PROTOCOL, result
        if isinstance(result.get("pid"), int):
            self.pids.append(result["pid"])
        return status, result

    def __call__(self, order: dict[str, Any] | None, *argv: str) -> dict[str, Any]:
        status, result = self.answer(self.popen(order, *argv))
        assert status == 0, result
        return result

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            agent.main(["--state-dir", str(self.state_dir), "stop"],
                       io.StringIO(json.dumps(order("stop", grace=0))), io.StringIO())
        for pid in self.pids:
            if alive(pid) and os.getsid(pid) == pid:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


def call(state_dir: Path, given: Any, *argv: str) -> tuple[int, dict[str, Any]]:
    """Run main() in-process with ``given`` (a JSON value or raw text) on stdin."""
    out = io.StringIO()
    text = given if isinstance(given, str) else json.dumps(given)
    status = agent.main(["--state-dir", str(state_dir), *argv], io.StringIO(text), out)
    assert out.getvalue().count("\n") == 1
    answer: dict[str, Any] = json.loads(out.getvalue())
    assert answer["protocol"] == PROTOCOL, answer
    return status, answer


class Stream:
    """A watch or log call of the real agent: its stdin held open (as over ssh), its events
    read as they come. `expect` waits for the next event of a kind, in order; `close` ends
    the call by closing stdin."""

    def __init__(self, state_dir: Path, given: dict[str, Any] | None, *argv: str,
                 env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "llmproxy.agent", "--state-dir", str(state_dir), *argv],
            stdin=subprocess.PIPE if given is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=procs.env() if env is None else env)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._cursor = 0
        self._done = False
        if given is not None:
            assert self.popen.stdin is not None
            self.popen.stdin.write(json.dumps(given) + "\n")
            self.popen.stdin.flush()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._cond:
            return [json.loads(line) for line in self.lines]

    def of(self, kind: str) -> list[dict[str, Any]]:
        """Every event of ``kind`` so far."""
        return [e for e in self.events if e.get("event") == kind]

    def expect(self, kind: str, timeout: float = 10.0, **fields: Any) -> dict[str, Any]:
        """The next event (after the last one expected) of ``kind`` with ``fields``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i in range(self._cursor, len(self.lines)):
                    event = json.loads(self.lines[i])
                    if event.get("event") == kind and all(
                            event.get(k) == v for k, v in fields.items()):
                        self._cursor = i + 1
                        decode(event)      # what the agent writes, the proxy reads
                        return event
                left = deadline - time.monotonic()
                assert left > 0 and not self._done, (
                    f"no {kind} event {fields} within {timeout} s; got {self.lines}")
                self._cond.wait(left)

    def wait_done(self, timeout: float = 10.0) -> int:
        """The exit status, once the call ended and its output was read."""
        status = self.popen.wait(timeout)
        with self._cond:
            self._cond.wait_for(lambda: self._done, timeout)
        return status

    def send(self, message: dict[str, Any]) -> None:
        """Write one JSON line on the call's stdin, as the proxy does after the order."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(message) + "\n")
        self.popen.stdin.flush()

    def close(self, timeout: float = 5.0) -> int:
        """Close stdin (the proxy leaving); the exit status."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.close()
        return self.wait_done(timeout)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

