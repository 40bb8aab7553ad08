"""Engine logs (``engine-<E>.log``): their last lines, their rotation while the engine writes,
and the ``log`` order, which sends the last lines and, with ``follow``, the new ones as they
come, across rotations.

A log is rotated by copying it to ``engine-<E>.log.1`` and truncating it: the engine's
descriptor is O_APPEND, so its next write starts the file anew and nothing it wrote is lost.
Copy and truncation happen under an exclusive flock on the log, and a follower reads under a
shared one, so a follower never sees half a rotation; a new ``.1`` tells it one happened, and it
reads what it had not yet read from the copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from llmproxy.agent.orders import BadInput, JSONDict, engine_name
from llmproxy.agent.protocol import EVENT_FIELD, LOG_LINE
from llmproxy.agent.state import NAME, log_path

LOG_ROTATE_BYTES = 50 * 1024 * 1024
LOG_TAIL_LINES = 20
FOLLOW_POLL = 0.2   # how often a follower looks for new lines
MAX_LINES = 10000   # the most lines a log order may ask for
MAX_TAIL_BYTES = 8 * 1024 * 1024  # the most a tail reads back
_BLOCK = 65536
LINE_SHOWN = 2000   # the most characters of one line sent; a longer one is cut
PARTIAL_MAX = 65536  # an unfinished line this long is sent (cut) without waiting for its end
TAIL_JSON_BYTES = 32768  # the most an exit event's lines take, JSON-encoded


def rotated(path: Path) -> Path:
    """Where a rotation keeps the previous part of ``path``."""
    return path.with_name(path.name + ".1")


@contextlib.contextmanager
def _flocked(f: IO[bytes], how: int) -> Iterator[None]:
    fcntl.flock(f.fileno(), how)
    try:
        yield
    finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def rotate(path: Path, limit: int = LOG_ROTATE_BYTES) -> bool:
    """Copy ``path`` to its ``.1`` and truncate it when it holds over ``limit`` bytes; whether
    it did."""
    try:
        if os.stat(path).st_size <= limit:
            return False
        with open(path, "rb") as src, _flocked(src, fcntl.LOCK_EX):
            tmp = path.with_name(f".{path.name}.1.{os.getpid()}")
            with open(tmp, "wb") as dst:
                while block := src.read(_BLOCK):  # up to the end, what came meanwhile too
                    dst.write(block)
            os.replace(tmp, rotated(path))
            os.truncate(path, 0)
    except OSError:
        return False
    return True


def _ino(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _last_lines(f: IO[bytes], n: int) -> tuple[list[bytes], bytes, int]:
    """The last ``n`` complete lines of ``f``, the unfinished line after them, and the offset
    where that unfinished line starts (read back from the end, at most MAX_TAIL_BYTES)."""
    end = f.seek(0, os.SEEK_END)
    start, data = end, b""
    while start > 0 and data.count(b"\n") <= n and end - start < MAX_TAIL_BYTES:
        step = min(_BLOCK, start)
        start -= step
        f.seek(start)
        data = f.read(step) + data
    cut = data.rfind(b"\n") + 1
    lines = data[:cut].split(b"\n")[:-1]
    return (lines[-n:] if n else []), data[cut:], start + cut


def _text(line: bytes) -> str:
    """One log line as sent: decoded, and cut at LINE_SHOWN characters (saying how
    many more there were), so that any line fits in one JSON line of the proxy's
    bound (hosts/agentstream.MAX_LINE) whatever the engine printed."""
    text = line[:4 * LINE_SHOWN + 4].decode("utf-8", "replace").rstrip("\r")
    if len(text) <= LINE_SHOWN and len(line) <= 4 * LINE_SHOWN + 4:
        return text
    return f"{text[:LINE_SHOWN]} ... (cut: the line had {len(line)} bytes)"


def bounded_tail(lines: list[str], limit: int = TAIL_JSON_BYTES) -> list[str]:
    """The last of ``lines`` whose JSON encoding fits in ``limit`` bytes (an exit
    event carries them in one line)."""
    kept: list[str] = []
    size = 2
    for line in reversed(lines):
        size += len(json.dumps(line)) + 2
        if size > limit:
            break
        kept.append(line)
    return kept[::-1]


def tail_lines(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``n`` lines of a log, an unfinished last line included (none without a log)."""
    try:
        with open(path, "rb") as f:
            lines, partial, _ = _last_lines(f, n)
    except OSError:
        return []
    return [_text(line) for line in lines + ([partial] if partial else [])][-n:] if n else []


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of an engine's log as one text (empty when there is none)."""
    return "\n".join(tail_lines(path, lines))


class Follower:
    """One log followed: its last ``lines`` lines at first (`tail`, and `unfinished`, the line
    the engine is still writing), then each `poll` gives the lines finished since, across
    rotations. A log that does not exist yet is waited for and read from its start, as is
    every log with ``lines`` None."""

    def __init__(self, path: Path, lines: int | None) -> None:
        self.path = path
        self.tail: list[str] = []
        self.unfinished = ""
        self._file: IO[bytes] | None = None
        self._offset = 0
        self._partial = b""
        self._rot: int | None = None
        with contextlib.suppress(OSError):
            self._file = open(path, "rb")  # noqa: SIM115 (held while following)
            with _flocked(self._file, fcntl.LOCK_SH):
                self._rot = _ino(rotated(path))
                if lines is None:
                    return
                found, unfinished, self._offset = _last_lines(self._file, lines)
            self.tail = [_text(line) for line in found]
            self.unfinished = _text(unfinished)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def poll(self) -> list[str]:
        """The lines finished since the last look."""
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 (held while following)
            except OSError:
                return []
            self._rot = _ino(rotated(self.path))
        with _flocked(self._file, fcntl.LOCK_SH):
            data = self._read_new()
        data = self._partial + data
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        lines = [_text(line) for line in data[:cut].split(b"\n")[:-1]]
        if len(self._partial) > PARTIAL_MAX:   # a line without end: sent cut, never held
            lines.append(_text(self._partial))
            self._partial = b""
        return lines

    def _read_new(self) -> bytes:
        assert self._file is not None
        data = b""
        rot = _ino(rotated(self.path))
        if rot is not None and rot != self._rot:  # rotated: the copy holds what we missed
            with contextlib.suppress(OSError), open(rotated(self.path), "rb") as old:
                old.seek(self._offset)
                data = old.read()
            self._rot, self._offset = rot, 0
        if _ino(self.path) not in (None, os.fstat(self._file.fileno()).st_ino):
            self._file.close()  # replaced (removed and written anew): follow the new one
            self._file = open(self.path, "rb")  # noqa: SIM115 (held while following)
            self._offset = 0
        self._file.seek(self._offset)
        data += self._file.read()
        self._offset = self._file.tell()
        return data


def _logged(sd: Path) -> list[str]:
    """The engines that have a log in ``sd``."""
    names = (p.name[len("engine-"):-len(".log")] for p in sd.glob("engine-*.log"))
    return sorted(n for n in names if NAME.fullmatch(n))


def _log_fields(order: JSONDict) -> tuple[str | None, int, bool]:
    engine = None if order.get("engine") is None else engine_name(order["engine"])
    lines = order.get("lines", 50)
    if type(lines) is not int or not 0 <= lines <= MAX_LINES:
        raise BadInput(f"lines must be a whole number from 0 to {MAX_LINES}, got {lines!r}")
    follow = order.get("follow", False)
    if not isinstance(follow, bool):
        raise BadInput(f"follow must be true or false, got {follow!r}")
    return engine, lines, follow


def op_log(sd: Path, order: JSONDict, emit: Callable[[JSONDict], Any],
           ended: Callable[[float], bool], inbox: object = None) -> None:
    """The ``log`` order: ``{"event": "log", "engine", "line"}`` for the last ``lines`` lines
    of the engine's log (of every engine's when it names none), then, with ``follow``, each
    new line until ``ended``."""
    engine, lines, follow = _log_fields(order)
    followers: dict[str, Follower] = {}
    try:
        for name in [engine] if engine is not None else _logged(sd):
            follower = followers[name] = Follower(log_path(sd, name), lines)
            # A follower sends the line being written once it is finished; a look sends it now.
            shown = follower.tail + ([follower.unfinished] if follower.unfinished else [])
            for line in (follower.tail if follow else shown[-lines:]) if lines else []:
                emit({EVENT_FIELD: LOG_LINE, "engine": name, "line": line})
        if not follow:
            return
        while not ended(FOLLOW_POLL):
            for name in [] if engine is not None else _logged(sd):
                if name not in followers:  # a log begun since: all of it is new
                    followers[name] = Follower(log_path(sd, name), None)
            for name, follower in followers.items():
                for line in follower.poll():
                    emit({EVENT_FIELD: LOG_LINE, "engine": name, "line": line})
    finally:
        for follower in followers.values():
            follower.close()
