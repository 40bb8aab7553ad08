"""``llmproxy doctor -c hosts.json [HOST]``: checks each managed host from the proxy's machine,
as the proxy would reach it, and prints one table row per check with a fix for each failure.

Per host, in order: ssh (``ssh_command``, so BatchMode and its timeout, plus TIMEOUT here);
the host's python3 (3.9 or later); its agent, called as the proxy calls it, and its protocol;
per engine, the executable on the host's non-interactive PATH, its model files and their size
against the engine's ``memory_gb`` (and, for a kept prompt cache, whether the model needs
``--swa-full``), its port (free, or held by that engine), and its ``url``
reachable from here; nvidia-smi and the GPUs; the lease's holder. What cannot be checked after
a failure says so. Exit 0 when nothing failed, 1 when a check failed, 78 on a config error,
2 for a HOST that is not a managed host of the config. It never uses the reactor: every call
is a subprocess or a socket with a timeout.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmproxy.cli.proxyclient import Subparsers
from llmproxy.config import Config, ConfigError, HostConfig, load_config
from llmproxy.config.kvcache import needs_swa_full

EXIT_CONFIG = 78
TIMEOUT = 30.0           # seconds for one ssh call, on top of ssh's own ConnectTimeout
URL_TIMEOUT = 5.0        # seconds to connect to an engine's url from here
MIN_PYTHON = (3, 9)
LOOPBACK = ("127.", "::1", "::ffff:127.")
WILDCARD = ("0.0.0.0", "::")
GB = 1e9

Run = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class Row:
    """One check's result: ``status`` is ``ok``, ``warn``, ``FAIL`` or ``skip``."""

    host: str
    check: str
    status: str
    detail: str
    fix: str = ""


def probe_script(host: HostConfig) -> str:
    """The program sent to `host`'s python3: doctorprobe's source and the call."""
    source = (Path(__file__).parent / "doctorprobe.py").read_text()
    params = {"engines": {name: list(e.command) for name, e in host.engines.items()}}
    return f"{source}\nreport(json.loads({json.dumps(json.dumps(params))}))\n"


def _ssh(config: Config, host: HostConfig, remote: Sequence[str], stdin: str,
         run: Run) -> subprocess.CompletedProcess[str]:
    assert host.ssh is not None
    return run([*config.ssh_command, host.ssh, *remote], input=stdin, capture_output=True,
               text=True, timeout=TIMEOUT, check=False)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def _reachable(url: str, connect: Callable[..., socket.socket]) -> str | None:
    """None when a TCP connection to `url`'s address succeeds from here, else why not."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        connect((parts.hostname, port), timeout=URL_TIMEOUT).close()
    except OSError as e:
        return f"{parts.hostname}:{port}: {e.strerror or e}"
    return None


def _port(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def _facts(config: Config, host: HostConfig, row: Callable[..., None],
           run: Run) -> dict[str, Any] | None:
    """What the probe found on `host` (rows for ssh and python3), or None when it could not
    run: the later checks then cannot be made."""
    assert host.ssh is not None
    try:
        done = _ssh(config, host, ["python3", "-"], probe_script(host), run)
    except subprocess.TimeoutExpired:
        row("ssh", "FAIL", f"{host.ssh}: no answer within {TIMEOUT:g}s",
            f"check `ssh -o BatchMode=yes {host.ssh} true` from this machine")
        return None
    except OSError as e:
        row("ssh", "FAIL", f"cannot run {config.ssh_command[0]}: {e.strerror or e}",
            "install the ssh client or fix ssh_command")
        return None
    if done.returncode == 255:
        row("ssh", "FAIL", f"{host.ssh}: {_last_line(done.stderr)}",
            f"as this user, `ssh -o BatchMode=yes {host.ssh} true` must work without a "
            "prompt: the key in the host's authorized_keys, the host in known_hosts")
        return None
    row("ssh", "ok", f"{host.ssh} answers")
    if done.returncode == 127:
        row("python3", "FAIL", "python3 not found on the host's non-interactive PATH",
            "install python3 (3.9 or later) on the host")
        return None
    try:
        facts: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        version = tuple(int(p) for p in str(facts["python"]).split("."))
    except (ValueError, IndexError, KeyError, TypeError):
        row("python3", "FAIL", f"the probe failed: {_last_line(done.stderr or done.stdout)}",
            "python3 on the host must be 3.9 or later")
        return None
    if version < MIN_PYTHON:
        row("python3", "FAIL", f"python3 is {facts['python']}", "install python3 3.9 or later")
        return None
    row("python3", "ok", str(facts["python"]))
    return facts


def check_host(config: Config, host: HostConfig, *, run: Run = subprocess.run,
               connect: Callable[..., socket.socket] = socket.create_connection,
               agent: Callable[[Config, HostConfig], tuple[dict[str, Any] | None, str | None]]
               | None = None) -> list[Row]:
    """Every check of one managed host, in order."""
    rows: list[Row] = []

    def row(check: str, status: str, detail: str, fix: str = "") -> None:
        rows.append(Row(host.name, check, status, detail, fix))

    facts = _facts(config, host, row, run)
    if facts is None:
        return rows
    answer, agent_error = (agent or call_agent)(config, host)
    running: dict[str, dict[str, Any]] = {}
    if agent_error is not None:
        row("agent", "FAIL", agent_error, "see the agent's error; `llmproxy check` the config")
    else:
        assert answer is not None
        running = {str(e.get("engine")): e for e in answer.get("engines", [])
                   if isinstance(e, dict)}
        row("agent", "ok", f"protocol {answer.get('protocol')}, running: "
                           f"{', '.join(sorted(map(str, running))) or 'none'}")

    listening: list[dict[str, Any]] = facts.get("listening", [])
    for name, engine in host.engines.items():
        found = facts.get("engines", {}).get(name, {})
        _engine_rows(row, host, name, engine, found, listening, name in running, connect)

    smi = facts.get("nvidia_smi")
    if not smi:
        row("gpus", "warn", "nvidia-smi not found: no GPU figures in /status and /metrics",
            "install the NVIDIA driver's nvidia-smi on the host's PATH (none on a CPU host)")
    elif facts.get("gpu_error"):
        row("gpus", "FAIL", str(facts["gpu_error"]), "check the NVIDIA driver on the host")
    else:
        from llmproxy.agent.gpus import Problem, parse

        try:
            gpus = parse(str(facts.get("gpus") or ""))
        except Problem as e:
            row("gpus", "FAIL", str(e), "check the NVIDIA driver on the host")
        else:
            row("gpus", "ok" if gpus else "warn",
                "; ".join(_gpu_text(g) for g in gpus) or "nvidia-smi lists no GPU")

    if answer is not None:
        lease = answer.get("lease")
        row("lease", "ok", "free" if not lease else
            f"held by {lease.get('machine')} pid {lease.get('pid')} "
            f"(runtime_dir {lease.get('runtime_dir')})")
    return rows


def _gpu_text(gpu: dict[str, Any]) -> str:
    total, used = gpu.get("memory_total_bytes"), gpu.get("memory_used_bytes")
    memory = (f"{used / 2**30:.1f} of {total / 2**30:.1f} GiB used"
              if total is not None and used is not None else "memory unknown")
    return f"GPU {gpu.get('index')} {gpu.get('name')}: {memory}"


def _model_row(row: Callable[..., None], name: str, engine: Any,
               model: dict[str, Any]) -> None:
    size = model.get("bytes")
    if size is None:
        row(f"{name}: model", "FAIL", f"{model.get('path')} not found on the host",
            f"copy the model there or fix engines.{name}.command")
    elif engine.memory_gb is not None and size / GB > engine.memory_gb:
        row(f"{name}: model", "FAIL", f"{model.get('path')} is {size / GB:.1f} GB, more "
            f"than the engine's memory_gb {engine.memory_gb:g}",
            f"raise engines.{name}.memory_gb to what the engine really holds")
    else:
        row(f"{name}: model", "ok", f"{model.get('path')} ({size / GB:.2f} GB)")


def _kv_row(row: Callable[..., None], name: str, engine: Any) -> None:
    """A kept prompt cache of a sliding-window model pays off only with ``--swa-full``."""
    model = needs_swa_full(engine.command)
    if model is None:
        row(f"{name}: kv_cache", "ok", "keep: slots saved before a planned stop, restored "
            "at the next start")
    else:
        row(f"{name}: kv_cache", "warn", f"{model} uses sliding-window attention: without "
            "--swa-full llama-server does not reuse a restored cache",
            f"add --swa-full to engines.{name}.command (the cache then takes more memory)")


def _engine_rows(row: Callable[..., None], host: HostConfig, name: str, engine: Any,
                 found: dict[str, Any], listening: list[dict[str, Any]], running: bool,
                 connect: Callable[..., socket.socket]) -> None:
    program = engine.command[0]
    if found.get("executable"):
        row(f"{name}: executable", "ok", str(found["executable"]))
    else:
        row(f"{name}: executable", "FAIL", f"{program!r} not found on the host's "
            "non-interactive PATH", f"install it, or give its absolute path as "
            f"engines.{name}.command[0]")
    for model in found.get("models", []):
        _model_row(row, name, engine, model)
    if engine.kv_cache == "keep":
        _kv_row(row, name, engine)
    url = host.engine_url(name)
    port = _port(url)
    held = [s["address"] for s in listening if s.get("port") == port]
    if not held:
        row(f"{name}: port", "ok", f"{port} free (the engine starts on demand)")
    elif running:
        row(f"{name}: port", "ok", f"{port} held by {name}")
    else:
        row(f"{name}: port", "FAIL", f"{port} is held by a process that is not {name} "
            f"(listening on {', '.join(sorted(set(held)))})",
            f"stop that process, or give {name} another port (and url)")
    if not held:
        return
    why = _reachable(url, connect)
    if why is None:
        row(f"{name}: url", "ok", f"{url} reachable from here")
    elif all(a.startswith(LOOPBACK) for a in held):
        row(f"{name}: url", "FAIL", f"{url} unreachable from here ({why}); the engine listens "
            f"on {', '.join(sorted(set(held)))} only", "listening on 127.0.0.1 only? add "
            f"--host 0.0.0.0 to engines.{name}.command")
    else:
        row(f"{name}: url", "FAIL", f"{url} unreachable from here ({why})",
            "a firewall between here and the host? the url's address must be the host's")


def call_agent(config: Config, host: HostConfig) -> tuple[dict[str, Any] | None, str | None]:
    """The agent's answer to a status order, run as the proxy runs it, or why there is none:
    a host without an ``agent`` command gets the proxy's own agent first when it has none."""
    from llmproxy.agent.protocol import HOST_FIELD, OP_FIELD, PROTOCOL, STATUS
    from llmproxy.hosts.agentbundle import bundle
    from llmproxy.hosts.agentclient import answer_error, protocol_error

    # The host's own state (its engines and lease), as the proxy's orders name it.
    order = (json.dumps({OP_FIELD: STATUS, "protocol": PROTOCOL, HOST_FIELD: host.name})
             + "\n").encode()
    answer, why = _agent_answer(config, host, order)
    if answer is not None and answer.get("bundle_missing"):
        answer, why = _agent_answer(config, host, bundle().data, "install")
        if answer is not None and answer.get("ok") is True:
            answer, why = _agent_answer(config, host, order)
    if answer is None:
        return None, why
    error = protocol_error(host.name, answer) or answer_error(answer)
    return (None, error) if error else (answer, None)


def _agent_answer(config: Config, host: HostConfig, stdin: bytes,
                  *install: str) -> tuple[dict[str, Any] | None, str | None]:
    """One agent call over ssh: its last output line as a JSON object, or why there is none."""
    from llmproxy.hosts.agentclient import agent_argv

    argv = agent_argv(config.ssh_command, host, None, *install)
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, timeout=TIMEOUT,
                              check=False)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {TIMEOUT:g}s"
    except OSError as e:
        return None, f"cannot run {argv[0]}: {e.strerror or e}"
    try:
        answer = json.loads(done.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
        if not isinstance(answer, dict):
            raise ValueError(answer)
    except (ValueError, IndexError):
        agent = " ".join(host.agent) if host.agent else "the agent the proxy brings (python3)"
        return None, (f"`{agent}` gave no answer (exit {done.returncode}): "
                      f"{_last_line(done.stderr.decode('utf-8', 'replace'))}")
    return answer, None


def table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table, a fix under each failure."""
    lines = []
    width = max((len(r.check) for r in rows), default=0)
    hosts = max((len(r.host) for r in rows), default=0)
    for r in rows:
        lines.append(f"{r.host:<{hosts}}  {r.check:<{width}}  {r.status:<4}  {r.detail}")
        if r.fix and r.status in ("FAIL", "warn"):
            lines.append(f"{'':<{hosts}}  {'':<{width}}  {'':<4}  fix: {r.fix}")
    return "\n".join(lines)


def _doctor(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as e:
        for error in e.errors:
            print(error, file=sys.stderr)
        return EXIT_CONFIG
    managed = [h for h in config.hosts if h.managed and h.ssh]
    if args.host is not None:
        managed = [h for h in managed if h.name == args.host]
        if not managed:
            names = ", ".join(h.name for h in config.hosts if h.managed) or "none"
            print(f"llmproxy doctor: {args.host!r} is not a managed host of {args.config} "
                  f"(managed hosts: {names})", file=sys.stderr)
            return 2
    rows = [r for h in managed for r in check_host(config, h)]
    print(table(rows) if rows else f"{args.config}: no managed host to check")
    failed = sum(r.status == "FAIL" for r in rows)
    print(f"llmproxy doctor: {failed} check(s) failed" if failed else "llmproxy doctor: ok")
    return 1 if failed else 0


def add(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check each managed host from this machine, with a fix per failure",
        description="Check each managed host of the config (or HOST) as the proxy reaches it: "
                    "ssh, python3, the agent and its protocol, each engine's executable, model "
                    "files, port and url, nvidia-smi, the lease. Exit 0 when every check "
                    "passed, 1 when one failed, 78 on a config error, 2 for an unknown HOST.")
    parser.add_argument("host", nargs="?", help="one managed host (default: every one)")
    parser.add_argument("-c", "--config", required=True, metavar="PATH", help="the config file")
    parser.set_defaults(run=_doctor)
