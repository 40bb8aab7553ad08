"""The host's lease: which proxy manages this GPU host, held for as long as that proxy's
``watch`` session lives.

A holder is named by an order's ``holder`` field: ``{"machine", "pid", "runtime_dir"}``. Two
holders with the same machine and runtime_dir are the same proxy (an upgrade's successor and
its predecessor share the lease); any other is another proxy.

Three files in the state directory:

- ``lease.lock``: every watch that holds the lease keeps a shared flock on it for its whole
  life, so the lease goes with the last holding process (a proxy killed with -9: its ssh
  ends, the watch's stdin closes, the process exits). Whether anyone holds it is whether an
  exclusive flock is refused.
- ``lease.json``: the holder's record, ``machine``, ``pid``, ``runtime_dir``, ``since``
  (epoch seconds); the pid is the latest process of that holder to join.
- ``lease.mutex``: held (exclusively) only for the instant of a look or a take, so that a
  take's exclusive-then-shared flock is never seen half done.

A start or stop order (`check`) is refused while another holder holds the lease, and holds
it itself for its own duration while nobody does; an order given by hand on the host (a
person's) is not checked. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmproxy.agent.orders import BadInput

LOCK, RECORD, MUTEX = "lease.lock", "lease.json", "lease.mutex"
MAX_FIELD = 4096     # a holder's machine or runtime_dir: longer is bad input

Holder = dict[str, Any]


def holder_of(order: dict[str, Any]) -> Holder | None:
    """The holder an order names (its ``holder`` field), or None when it names none;
    BadInput when the field is malformed."""
    value = order.get("holder")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadInput(f"holder must be an object, got {value!r:.100}")
    machine, pid, runtime = value.get("machine"), value.get("pid"), value.get("runtime_dir")
    for key, text in (("machine", machine), ("runtime_dir", runtime)):
        if not isinstance(text, str) or not text or len(text) > MAX_FIELD:
            raise BadInput(f"holder.{key} must be a non-empty string, got {text!r:.100}")
    if type(pid) is not int or pid <= 0:
        raise BadInput(f"holder.pid must be a positive whole number, got {pid!r:.100}")
    return {"machine": machine, "pid": pid, "runtime_dir": runtime}


def same(a: Holder, b: Holder) -> bool:
    """Whether two holders are one proxy (same machine and runtime_dir; the pid may differ
    across an upgrade)."""
    return bool(a.get("machine") == b.get("machine")
                and a.get("runtime_dir") == b.get("runtime_dir"))


def describe(record: Holder) -> str:
    """``MACHINE pid P since T`` (T in UTC, ISO 8601)."""
    since = record.get("since")
    when = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
            if isinstance(since, (int, float)) else "an unknown time")
    return f"{record.get('machine')} pid {record.get('pid')} since {when}"


@contextlib.contextmanager
def _mutex(sd: Path) -> Iterator[None]:
    fd = os.open(sd / MUTEX, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read(sd: Path) -> Holder:
    try:
        record = json.loads((sd / RECORD).read_text())
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict):
        return {"machine": "an unknown holder", "pid": None, "runtime_dir": None, "since": None}
    return record


def _write(sd: Path, record: Holder) -> None:
    tmp = sd / f".{RECORD}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, sd / RECORD)


def current(sd: Path) -> Holder | None:
    """The record of whoever holds the lease now, or None when nobody does."""
    with _mutex(sd):
        fd = os.open(sd / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read(sd)
            return None
        finally:
            os.close(fd)


def check(sd: Path, order: dict[str, Any]) -> tuple[str | None, Lease | None]:
    """Whether the order may change this host's engines: (None, the lease it holds
    meanwhile) or (why not, None). Another holder holding the lease refuses it (an
    order naming no holder is nobody's, refused by any holder). While nobody holds
    it, the order takes it for itself until `release` (its end): its proxy's watch
    is not up yet (at start, or while its ssh is down), and no other proxy may take
    the host in the meantime, so one proxy at a time changes its engines."""
    holder = holder_of(order)
    if holder is None:
        record = current(sd)
        return (None if record is None else _held_by(record)), None
    ours = Lease(sd, holder)
    record = ours.take(time.time())
    return (None, ours) if ours.held else (_held_by(record), None)


def _held_by(record: Holder) -> str:
    return (f"this host is held by {describe(record)}: another llmproxy manages it "
            "(its lease lives as long as that proxy's watch session)")


class Lease:
    """The lease as one watch process holds it (or waits for it)."""

    def __init__(self, sd: Path, holder: Holder) -> None:
        self.sd = sd
        self.holder = holder
        self.fd: int | None = None

    def take(self, now: float) -> Holder:
        """Try to take (or join) the lease: the record of its holder afterwards. It is ours
        when `held` is True; else the record names the other holder."""
        if self.fd is not None:
            return _read(self.sd)
        with _mutex(self.sd):
            fd = os.open(self.sd / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read(self.sd)
                if not same(record, self.holder):
                    os.close(fd)
                    return record
                # The same proxy (an upgrade's successor): shared with its predecessor,
                # taken while the predecessor's shared lock still holds, so no gap.
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                record = {**record, "pid": self.holder["pid"]}
            else:
                record = {**self.holder, "since": now}
            try:
                _write(self.sd, record)
                # Under the mutex, so no other take sees the lock free in between.
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError:
                os.close(fd)
                raise
            self.fd = fd
            return record

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Let go (the process's exit does the same)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
