"""Captures written to disk, only when `capture.dir` is set: one JSON line per
capture (redacted as kept in memory) appended to `captures.jsonl` in that
directory, which rotates (`captures.jsonl.1` ... `.3`, the oldest removed) so
that the four files together stay within `dir_max_bytes`. A write that fails is
counted and said in the listing (`dir.error`), and never fails a request."""

from __future__ import annotations

import os
from typing import Any

NAME = "captures.jsonl"
KEPT = 3           # rotated files besides the current one


class CaptureFiles:
    """Appends capture lines to `directory`, rotating within `max_bytes`."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory = directory
        self.part = max(1, max_bytes // (KEPT + 1))      # each file's bound
        self.written = 0
        self.failed = 0
        self.error: str | None = None
        self._size: int | None = None      # the current file's, once known

    def _path(self, n: int = 0) -> str:
        return os.path.join(self.directory, NAME if n == 0 else f"{NAME}.{n}")

    def write(self, line: bytes) -> None:
        """Append one capture (a line longer than a file's bound is not written)."""
        if len(line) + 1 > self.part:
            self.failed += 1
            self.error = f"a capture of {len(line)} bytes is over a file's bound ({self.part})"
            return
        try:
            if self._size is None:
                os.makedirs(self.directory, exist_ok=True)
                path = self._path()
                self._size = os.path.getsize(path) if os.path.exists(path) else 0
            if self._size + len(line) + 1 > self.part:
                self._rotate()
            with open(self._path(), "ab") as f:
                f.write(line + b"\n")
            self._size += len(line) + 1
            self.written += 1
        except OSError as e:
            self.failed += 1
            self.error = f"{self.directory}: {e.strerror or e}"
            self._size = None

    def _rotate(self) -> None:
        for n in range(KEPT, 0, -1):
            older = self._path(n - 1)
            if os.path.exists(older):
                os.replace(older, self._path(n))
        self._size = 0

    def summary(self) -> dict[str, Any]:
        """Where the captures go, how many went, and the last failure."""
        return {"path": self._path(), "max_bytes": self.part * (KEPT + 1),
                "written": self.written, "failed": self.failed, "error": self.error}
