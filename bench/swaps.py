"""Swaps against a trace (`make bench-swaps`): one fixed, seeded trace of
requests for three engines over two managed hosts, replayed through the real
proxy (twistd llmproxy) twice: `schedule: "arrival"` and `"batch"`.

The fleet: gpu1 has a memory budget (`memory_gb` 24) and runs engines a and
b; gpu2 runs one engine at a time, b or c; each engine declares `memory_gb`
16, so each host holds one at a time. Model ma runs on gpu1, mc on gpu2 and
mb on either: the proxy places b (hosts/siting.py) where it is resident, else
where it fits, else where requests already wait for it, else where eviction
costs least, else where it waits for room, and evicts through gpu1's budget. The hosts are real
agents over a real sshd on 127.0.0.1 (tests/sshd.py), each with a fake
nvidia-smi first on its PATH (llmproxy/testing/nvidiasmi.py) that reports
each engine's process at its own size (MEASURED_MIB), so placements after the
first start use measured memory. Each engine is llmproxy-simengine behind a
start delay of 3-10 s (with the agent's start and health check a load takes
5-13 s here, within the issue's 5-20 s of a GPU's load); each request is
0.3-1 s of service.

Reported per run: swaps (every engine start the proxy logs, the first start
of each engine included) and their load seconds (the "ready in" figures); each
request's wait (its latency less its service time: p50, p95, max; a request
that failed, listed in errors, counts with the time it waited until then: the
client waits as long as the proxy's queue may hold it); and the
passes (from the proxy's own queue.wait, request.start and engine.switch
events on /api/events): each request served while an earlier one for another
engine waited in its host's queue, and the longest that waiter had waited
because of the batch by then (since its arrival, or since the host's last
switch was done if later), which `max_wait_seconds` bounds in `batch`.
Prints one table and writes bench-swaps.json (with each request served: its
send time, model, wait and host, to find which requests make the p95) and
each run's proxy log, bench-swaps-<schedule>.log."""

from __future__ import annotations

import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llmproxy.config import HostConfig  # noqa: E402
from llmproxy.testing.nvidiasmi import FakeNvidiaSmi  # noqa: E402
from tests import sshd as sshd_harness  # noqa: E402
from tests.managed import managed_config, sim_command  # noqa: E402
from tests.procs import Proxy, free_port  # noqa: E402
from tests.test_integration_observe import Events  # noqa: E402

# host -> its engines (start delay, s) and extra settings; gpu2 runs one engine at a time
HOSTS: dict[str, tuple[dict[str, float], dict[str, Any]]] = {
    "gpu1": ({"a": 3.0, "b": 10.0}, {"memory_gb": 24}),
    "gpu2": ({"b": 10.0, "c": 6.0}, {}),
}
MODELS = {"ma": ["gpu1"], "mb": ["gpu1", "gpu2"], "mc": ["gpu2"]}   # the hosts each may use
MEASURED_MIB = {"a": 14 * 1024, "b": 15 * 1024, "c": 15 * 1024}   # what nvidia-smi says
DECLARED_GB = 16
POPULARITY = {"ma": 0.4, "mb": 0.3, "mc": 0.3}
TOKEN_DELAY = 0.08                   # s per token: a request of 4-12 tokens takes 0.3-1 s
SLOTS = 2                            # max_concurrent of each host
QUEUE_TIMEOUT = 120                  # s: each host's queue_timeout_seconds


def trace(seed: int = 47, n: int = 200) -> list[tuple[float, str, int]]:
    """(send time, model, tokens): busy periods of 100 requests arriving at random
    (exponential gaps, 4 a second on average: a team's chats and agents at work),
    each for a model drawn by POPULARITY (mixed traffic: a, c, a, b, ...), with 5 s
    of quiet between periods."""
    rng = random.Random(seed)
    models, weights = list(POPULARITY), list(POPULARITY.values())
    out: list[tuple[float, str, int]] = []
    t = 0.0
    while len(out) < n:
        for _ in range(100):
            out.append((round(t, 3), rng.choices(models, weights)[0], rng.randint(4, 12)))
            t += rng.expovariate(4.0)
        t += 5.0
    return out[:n]


def config(sshd: Any, tmp: Path, schedule: str, max_wait: float) -> dict[str, Any]:
    hosts = []
    for name, (delays, extra) in HOSTS.items():
        smi = FakeNvidiaSmi(tmp / f"smi-{name}")
        apps = smi.directory / "apps"
        engines = {}
        budgeted = "memory_gb" in extra
        host_port = free_port()
        for e, delay in delays.items():
            port = free_port() if budgeted else host_port
            # The engine's pid (the shell's, kept by exec) and size go to nvidia-smi's
            # per-process answer as the engine starts.
            wrap = (f'sleep {delay}; echo "$$, {MEASURED_MIB[e]}" >> {apps}; exec "$@"')
            engines[e] = {"command": ["sh", "-c", wrap, "sh", *sim_command(port, "m" + e)],
                          "start_timeout_seconds": 30}
            if budgeted:    # resident side by side: each on its own port, its size declared
                engines[e].update(url=f"http://127.0.0.1:{port}", memory_gb=DECLARED_GB)
        path = f"{smi.directory}{os.pathsep}/usr/local/bin:/usr/bin:/bin"
        hosts.append({"name": name, "url": f"http://127.0.0.1:{host_port}", "ssh": sshd.target,
                      "agent": ["env", f"PATH={path}", f"PYTHONPATH={ROOT}", sys.executable,
                                "-m", "llmproxy.agent", "--state-dir", str(tmp / f"agent-{name}")],
                      "engines": engines, "max_concurrent": SLOTS, "min_engine_seconds": 0,
                      "queue_timeout_seconds": QUEUE_TIMEOUT, "schedule": schedule,
                      "max_wait_seconds": max_wait, **extra})
    models = {m: {"hosts": hosts, "engine": m[1:]} for m, hosts in MODELS.items()}
    return managed_config(sshd, tmp, hosts, models)


def post(port: int, model: str, tokens: int) -> http.client.HTTPResponse:
    """One request of the trace; the client waits as long as the proxy's queue may
    hold it (a non-streamed request hears nothing while it waits)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=QUEUE_TIMEOUT + 30)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": model}),
                 {"X-Sim-Tokens": str(tokens), "X-Sim-Delay": str(TOKEN_DELAY)})
    return conn.getresponse()


def received(events: Events) -> list[dict[str, Any]]:
    """Every event the run's /api/events reader received, once it is closed."""
    events.close()
    return [m["data"] for m in events.messages]


def passed_for(events: list[dict[str, Any]]) -> list[float]:
    """For each request served while an earlier one for another engine waited in
    its host's queue (it passed that waiter): how long that waiter had waited
    because of the running engine's batch by then (since its arrival, or since
    the host's last switch was done if later; hosts/batching.py's `batch_wait`)."""
    arrived: dict[str, float] = {}
    queued: dict[str, tuple[str, str]] = {}             # request id -> (host, engine)
    done: dict[str, float] = {}                         # host -> its last switch done
    out = []
    for ev in events:
        kind, rid = ev.get("type"), ev.get("request_id") or ""
        if kind == "queue.wait" and rid:
            arrived[rid], queued[rid] = ev["time"], (ev["host"], ev["engine"])
        elif kind in ("queue.leave", "queue.reject"):
            queued.pop(rid, None)
        elif kind == "engine.switch" and ev.get("stage") == "done":
            done[ev["host"]] = ev["time"]
        elif kind == "request.start" and ev.get("engine"):
            queued.pop(rid, None)
            mine = arrived.get(rid, ev["time"])
            out += [ev["time"] - max(arrived[w], done.get(host, 0.0))
                    for w, (host, engine) in queued.items()
                    if host == ev["host"] and engine != ev["engine"] and arrived[w] < mine]
    return out


def replay(sshd: Any, tmp: Path, schedule: str, requests: list[tuple[float, str, int]],
           max_wait: float) -> dict[str, Any]:
    """One run of the trace; the proxy's swaps and the requests' waits."""
    tmp.mkdir(parents=True)
    proxy = Proxy(config(sshd, tmp, schedule, max_wait), tmp)
    events = Events(proxy.port)
    waits: list[float] = []
    served: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        t0 = time.monotonic()

        def one(at: float, model: str, tokens: int) -> None:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            start = time.monotonic()
            rec: dict[str, Any] = {"at": at, "model": model, "id": None}
            try:
                resp = post(proxy.port, model, tokens)
                resp.read()
                rec["id"] = resp.getheader("X-Request-Id")
                if resp.status != 200:
                    errors.append(f"{model}: {resp.status}")
            except OSError as e:
                errors.append(f"{model}: {e}")
            # A request that failed counts too, with the time it waited until then.
            rec["wait"] = round(max(0.0, time.monotonic() - start - tokens * TOKEN_DELAY), 3)
            waits.append(rec["wait"])
            served.append(rec)

        threads = [threading.Thread(target=one, args=r) for r in requests]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        seen = received(events)
        out = proxy.output()
    finally:
        proxy.stop()
        for name in HOSTS:
            sshd.run("env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "llmproxy.agent",
                     "--state-dir", str(tmp / f"agent-{name}"), "stop", "--host", name,
                     input="")
    loads = [float(line.rsplit("ready in ", 1)[1].rstrip("s"))
             for line in out.splitlines() if " ready in " in line and "] engine " in line]
    passed = passed_for(seen)
    hosts = {ev.get("request_id"): ev.get("host") for ev in seen
             if ev.get("type") == "request.start"}
    for r in served:
        r["host"] = hosts.get(r.pop("id"))
    Path(f"bench-swaps-{schedule}.log").write_text(out)
    return {"schedule": schedule, "swaps": len(loads), "load_seconds": round(sum(loads), 2),
            **stats(waits), "passes": len(passed),
            "max_batch_wait": round(max(passed, default=0.0), 3),
            "max_wait_seconds": max_wait, "errors": errors,
            "measured": sum("holds" in line and "GiB of GPU memory" in line
                            for line in out.splitlines()),
            "requests_served": sorted(served, key=lambda r: r["at"])}


def stats(waits: list[float]) -> dict[str, float]:
    w = sorted(waits) or [0.0]
    return {"requests": len(waits), "p50": round(statistics.median(w), 3),
            "p95": round(w[min(len(w) - 1, int(0.95 * len(w)))], 3), "max": round(w[-1], 3)}


DEFAULT_MAX_WAIT = HostConfig.max_wait_seconds     # the config's default (30 s)


def main(n: int = 200, max_wait: float = DEFAULT_MAX_WAIT,
         schedules: tuple[str, ...] = ("arrival", "batch")) -> list[dict[str, Any]]:
    requests = trace(n=n)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "sshd").mkdir()
        with sshd_harness.SSHD(Path(d) / "sshd") as sshd:
            results = [replay(sshd, Path(d) / s, s, requests, max_wait) for s in schedules]
    return results


if __name__ == "__main__":
    # bench/swaps.py [N [SCHEDULE ...]]: the first N requests of the trace, those schedules;
    # MAX_WAIT=S in the environment: another max_wait_seconds.
    res = main(int(sys.argv[1]) if len(sys.argv) > 1 else 200,
               max_wait=float(os.environ.get("MAX_WAIT", DEFAULT_MAX_WAIT)),
               schedules=tuple(sys.argv[2:]) or ("arrival", "batch"))
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"{'schedule':10} {'swaps':>6} {'load s':>7} {'p50':>7} {'p95':>7} {'max':>7} "
          f"{'passes':>7} {'batch w':>7}  errors")
    for r in res:
        print(f"{r['schedule']:10} {r['swaps']:>6} {r['load_seconds']:>7} {r['p50']:>7} "
              f"{r['p95']:>7} {r['max']:>7} {r['passes']:>7} {r['max_batch_wait']:>7}  "
              f"{len(r['errors'])}")
    print("max_wait_seconds:", res[0]["max_wait_seconds"], " load average:", " ".join(load))
    Path("bench-swaps.json").write_text(json.dumps({"results": res, "loadavg": load}, indent=2))
