"""The speedups and compat entries a service built in a test runs, read once.

`build_service` selects them itself when not told (`speedups.select(os.environ)`,
`compat.select()`), and every guard then digests the installed Twisted's sources: most of
the cost of a service built in memory. A run never changes those sources, so these give
the same selections, read once per value of the switches."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from llmproxy.compat import CompatSelection
from llmproxy.compat import select as select_compat
from llmproxy.speedups import OFF, SWITCH, Selection, select


def environment_speedups(environ: Mapping[str, str] = os.environ) -> Selection:
    """The speedups `build_service` would select under `environ`."""
    return _speedups(environ.get(SWITCH), environ.get(OFF))


@functools.cache
def _speedups(switch: str | None, off: str | None) -> Selection:
    return select({k: v for k, v in ((SWITCH, switch), (OFF, off)) if v is not None})


@functools.cache
def compat_entries() -> CompatSelection:
    """The compat entries `build_service` would select."""
    return select_compat()
