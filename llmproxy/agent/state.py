"""What the agent keeps between calls: the state directory, one JSON record per engine in
``engines/<name>.json`` (and its exit record ``engines/<name>.exit``, see `exits`), each
engine's log ``engine-<name>.log``, the host's lock, and the migration of an older agent's
single ``engine.json``.

Each host the proxy names (an order's ``host``, protocol 4) has a directory of its own,
``<state_dir>/hosts/<host>`` (`host_dir`): everything above lives there, so hosts sharing an
ssh target share nothing. An order naming no host (a person's, without ``--host``) uses
``<state_dir>`` itself. A protocol 3 agent kept its engines in ``<state_dir>/engines``: the
first host to ask after the upgrade takes over those records (`take_shared`), so an engine
an older agent started is never orphaned (with one host per target, as protocol 3 needed,
that is its host).

A record holds ``engine``, ``pid`` (the leader of the engine's session, hence its process
group: the reaper), ``engine_pid`` (the engine's own process), ``starttime`` (the leader's
start time, so a reused pid is never taken for it), ``command`` (as configured), ``health_url``,
``started_at`` and ``state``: ``starting`` until its start saw it healthy, ``running``, or
``stopping`` once a stop is under way (a record without one, an older agent's, is running).
Writes are atomic (a temporary file renamed over the old one); a record that cannot be read,
or that names pid 0 or 1, is removed, never acted on.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from llmproxy.agent.processes import ours, terminate

Record = dict[str, Any]

LEGACY = "engine.json"  # protocol 1's one record, read once and moved into ENGINES
ENGINES = "engines"
HOSTS = "hosts"  # one directory per host named by the proxy (protocol 4)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
LEGACY_GRACE = 2.0  # grace for an older agent's engine that duplicates a recorded one
STARTING, RUNNING, STOPPING = "starting", "running", "stopping"


def state_dir(option: str | None, environ: Mapping[str, str] = os.environ) -> Path:
    """The state directory: ``--state-dir``, ``$LLMPROXY_AGENT_DIR``, the runtime dir, ~/.cache."""
    if option:
        return Path(option)
    if environ.get("LLMPROXY_AGENT_DIR"):
        return Path(environ["LLMPROXY_AGENT_DIR"])
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "llmproxy-agent"
    return Path.home() / ".cache" / "llmproxy-agent"


def host_dir(sd: Path, host: str | None) -> Path:
    """The state directory of ``host`` (a name matching NAME) under ``sd``; ``sd`` itself
    for None."""
    return sd if host is None else sd / HOSTS / host


def take_shared(sd: Path, hd: Path) -> None:
    """Move the engine records, exit records and logs a protocol 3 agent kept in ``sd``
    into the host directory ``hd`` (each file by one rename: of hosts asking at once, one
    gets it); a name ``hd`` already holds stays where it is."""
    if hd == sd or not (sd / ENGINES).is_dir():
        return
    (hd / ENGINES).mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in sorted((sd / ENGINES).iterdir()):
        if path.name.startswith(".") or path.suffix not in (".json", ".exit"):
            continue
        moves = [(path, hd / ENGINES / path.name)]
        if path.suffix == ".json":
            engine = path.name[:-len(".json")]
            moves.append((log_path(sd, engine), log_path(hd, engine)))
        for old, new in moves:
            if not new.exists():
                with contextlib.suppress(FileNotFoundError):
                    os.rename(old, new)


def record_path(sd: Path, engine: str) -> Path:
    """Where the record of ``engine`` lives (``engine`` matches NAME)."""
    return sd / ENGINES / f"{engine}.json"


def log_path(sd: Path, engine: str) -> Path:
    """Where the output of ``engine`` is appended."""
    return sd / f"engine-{engine}.log"


def state_of(record: Record) -> str:
    """The record's state: STARTING, RUNNING or STOPPING (an older agent's record: RUNNING)."""
    value = record.get("state", RUNNING)
    return value if value in (STARTING, RUNNING, STOPPING) else RUNNING


def _valid(record: object, engine: str | None = None) -> bool:
    return (isinstance(record, dict) and type(record.get("pid")) is int and record["pid"] > 1
            and isinstance(record.get("engine"), str) and NAME.fullmatch(record["engine"])
            is not None and (engine is None or record["engine"] == engine))


def _read(path: Path, engine: str | None = None) -> Record | None:
    """The record in ``path`` (of ``engine`` when given), or None; an unreadable one is removed."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        record = None
    if _valid(record, engine):
        assert isinstance(record, dict)
        return record
    path.unlink(missing_ok=True)
    return None


def load(sd: Path, engine: str) -> Record | None:
    """The record of ``engine``, or None."""
    return _read(record_path(sd, engine), engine)


def records(sd: Path) -> list[Record]:
    """Every engine's record, oldest start first."""
    try:
        paths = sorted((sd / ENGINES).glob("*.json"))
    except OSError:
        return []
    found = [r for p in paths if not p.name.startswith(".")
             if (r := _read(p, p.name[:-len(".json")])) is not None]
    return sorted(found, key=started_at)


def started_at(record: Record) -> float:
    """When the record's engine was started (0 when the record does not say)."""
    value = record.get("started_at")
    return float(value) if isinstance(value, (int, float)) else 0.0


def save(sd: Path, record: Record) -> None:
    """Record an engine atomically (a temporary file renamed over its old record)."""
    path = record_path(sd, record["engine"])
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def forget(sd: Path, engine: str) -> None:
    """Remove the record of ``engine``."""
    record_path(sd, engine).unlink(missing_ok=True)


def migrate(sd: Path) -> None:
    """Read an older agent's ``engine.json`` as one engine's record and move it to
    ``engines/``, so upgrading the agent never orphans the engine it started.

    Only an older agent writes ``engine.json``, so a record of the same name already here means
    an older agent ran after this one: one name holds one record, and the older agent's engine
    (when it is still ours) is stopped rather than left running unrecorded."""
    legacy = sd / LEGACY
    record = _read(legacy)
    if record is None:
        return
    (sd / ENGINES).mkdir(mode=0o700, exist_ok=True)
    if load(sd, record["engine"]) is None:
        os.replace(legacy, record_path(sd, record["engine"]))
        return
    if ours(record):
        terminate([record["pid"]], LEGACY_GRACE)
    legacy.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(sd: Path, wait: bool = True) -> Iterator[None]:
    """Hold the host's agent lock for the duration of the block, waiting for it (without
    ``wait``, BlockingIOError when another call holds it)."""
    fd = os.open(sd / "agent.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)
