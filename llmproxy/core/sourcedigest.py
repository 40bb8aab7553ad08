"""Is the installed library the one a piece of code was written against?

Code that copies a library's code, or rests on what its private parts do,
records a digest of that code's source as of the version it follows. Any
change to that source (an upgrade, a security fix) changes the digest, and
`changed_sources` names what changed; checking only that attributes exist
would not notice a changed body. (Used by the guards of llmproxy.speedups and
llmproxy.compat; standard library only.)
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Mapping
from typing import Any


def resolve(dotted: str) -> Any:
    """The object a dotted name such as `twisted.web.http.HTTPChannel.lineReceived`
    names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def source_digest(obj: Any) -> str:
    """The sha256 of `obj`'s source (its first 16 hex digits)."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def changed_sources(expected: Mapping[str, str]) -> str | None:
    """None when every named object's source has the recorded digest; else
    which ones differ (or are gone)."""
    changed = []
    for dotted, digest in expected.items():
        try:
            found = source_digest(resolve(dotted))
        except (ImportError, AttributeError, OSError, TypeError):
            changed.append(f"{dotted} is gone")
            continue
        if found != digest:
            changed.append(f"{dotted} changed (source {found}, known {digest})")
    if not changed:
        return None
    return "the installed Twisted differs from the one it follows: " + "; ".join(changed)
