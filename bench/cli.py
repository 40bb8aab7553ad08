"""`python -m bench` (`bin/bench`, `make bench`): one run, every target side by side.

Starts the bench engine, llmproxy (twistd, from this checkout) in both its modes (with
its speedups, and `llmproxy-reference` on the reference path alone; bench/proxies.py)
and nginx (when installed) on 127.0.0.1, runs each phase against each target in turn,
prints the table and both sets of budgets, writes the JSON, stops everything it started
by pid. Exit status: 0 when every budget passes (skipped ones aside), 1 when one of
either set fails, 2 when the run itself failed (a llmproxy target whose /status says it
runs another mode than the one asked for, too).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import budgets, report, steal
from bench.passes import pooled, turns
from bench.proxies import (
    CAPTURE,
    PROXY,
    REFERENCE,
    SPEEDUP_NAME,
    mode_of,
    speedups_off_notes,
    start_llmproxy,
    without_targets,
)
from bench.scenarios import INTERLEAVED, PER_TARGET, PHASES, Plan
from bench.targets import (
    HOST,
    ROOT,
    Process,
    StartError,
    Target,
    nginx_binary,
    nofile_limit,
    raise_nofile,
    start_engine,
    start_floor,
    start_nginx,
)

TARGETS = ("direct", PROXY, REFERENCE, PROXY + CAPTURE, REFERENCE + CAPTURE, "twisted",
           "nginx")
# `twisted` (bench/floor.py, the least a relay on Twisted's reactor costs) only when
# asked for: every target more in the rotation leaves the others colder caches
# between their requests, so the default compares exactly these four (llmproxy in
# both its modes, each with its own budgets).
DEFAULT_TARGETS = ("direct", PROXY, REFERENCE, "nginx")
SETTLE_SECONDS = 0.3   # after each target's turn: its sockets close, the processes settle


def _list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in allowed]
    if unknown or not items:
        raise argparse.ArgumentTypeError(
            f"{what}: {', '.join(unknown) or 'none given'}; choose from {', '.join(allowed)}")
    return [t for t in allowed if t in items]


def _speedups(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not SPEEDUP_NAME.fullmatch(n)]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"not a speedup name: {', '.join(repr(n) for n in bad) or 'none given'}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bin/bench",
        description="Measure llmproxy, with its speedups and on its reference path "
                    "(LLMPROXY_SPEEDUPS=0), against a direct connection and nginx, and "
                    "check both modes' budgets.")
    parser.add_argument("--quick", action="store_true",
                        help="a short smoke run (fewer requests and shorter streams; "
                             "figures are rough)")
    parser.add_argument("--targets", default=None,
                        type=lambda t: _list(t, TARGETS, "unknown target"),
                        help="comma-separated, from " + ",".join(TARGETS) + " (default: "
                             + ",".join(DEFAULT_TARGETS) + "; nginx only when installed; "
                             "llmproxy-reference is llmproxy started with "
                             "LLMPROXY_SPEEDUPS=0, the reference path alone; twisted is "
                             "the Twisted floor, bench/floor.py)")
    parser.add_argument("--without", default=[], action="extend", type=_speedups,
                        metavar="SPEEDUP[,SPEEDUP]",
                        help="one more target per speedup named, llmproxy-without-SPEEDUP: "
                             "llmproxy with its speedups on but that one, started with "
                             "LLMPROXY_SPEEDUPS_OFF=SPEEDUP (an environment variable that "
                             "turns off the named speedups, comma-separated, and leaves the "
                             "others on); its column beside llmproxy's shows that speedup's "
                             "gain. Names as llmproxy's /status lists them (speedups.active "
                             "and .off); no budgets. May be given more than once")
    parser.add_argument("--capture", action="store_true",
                        help="start every llmproxy target with capture on (a \"capture\": "
                             "{} block, its defaults), budgets and all; the targets "
                             "llmproxy-capture and llmproxy-reference-capture measure it "
                             "beside capture off in one run instead")
    parser.add_argument("--phases", default=list(PHASES),
                        type=lambda t: _list(t, PHASES, "unknown phase"),
                        help=f"comma-separated, from {','.join(PHASES)} (default: all)")
    parser.add_argument("--json", default="bench-results.json", metavar="PATH",
                        help="where to write the results (default: %(default)s; '-' for none)")
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the configs and logs of the run's processes")
    parser.add_argument("--no-fail", action="store_true",
                        help="exit 0 even when a budget fails (still printed and in the JSON)")
    return parser.parse_args(argv)


def _note(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _llmproxy_version() -> str | None:
    try:
        text = (ROOT / "llmproxy" / "__init__.py").read_text()
    except OSError:
        return None
    m = re.search(r'__version__ = "([^"]+)"', text)
    return m.group(1) if m else None


def _os_name() -> str:
    try:
        return "Debian " + Path("/etc/debian_version").read_text().strip()
    except OSError:
        return platform.platform()


def meta(targets: dict[str, Target], quick: bool) -> dict[str, Any]:
    return {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "cores": os.cpu_count(),
        "os": _os_name(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        # Which build: the same version runs the proxy a tenth faster or slower
        # depending on how it was compiled (docs/performance.md).
        "python_executable": os.path.realpath(sys.executable),
        "llmproxy": _llmproxy_version(),
        "commit": _git_commit(),
        "nginx": targets["nginx"].extra.get("version") if "nginx" in targets else None,
        # Each llmproxy target's mode, as its /status said at start (bench/proxies.py).
        "speedups": {n: t.speedups for n, t in targets.items() if mode_of(n) is not None},
        "nofile": nofile_limit(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "loopback_send_recv_us": round(loopback_cost_us(), 1),
    }


def loopback_cost_us(rounds: int = 4000) -> float:
    """Microseconds for one 200-byte send and its recv over loopback TCP, from Python: the
    kernel's share of relaying one event, to compare machines (a VM's syscalls can cost
    several times a bare machine's)."""
    with socket.create_server((HOST, 0)) as server, \
            socket.create_connection(server.getsockname()) as a:
        b, _ = server.accept()
        with b:
            payload = b"x" * 200
            t0 = time.perf_counter()
            for _ in range(rounds):
                a.sendall(payload)
                b.recv(4096)
            return (time.perf_counter() - t0) / rounds * 1e6


async def run(phases: list[str], targets: dict[str, Target], plan: Plan,
              processes: list[Process]) -> dict[str, dict[str, Any]]:
    """Every phase for every target (the cpu phase four times, see passes.py);
    results[target][phase]."""
    results: dict[str, dict[str, Any]] = {name: {} for name in targets}
    for phase in phases:
        t0 = time.monotonic()
        if phase in INTERLEAVED:
            before = steal.sample()
            measured = await INTERLEAVED[phase](list(targets.values()), plan)
            stolen = steal.stolen_pct(before, steal.sample())
            for name, figures in measured.items():
                figures["steal_pct"] = stolen
                results[name][phase] = figures
                _note(f"{phase:10} {name:18} {time.monotonic() - t0:5.1f}s  "
                      f"{_brief(figures)}")
            _check_alive(processes, phase)
        else:
            done: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
            for name in turns(phase, list(targets), plan.cpu_rounds):
                t0 = time.monotonic()
                before = steal.sample()
                figures = await PER_TARGET[phase](targets[name], plan)
                figures["steal_pct"] = steal.stolen_pct(before, steal.sample())
                done[name].append(figures)
                _note(f"{phase:10} {name:18} {time.monotonic() - t0:5.1f}s  "
                      f"{_brief(figures)}")
                _check_alive(processes, phase)
                await asyncio.sleep(SETTLE_SECONDS)
            for name, passes in done.items():
                results[name][phase] = passes[0] if len(passes) == 1 else pooled(passes)
    return results


def _check_alive(processes: list[Process], phase: str) -> None:
    for proc in processes:
        if not proc.alive():
            raise StartError(f"{proc.name} exited (status {proc.popen.returncode}) during "
                             f"the {phase} phase; its output:\n{proc.output()}")


def _brief(figures: dict[str, Any]) -> str:
    keys = ("p50_ms", "p99_ms", "events_per_s", "lag_p50_ms", "lag_p99_ms", "cpu_ms_per_1k",
            "completed", "peak_rss_mib", "errors", "incomplete", "steal_pct")
    return " ".join(f"{k}={figures[k]}" for k in keys if figures.get(k) not in (None, 0))


def start_targets(wanted: list[str], workdir: Path, nginx: str | None,
                  processes: list[Process], capture: bool = False) -> dict[str, Target]:
    """The engine and every wanted target (`capture`: each llmproxy with capture on);
    each process is appended to `processes` as soon as it runs, so the caller stops
    it whatever fails next."""
    engine, engine_port = start_engine(workdir)
    processes.append(engine)
    targets: dict[str, Target] = {}
    for name in wanted:
        if name == "direct":
            target = Target("direct", engine_port)
        elif (mode := mode_of(name)) is not None:
            target = start_llmproxy(workdir, engine_port, name, replace(mode, capture=True)) \
                if capture else start_llmproxy(workdir, engine_port, name)
            for line in speedups_off_notes(target):
                _note(line)
        elif name == "twisted":
            target = start_floor(workdir, engine_port)
        else:
            assert nginx is not None
            target = start_nginx(workdir, engine_port, nginx)
        if target.process is not None:
            processes.append(target.process)
        target.engine = engine
        targets[name] = target
    _note(f"engine on port {engine_port}; "
          + ", ".join(f"{n} on port {t.port}" for n, t in targets.items())
          + f"; work directory {workdir}")
    return targets


def ordered(wanted: list[str], without: list[str]) -> list[str]:
    """The targets in their columns' order, each `--without` one (once) after the
    llmproxy targets: llmproxy's figures beside those of its modes."""
    extra = [t for t in dict.fromkeys(without_targets(without)) if t not in wanted]
    at = max((i + 1 for i, t in enumerate(wanted) if t in (PROXY, REFERENCE)), default=1)
    at = min(at, len(wanted))
    return wanted[:at] + extra + wanted[at:]


def wanted_targets(args: argparse.Namespace, nginx: str | None) -> list[str] | None:
    """The targets to measure (None: an explicitly asked one cannot be)."""
    wanted = ordered(list(args.targets or DEFAULT_TARGETS), args.without)
    if "nginx" in wanted and nginx is None:
        if args.targets:
            _note("nginx is not installed (bin/install-bench-deps installs it)")
            return None
        _note("nginx is not installed: measuring without it; the CPU budgets are skipped "
              "(bin/install-bench-deps installs it)")
        wanted.remove("nginx")
    return wanted


def publish(args: argparse.Namespace, info: dict[str, Any], plan: Plan, targets: list[str],
            results: dict[str, dict[str, Any]]) -> int:
    """Print the table and the budgets, write the JSON; the exit status."""
    checks = budgets.evaluate(results)
    failed = budgets.failed(checks)
    title = (f"llmproxy bench: {info['cores']} cores, {info['os']}, Python {info['python']} "
             f"({info['python_executable']})"
             + (f", nginx {info['nginx']}" if info["nginx"] else "")
             + (" (--quick: rough figures)" if args.quick else ""))
    print(title)
    if info.get("speedups"):
        print(report.modes(info["speedups"]))
    print()
    print(report.table(results, targets, asdict(plan)))
    print()
    print("budgets (figures of this run):")
    print(report.budget_sections(checks))
    print()
    print(f"{len(failed)} budget(s) failed" if failed else "all budgets met")
    if args.json != "-":
        doc = {
            "meta": info,
            "plan": asdict(plan),
            "targets": targets,
            "phases": args.phases,
            "results": results,
            "added": report.added_figures(results),
            "budgets": [c.as_dict() for c in checks],
            "failed": [c.key for c in failed],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 1 if failed and not args.no_fail else 0


def _exit_on(signum: int, frame: object) -> None:
    # Stopped from outside (timeout(1), a CI job cancelled): exit through the
    # finally below, which stops the processes the run started.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on)
    signal.signal(signal.SIGHUP, _exit_on)
    plan = Plan.quick() if args.quick else Plan()
    raise_nofile()
    nginx = nginx_binary()
    wanted = wanted_targets(args, nginx)
    if wanted is None:
        return 2
    needed = 3 * plan.rss_streams + 64
    if "rss" in args.phases and nofile_limit() < needed:
        _note(f"warning: the open-file limit is {nofile_limit()}, the rss phase needs about "
              f"{needed}")
    workdir = Path(tempfile.mkdtemp(prefix="llmproxy-bench-"))
    processes: list[Process] = []
    keep = args.keep_workdir
    try:
        targets = start_targets(wanted, workdir, nginx, processes, args.capture)
        info = meta(targets, args.quick)
        info["capture"] = args.capture or sorted(n for n in targets if n.endswith(CAPTURE))
        results = asyncio.run(run(args.phases, targets, plan, processes))
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except StartError as e:
        keep = True
        _note(f"error: {e}")
        _note(f"logs kept in {workdir}")
        return 2
    finally:
        for proc in reversed(processes):
            proc.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return publish(args, info, plan, list(targets), results)
