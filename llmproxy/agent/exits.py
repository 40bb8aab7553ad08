"""How an engine ended, known once and told once: the exit records (``engines/<E>.exit``,
``{"pid", "engine_pid", "exit_status", "signal", "at"}``) the reaper writes, and the rules
that keep an end nobody asked for (a crash, a kill, the OOM killer) apart from the agent's
own stops.

- The reaper writes ``E.exit`` when its engine ends, whoever ended it.
- A start records its engine ``starting`` until healthy; a stop marks a record ``stopping``
  before it signals. Either removes the exit record (when it is its engine's) before it
  forgets the record. So an exit record that no record of the same pid claims is always an
  end nobody asked for.
- A ``running`` record whose leader is dead is buried by whoever finds it: what is left of
  its group is killed, its exit record kept (written with nulls when the reaper itself was
  killed), the record forgotten. Under the lock (status, start, stop) with a grace; the watch
  does it without the lock (a start holds the lock while it waits for health), claiming the
  record by a rename so that it never removes one a start has just written.
- The watch takes each exit record no record claims by renaming it away (only one reader
  gets it), reports it, and deletes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from llmproxy.agent.processes import leader_alive, ours, terminate
from llmproxy.agent.state import (
    ENGINES,
    NAME,
    RUNNING,
    Record,
    forget,
    load,
    record_path,
    records,
    state_of,
)

STALE_GRACE = 2.0  # grace for leftovers of an engine whose main process died


def exit_path(sd: Path, engine: str) -> Path:
    """Where the reaper of ``engine`` records how it ended."""
    return sd / ENGINES / f"{engine}.exit"


def read_exit(path: Path) -> dict[str, Any] | None:
    """The exit record in ``path``, or None when there is none (or it is not one)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and type(doc.get("pid")) is int else None


def of(sd: Path, record: Record) -> dict[str, Any] | None:
    """The exit record of ``record``'s engine process, or None while it has none."""
    doc = read_exit(exit_path(sd, record["engine"]))
    return doc if doc is not None and doc["pid"] == record["pid"] else None


def _ensure(sd: Path, record: Record) -> None:
    """Keep the reaper's exit record of ``record``, or write one that knows nothing more."""
    if of(sd, record) is not None:
        return
    path = exit_path(sd, record["engine"])
    doc = {"pid": record["pid"], "engine_pid": record.get("engine_pid", record["pid"]),
           "exit_status": None, "signal": None, "at": time.time()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def discard(sd: Path, record: Record) -> None:
    """Remove the exit record of ``record``'s engine (a stop's or a failed start's end)."""
    if of(sd, record) is not None:
        exit_path(sd, record["engine"]).unlink(missing_ok=True)


def bury(sd: Path, dead: list[Record], grace: float = STALE_GRACE) -> None:
    """Under the lock: forget records whose leader died, after stopping what is left of their
    groups; a running one's exit record stays for the watch to report."""
    leftovers = [r["pid"] for r in dead if ours(r)]
    if leftovers:
        terminate(leftovers, grace)
    for r in dead:
        if state_of(r) == RUNNING:
            _ensure(sd, r)
        else:
            discard(sd, r)
        forget(sd, r["engine"])


def _claim(path: Path) -> Path | None:
    """Move ``path`` aside under a name of this process (only one claimer gets it)."""
    claimed = path.with_name(f".{path.name}.claim.{os.getpid()}")
    try:
        os.rename(path, claimed)
    except FileNotFoundError:
        return None
    return claimed


def _give_back(claimed: Path, path: Path) -> None:
    """Put a claimed file back, unless a newer one took its place meanwhile."""
    with contextlib.suppress(FileExistsError):
        os.link(claimed, path)
    claimed.unlink(missing_ok=True)


def _take_record(sd: Path, record: Record) -> bool:
    """Remove ``record`` without the lock, if its file still holds it, running."""
    path = record_path(sd, record["engine"])
    claimed = _claim(path)
    if claimed is None:
        return False
    try:
        held = json.loads(claimed.read_text())
    except (OSError, ValueError):
        held = None
    same = (isinstance(held, dict) and held.get("pid") == record["pid"]
            and held.get("starttime") == record.get("starttime") and state_of(held) == RUNNING)
    if same:
        claimed.unlink(missing_ok=True)
    else:
        _give_back(claimed, path)  # a start or a stop wrote it since: theirs
    return same


def find_crashes(sd: Path) -> None:
    """Without the lock: bury each running record whose engine ended (its exit record is
    there, or its leader is dead); what is left of its group is killed at once."""
    for record in records(sd):
        if state_of(record) != RUNNING:
            continue
        alive = leader_alive(record)  # before the exit record: a dead reaper wrote it first
        if alive and of(sd, record) is None:
            continue
        if not _take_record(sd, record):
            continue
        if ours(record):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record["pid"], signal.SIGKILL)
        _ensure(sd, record)


def take_exits(sd: Path) -> list[dict[str, Any]]:
    """Without the lock: the exit records no record claims, each with its ``engine``, taken
    (removed) so that no other call reports them again."""
    try:
        paths = sorted((sd / ENGINES).glob("*.exit"))
    except OSError:
        return []
    taken = []
    for path in paths:
        engine = path.name[:-len(".exit")]
        doc = read_exit(path)
        if NAME.fullmatch(engine) is None or doc is None or _claimed(sd, engine, doc):
            continue
        claimed = _claim(path)
        if claimed is None:
            continue
        doc = read_exit(claimed)
        if doc is not None and _claimed(sd, engine, doc):
            _give_back(claimed, path)  # a newer engine's, written since, still recorded
            continue
        claimed.unlink(missing_ok=True)
        if doc is not None:
            taken.append({"engine": engine, **doc})
    return taken


def _claimed(sd: Path, engine: str, doc: dict[str, Any]) -> bool:
    record = load(sd, engine)
    return record is not None and record["pid"] == doc["pid"]
