"""llmproxy-agent watch (issue 36, the agent's side): engines run under a reaper that records
how they end; a watch reports an end nobody asked for (kill -9 of the engine or of its reaper,
an exit status) within its interval and never an agent's own stop; health changes; GPU
figures from nvidia-smi; ticks; and it never holds the lock the other orders take."""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from llmproxy.agent import exits, gpus, state
from llmproxy.agent.protocol import PACE
from llmproxy.testing.nvidiasmi import GPU, FakeNvidiaSmi
from tests import procs
from tests.agentrun import STUBBORN, Agent, Stream, alive, gone, order, sim_command, start_order
from tests.procs import free_port

pytestmark = pytest.mark.integration

# An engine that is healthy at once, logs 30 lines, and exits 3 once its trigger file exists.
CRASHER = """
import os, sys, threading, time
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a):
        pass
server = HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
threading.Thread(target=server.serve_forever, daemon=True).start()
for i in range(30):
    print(f"loading layer {i}", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.02)
print("CUDA error: out of memory", flush=True)
sys.exit(3)
"""
FAST = {"interval": 0.1, "health_seconds": 0.2, "tick_seconds": 0.3}



def watch(run: Agent, streams: list[Stream], env: dict[str, str] | None = None,
          **fields: Any) -> Stream:
    """A watch on ``run``'s state directory, its hello read."""
    s = Stream(run.state_dir, order("watch", **{**FAST, **fields}), env=env)
    streams.append(s)
    s.expect("hello")
    return s


def started(run: Agent, engine: str, command: list[str], port: int,
            **fields: Any) -> dict[str, Any]:
    answer = run(start_order(engine, command, port, **fields))
    assert answer["ok"] is True, answer
    return answer


def no_engine_left(run: Agent, engine: str) -> None:
    """status lists no engine, and neither its record nor its exit record is left."""
    assert run(order("status"))["engines"] == []
    assert state.load(run.state_dir, engine) is None
    assert not exits.exit_path(run.state_dir, engine).exists()


def test_kill_9_of_an_engine_is_reported_with_signal_9(run: Agent,
                                                       streams: list[Stream]) -> None:
    """The engine's own process killed with SIGKILL: one exit event within 1 s naming the
    group leader (pid) and the engine (engine_pid), signal 9, no status; its record is gone
    and its reaper too."""
    port = free_port()
    a = started(run, "a", sim_command(port), port)
    assert a["engine_pid"] != a["pid"] and alive(a["engine_pid"])
    w = watch(run, streams)
    [hello] = w.of("hello")
    assert hello["protocol"] == 4
    assert [(e["engine"], e["pid"], e["engine_pid"], e["healthy"]) for e in hello["engines"]] \
        == [("a", a["pid"], a["engine_pid"], True)]
    w.expect("health", engine="a", healthy=True)
    t0 = time.monotonic()
    os.kill(a["engine_pid"], signal.SIGKILL)
    ended = w.expect("exit", timeout=1.0)
    assert time.monotonic() - t0 < 1.0
    assert {k: ended[k] for k in ("engine", "pid", "engine_pid", "exit_status", "signal")} == {
        "engine": "a", "pid": a["pid"], "engine_pid": a["engine_pid"], "exit_status": None,
        "signal": 9}
    assert abs(ended["at"] - time.time()) < 5 and isinstance(ended["log_tail"], list)
    assert gone(a["pid"], 2)
    no_engine_left(run, "a")
    time.sleep(0.5)
    assert len(w.of("exit")) == 1  # reported once


def test_an_exit_status_is_reported_with_the_last_log_lines(run: Agent, tmp_path: Path,
                                                            streams: list[Stream]) -> None:
    """An engine that exits 3: exit_status 3, no signal, and its last 20 log lines, its own
    last words and the reaper's line saying how it ended among them."""
    port, trigger = free_port(), tmp_path / "crash-now"
    a = started(run, "a", [sys.executable, "-c", CRASHER, str(port), str(trigger)], port)
    w = watch(run, streams)
    trigger.touch()
    ended = w.expect("exit", timeout=3.0)
    assert (ended["engine"], ended["exit_status"], ended["signal"]) == ("a", 3, None)
    assert ended["engine_pid"] == a["engine_pid"]
    tail = ended["log_tail"]
    assert len(tail) == 20
    assert tail[-3:-1] == ["loading layer 29", "CUDA error: out of memory"]
    assert tail[-1].endswith(f"the engine (pid {a['engine_pid']}) exited with status 3")
    no_engine_left(run, "a")


def test_a_killed_reaper_is_an_exit_that_knows_nothing(run: Agent,
                                                       streams: list[Stream]) -> None:
    """kill -9 of the group's leader (the reaper): an exit with null status and signal, and
    the engine it left behind is killed (nothing could report its end any more)."""
    port = free_port()
    a = started(run, "a", sim_command(port), port)
    w = watch(run, streams)
    os.kill(a["pid"], signal.SIGKILL)
    ended = w.expect("exit", timeout=1.0)
    assert (ended["engine"], ended["pid"], ended["engine_pid"]) == ("a", a["pid"],
                                                                    a["engine_pid"])
    assert ended["exit_status"] is None and ended["signal"] is None
    assert gone(a["engine_pid"], 2)
    no_engine_left(run, "a")


def test_the_agents_own_stops_are_never_reported(run: Agent, streams: list[Stream]) -> None:
    """A stop (graceful, or SIGKILL after the grace), a start that fails (the command exits at
    once), one that times out, and a restart with another command: no exit event at all,
    while the watch goes on ticking."""
    pa, pb, pc = free_port(), free_port(), free_port()
    started(run, "a", sim_command(pa), pa)
    started(run, "b", [sys.executable, "-c", STUBBORN, str(pb)], pb)
    w = watch(run, streams)
    assert run(order("stop", engine="a"))["stopped"][0]["killed"] is False
    assert run(order("stop", engine="b", grace=0.3))["stopped"][0]["killed"] is True
    failed = run(start_order("c", [sys.executable, "-c", "import sys; sys.exit(1)"], pc))
    assert failed["ok"] is False and "status 1" in failed["error"]
    slow = run(start_order("c", ["sleep", "30"], pc, timeout=0.5))
    assert slow["ok"] is False and "not healthy" in slow["error"]
    first = started(run, "c", sim_command(pc), pc)
    again = started(run, "c", sim_command(pc, "m2"), pc)
    assert again["stopped"] == [{"engine": "c", "pid": first["pid"], "killed": False}]
    ticks = len(w.of("tick"))
    time.sleep(1.0)
    assert w.of("exit") == []
    assert len(w.of("tick")) > ticks
    assert not list((run.state_dir / state.ENGINES).glob("*.exit"))


def test_an_exit_while_no_watch_listened_is_reported_once(run: Agent,
                                                          streams: list[Stream]) -> None:
    """An engine that died while no watch ran, its record buried by a status meanwhile: the
    next watch reports its exit (signal 9, from the reaper's record) at once; a watch after
    that does not report it again."""
    port = free_port()
    a = started(run, "a", sim_command(port), port)
    os.kill(a["engine_pid"], signal.SIGKILL)
    assert gone(a["pid"], 2)
    assert run(order("status"))["engines"] == []
    first = watch(run, streams)
    assert first.of("hello")[0]["engines"] == []
    ended = first.expect("exit", timeout=1.0)
    assert (ended["engine"], ended["pid"], ended["signal"]) == ("a", a["pid"], 9)
    assert first.close() == 0
    second = watch(run, streams)
    second.expect("tick", timeout=2.0)
    assert second.of("exit") == []


def test_health_changes_are_reported(run: Agent, tmp_path: Path,
                                     streams: list[Stream]) -> None:
    """One health event per engine at the start, then one each time its health check changes:
    503, back to 200, and a health URL that never answers (2 s timeout)."""
    port, control = free_port(), tmp_path / "health"
    a = started(run, "a", [*sim_command(port), "--health-file", str(control)], port)
    w = watch(run, streams)
    assert w.expect("health")["healthy"] is True
    control.write_text("503")
    assert w.expect("health", timeout=2.0) == {**w.of("health")[-1], "engine": "a",
                                                "pid": a["pid"], "healthy": False}
    control.unlink()
    w.expect("health", timeout=2.0, healthy=True)
    control.write_text("hang")
    w.expect("health", timeout=4.0, healthy=False)
    assert [e["healthy"] for e in w.of("health")] == [True, False, True, False]
    assert w.of("exit") == []


def test_a_new_engine_gets_its_first_health_event(run: Agent, streams: list[Stream]) -> None:
    """An engine started while watching (the watch holds no lock: the start runs meanwhile)
    gets a health event of its own."""
    w = watch(run, streams)
    port = free_port()
    a = started(run, "late", sim_command(port), port)
    assert w.expect("health", timeout=2.0)["pid"] == a["pid"]


def test_the_watch_holds_no_lock(run: Agent, streams: list[Stream]) -> None:
    """While a watch runs, the lock is free (a status answers at once); and while another call
    holds the lock (a start waiting for health), the watch still reports an exit within 1 s."""
    port = free_port()
    a = started(run, "a", sim_command(port), port)
    w = watch(run, streams)
    fd = os.open(run.state_dir / "agent.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: the watch does not hold it
        os.kill(a["engine_pid"], signal.SIGKILL)
        assert w.expect("exit", timeout=1.0)["signal"] == 9
    finally:
        os.close(fd)
    t0 = time.monotonic()
    assert run(order("status"))["engines"] == []
    assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("how", ["stdin", "SIGTERM", "SIGHUP"])
def test_the_watch_ends_when_its_caller_goes(run: Agent, streams: list[Stream],
                                             how: str) -> None:
    """Closing stdin (the proxy's stop, ssh gone), SIGTERM or SIGHUP: the watch exits 0 within
    a second, having written nothing but events."""
    w = watch(run, streams, interval=0.5)
    t0 = time.monotonic()
    if how == "stdin":
        assert w.close(2.0) == 0
    else:
        w.popen.send_signal(getattr(signal, how))
        assert w.wait_done(2.0) == 0
    assert time.monotonic() - t0 < 1.0
    assert all("event" in e for e in w.events)
    assert w.popen.stderr is not None and w.popen.stderr.read() == ""


# -- GPUs --------------------------------------------------------------------------------------


def test_gpu_events_from_nvidia_smi(run: Agent, tmp_path: Path, streams: list[Stream]) -> None:
    """Where nvidia-smi is on PATH: gpu events every telemetry_seconds with MiB in bytes,
    percent as a ratio and [N/A] as null; a broken answer and a failing nvidia-smi give one
    warning each, however often they recur, and the watch goes on."""
    smi = FakeNvidiaSmi(tmp_path / "bin")
    smi.gpus([GPU(), GPU(index=1, name="NVIDIA A100-SXM4-80GB", memory_used_mib="81000",
                         memory_total_mib="81920", utilization_percent="100",
                         temperature="71", power_watts="[N/A]")])
    w = watch(run, streams, env=smi.path_env(procs.env()), telemetry_seconds=0.5)
    first = w.expect("gpu", timeout=3.0)
    assert first["gpus"] == [
        {"index": 0, "name": "NVIDIA GeForce RTX 4090", "memory_used_bytes": 1024 * 2**20,
         "memory_total_bytes": 24564 * 2**20, "utilization_ratio": 0.37,
         "temperature_celsius": 45.0, "power_watts": 123.45},
        {"index": 1, "name": "NVIDIA A100-SXM4-80GB", "memory_used_bytes": 81000 * 2**20,
         "memory_total_bytes": 81920 * 2**20, "utilization_ratio": 1.0,
         "temperature_celsius": 71.0, "power_watts": None}]
    assert smi.calls[0] == " ".join(gpus.QUERY)
    smi.prints("this is not CSV\n")
    w.expect("warning", timeout=3.0)
    smi.fails("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")
    failing = w.expect("warning", timeout=3.0)
    assert "exited with status 9" in failing["message"] and "NVIDIA driver" in failing["message"]
    calls = len(smi.calls)
    time.sleep(1.2)
    assert len(smi.calls) >= calls + 2 and len(w.of("warning")) == 2  # once per problem
    smi.gpus([GPU(temperature="50")])
    assert w.expect("gpu", timeout=3.0)["gpus"][0]["temperature_celsius"] == 50.0


def test_a_busy_host_is_sampled_each_second(run: Agent, tmp_path: Path,
                                            streams: list[Stream]) -> None:
    """The proxy's pace message: while busy the GPUs are sampled each
    BUSY_TELEMETRY_SECONDS (the first sample at once), not each telemetry_seconds; back
    to idle, the slow pace again; the per-process memory is not asked each second. A line
    that is not a pace message changes nothing."""
    smi = FakeNvidiaSmi(tmp_path / "bin")
    w = watch(run, streams, env=smi.path_env(procs.env()), telemetry_seconds=60)
    w.expect("gpu", timeout=3.0)
    w.send({"op": "something else", "busy": True})
    time.sleep(1.5)
    assert len(w.of("gpu")) == 1
    apps = smi.calls.count(" ".join(gpus.APPS_QUERY))
    w.send({"op": PACE, "busy": True})
    began = time.monotonic()
    w.expect("gpu", timeout=2.0)
    w.expect("gpu", timeout=2.0)
    w.expect("gpu", timeout=2.0)
    assert time.monotonic() - began < 4.5    # three samples, not one a minute
    # the memory is measured when the pace woke the loop, not with every fast sample
    assert smi.calls.count(" ".join(gpus.APPS_QUERY)) - apps == 1
    w.send({"op": PACE, "busy": False})
    time.sleep(1.0)
    slow = len(w.of("gpu"))                  # at most the sample the change woke
    time.sleep(2.5)
    assert len(w.of("gpu")) == slow


def test_no_nvidia_smi_no_gpu_events(run: Agent, streams: list[Stream]) -> None:
    """Without nvidia-smi on PATH: no gpu event and no warning, only the ticks."""
    env = procs.env()
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d and not (Path(d) / "nvidia-smi").exists())
    w = watch(run, streams, env=env, telemetry_seconds=0.5)
    time.sleep(1.2)
    assert len(w.of("tick")) >= 3
    assert w.of("gpu") == [] and w.of("warning") == []


def test_a_broken_per_process_answer_is_one_warning(run: Agent, tmp_path: Path,
                                                    streams: list[Stream]) -> None:
    """nvidia-smi's GPU rows fine, its per-process answer garbage: gpu events go on, one
    warning names the per-process answer, however often it recurs."""
    smi = FakeNvidiaSmi(tmp_path / "bin")
    smi.apps_text("garbage\n")
    w = watch(run, streams, env=smi.path_env(procs.env()), telemetry_seconds=0.5)
    warned = w.expect("warning", timeout=3.0)
    assert "expected a pid and its used memory" in warned["message"]
    assert " ".join(gpus.APPS_QUERY) in smi.calls
    calls = len(smi.calls)
    time.sleep(1.2)
    assert len(smi.calls) >= calls + 2 and len(w.of("warning")) == 1
    assert w.of("gpu")
