"""Swaps against a trace (`make bench-swaps`): one fixed, seeded trace of
requests for four engines over two managed hosts (a and b on gpu1, c and d on
gpu2, one engine at a time each, one slot each), replayed through the real
proxy (twistd llmproxy) twice: `schedule: "arrival"` and `"batch"`. The hosts
are real agents over a real sshd on 127.0.0.1 (tests/sshd.py); each engine is
llmproxy-simengine behind a start delay (time scaled down: 0.5-2 s where a GPU
takes 5-20 s). Swaps and their load time are counted from the proxy's own
`engine.switch` log lines (those of the first start of each engine
included); a request's wait is its latency less its service
time. Prints one table and writes bench-swaps.json."""

from __future__ import annotations

import json
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

from tests import sshd as sshd_harness  # noqa: E402
from tests.managed import managed_config, managed_host, sim_command  # noqa: E402
from tests.procs import Proxy, free_port  # noqa: E402
from tests.test_integration_engines import post  # noqa: E402

ENGINES = {"gpu1": {"a": 0.5, "b": 2.0}, "gpu2": {"c": 1.0, "d": 1.5}}   # start delay, s
TOKENS, TOKEN_DELAY = 4, 0.05        # each request: 0.2 s of service


def trace(seed: int = 47, n: int = 80) -> list[tuple[float, str]]:
    """(send time, model): bursts of 20 requests 0.1-0.3 s apart, each for a model
    drawn at random (mixed traffic: a, c, b, a, d, ...), with 1 s between bursts."""
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    t = 0.0
    while len(out) < n:
        for _ in range(20):
            out.append((round(t, 3), "m" + rng.choice("abcd")))
            t += rng.uniform(0.1, 0.3)
        t += 1.0
    return out[:n]


def config(sshd: Any, tmp: Path, schedule: str, max_wait: float) -> dict[str, Any]:
    hosts, models = [], {}
    for name, engines in ENGINES.items():
        port = free_port()
        spec = {e: {"command": ["sh", "-c", f'sleep {delay}; exec "$@"', "sh",
                                *sim_command(port, "m" + e)],
                    "start_timeout_seconds": 30} for e, delay in engines.items()}
        hosts.append(managed_host(sshd, tmp, port, spec, name=name, max_concurrent=1,
                                  min_engine_seconds=0, queue_timeout_seconds=120,
                                  schedule=schedule, max_wait_seconds=max_wait))
        models.update({"m" + e: {"host": name, "engine": e} for e in engines})
    for host in hosts:      # one agent state folder per host
        host["agent"] = [*host["agent"][:-1], str(tmp / f"agent-{host['name']}")]
    return managed_config(sshd, tmp, hosts, models)


def replay(sshd: Any, tmp: Path, schedule: str, requests: list[tuple[float, str]],
           max_wait: float) -> dict[str, Any]:
    """One run of the trace; the proxy's swaps and the requests' waits."""
    tmp.mkdir(parents=True)
    proxy = Proxy(config(sshd, tmp, schedule, max_wait), tmp)
    waits: list[float] = []
    errors: list[str] = []
    service = TOKENS * TOKEN_DELAY
    headers = {"X-Sim-Tokens": str(TOKENS), "X-Sim-Delay": str(TOKEN_DELAY)}
    try:
        t0 = time.monotonic()

        def one(at: float, model: str) -> None:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            start = time.monotonic()
            try:
                resp = post(proxy.port, model, **headers)
                resp.read()
                if resp.status != 200:
                    errors.append(f"{model}: {resp.status}")
                waits.append(max(0.0, time.monotonic() - start - service))
            except OSError as e:
                errors.append(f"{model}: {e}")

        threads = [threading.Thread(target=one, args=r) for r in requests]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        out = proxy.output()
    finally:
        proxy.stop()
        for name in ENGINES:
            sshd.run("env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "llmproxy.agent",
                     "--state-dir", str(tmp / f"agent-{name}"), "stop", "--host", name,
                     input="")
    loads = [float(line.rsplit("ready in ", 1)[1].rstrip("s"))
             for line in out.splitlines() if " ready in " in line and "] engine " in line]
    return {"schedule": schedule, "swaps": len(loads), "load_seconds": round(sum(loads), 2),
            **stats(waits), "errors": errors}


def stats(waits: list[float]) -> dict[str, float]:
    w = sorted(waits) or [0.0]
    return {"requests": len(waits), "p50": round(statistics.median(w), 3),
            "p95": round(w[min(len(w) - 1, int(0.95 * len(w)))], 3), "max": round(w[-1], 3)}


def main(n: int = 80, max_wait: float = 6.0) -> list[dict[str, Any]]:
    requests = trace(n=n)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "sshd").mkdir()
        with sshd_harness.SSHD(Path(d) / "sshd") as sshd:
            results = [replay(sshd, Path(d) / s, s, requests, max_wait)
                       for s in ("arrival", "batch")]
    return results


if __name__ == "__main__":
    res = main()
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"{'schedule':10} {'swaps':>6} {'load s':>7} {'p50':>7} {'p95':>7} {'max':>7}  errors")
    for r in res:
        print(f"{r['schedule']:10} {r['swaps']:>6} {r['load_seconds']:>7} {r['p50']:>7} "
              f"{r['p95']:>7} {r['max']:>7}  {len(r['errors'])}")
    print("load average:", " ".join(load))
    Path("bench-swaps.json").write_text(json.dumps({"results": res, "loadavg": load}, indent=2))
