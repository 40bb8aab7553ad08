"""Which tests the reference run (LLMPROXY_SPEEDUPS=0) repeats: the `both_modes` marker.

`make pytest` runs the suite twice: with the speedups, then on the reference path alone. The
switch is read in one place, `llmproxy.speedups.select(os.environ)`, which twistd's plugin
(llmproxy/tap.py) calls in a proxy process and `lifecycle.assemble` calls when a test builds the
service without naming its speedups; the code it switches lives in llmproxy/speedups/ and the
web/ and lifecycle/ modules that pick a class by it. So a test module depends on the run's mode
only when it, or a tests/ helper module it imports,

- starts a proxy process (`Proxy(` of tests/procs.py, or `twistd` in any form: the launcher,
  the systemd unit, the demo), or
- reads the switch itself (`LLMPROXY_SPEEDUPS`), or
- imports (directly or through llmproxy's own imports) llmproxy.web, llmproxy.speedups,
  llmproxy.lifecycle or llmproxy.tap.

Such a module's tests are marked `both_modes`. Every other test (the agent, hosts/, config,
the docs, the bench's arithmetic, the test harnesses) runs the same code in either run, so the
reference run (`pytest -m both_modes`) leaves it out: running it again would prove nothing
more. A test that takes the `on_both_paths` fixture or the differential `rig` runs both paths
itself, in the first run, and is not marked either.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWITCHED = ("llmproxy.web", "llmproxy.speedups", "llmproxy.lifecycle", "llmproxy.tap")
SWITCHED_TEXT = ("Proxy(", "twistd", "LLMPROXY_SPEEDUPS")
SELF_SWITCHING = {"on_both_paths", "rig"}   # fixtures that run both paths themselves


@functools.cache
def _sources() -> dict[str, Path]:
    """Every module of llmproxy/ and tests/ by dotted name."""
    found = {}
    for top in ("llmproxy", "tests"):
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


@functools.cache
def _imports(name: str) -> frozenset[str]:
    """The project's modules `name` imports at its top or anywhere in its body."""
    sources, found = _sources(), set()
    for node in ast.walk(ast.parse(sources[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    parents = {".".join(n.split(".")[:i]) for n in found for i in range(1, n.count(".") + 1)}
    return frozenset(n for n in found | parents if n in sources and n != name)


@functools.cache
def switched(name: str) -> bool:
    """Whether test module `name` (dotted) runs code the LLMPROXY_SPEEDUPS switch changes."""
    seen, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        if any(module == s or module.startswith(s + ".") for s in SWITCHED):
            return True
        if module.startswith("tests.") and module != "tests.procs":   # procs defines Proxy
            text = _sources()[module].read_text()
            if any(marker in text for marker in SWITCHED_TEXT):
                return True
        todo.extend(_imports(module))
    return False


def both_modes(path: Path, fixtures: list[str]) -> bool:
    """Whether a test of the file `path` taking `fixtures` is repeated in the reference run."""
    module = ".".join(path.resolve().relative_to(ROOT).with_suffix("").parts)
    return switched(module) and not SELF_SWITCHING.intersection(fixtures)
