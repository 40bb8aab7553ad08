"""twistd's pid file, as an upgrade hands it from one process to the next."""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from typing import Any


class PidFile:
    """The pid file twistd wrote for this process (`--pidfile`), or none.

    twistd refuses to start a second process while the file names a live one,
    and removes the file as its process exits. In an upgrade the old process
    releases it for the candidate (restoring it if the candidate fails), then
    disowns it, so that its own exit does not remove the successor's file.
    `runner` is twistd's own options mapping, where it looks at exit."""

    def __init__(self, path: str | None, runner: MutableMapping[str, Any] | None = None,
                 pid: Callable[[], int] = os.getpid) -> None:
        self.path = os.path.abspath(path) if path else None
        self._runner = runner
        self._pid = pid

    @classmethod
    def of_twistd(cls, options: Any) -> PidFile:
        """The pid file of the twistd whose plugin options are `options`."""
        runner = getattr(options, "parent", None)
        return cls(runner.get("pidfile") if runner else None, runner)

    def release(self) -> bool:
        """Remove the file (for a candidate); whether there was one to remove."""
        if not self.path:
            return False
        try:
            os.unlink(self.path)
        except OSError:
            return False
        return True

    def restore(self) -> None:
        """Write this process's pid again (the candidate failed)."""
        if self.path:
            with open(self.path, "w") as f:
                f.write(f"{self._pid()}\n")

    def disown(self) -> None:
        """The successor owns the file now: twistd must not remove it as we exit."""
        if self._runner is not None:
            self._runner["pidfile"] = ""
