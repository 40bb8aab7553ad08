"""The shape of the package, as docs/architecture.md draws it: every module small,
every function short, and each part importing only the parts it may."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "llmproxy"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# Who may import whom (llmproxy.<part>); a part may always import itself.
ALLOWED = {
    "core": set(),
    "config": {"core"},
    "agent": set(),
    "hosts": {"core", "config", "agent"},     # the agent's wire protocol only (below)
    "observe": {"core", "config", "hosts"},
    "web": {"core", "config", "hosts", "observe"},
    "speedups": {"core", "config", "hosts", "observe", "web"},
    "compat": {"core"},
    "lifecycle": {"core", "config", "hosts", "observe", "web", "speedups", "compat"},
    "testing": {"core", "config", "hosts", "observe", "web", "lifecycle", "agent", "speedups"},
    # doctor calls the agent as the proxy does (hosts.agentclient, never the reactor) and
    # reads nvidia-smi's answer with the agent's parser; check runs twistd's loader
    # (lifecycle.accessfiles)
    "cli": {"config", "hosts", "agent", "lifecycle"},
}
# Top-level entry points: tap (twistd's plugin), and the package's __init__.
ENTRY_POINTS = {"tap", "__init__"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_parts(tree: ast.AST) -> set[str]:
    parts = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            bits = name.split(".")
            if bits[0] == "llmproxy" and len(bits) > 1 and bits[1] != "__version__":
                parts.add(bits[1])
    return parts


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_functions_are_small(path: Path) -> None:
    """No module over 400 lines, no function or method over 60 (def to last line)."""
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_part_imports_only_what_it_may(path: Path) -> None:
    """core imports nothing of llmproxy; the agent nothing at all; hosts never web,
    observe or lifecycle; web never lifecycle; no production part imports testing."""
    part = part_of(path)
    used = imported_parts(ast.parse(path.read_text())) - {part}
    if part in ENTRY_POINTS:
        return
    assert used <= ALLOWED[part], f"{part} may not import {sorted(used - ALLOWED[part])}"


def test_the_proxy_shares_only_the_wire_protocol_with_the_agent() -> None:
    """In the proxy's process (every part but the agent, testing and the command line),
    llmproxy.agent is imported only for its protocol module: one version number for both
    ends, no agent code in the proxy."""
    for path in modules():
        if part_of(path) in ("agent", "testing", "cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name == "llmproxy.agent" or name.startswith("llmproxy.agent."):
                    assert name == "llmproxy.agent.protocol", (path, name)


def test_core_and_config_need_no_twisted_web() -> None:
    """Failure descriptions, events and the config load without twisted.web."""
    for path in [*(PACKAGE / "core").glob("*.py"), *(PACKAGE / "config").glob("*.py")]:
        tree = ast.parse(path.read_text())
        modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in modules if m.startswith("twisted.web")], path


def test_the_agent_needs_only_the_standard_library() -> None:
    """The agent runs on a GPU host from a bare install: no Twisted, no zope."""
    for path in (PACKAGE / "agent").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] in {"__future__", "llmproxy"} or \
                    node.module.split(".")[0] in _stdlib(), node.module
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] in _stdlib(), alias.name


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names)


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))


@pytest.mark.parametrize("package", packages(), ids=lambda p: p.name)
def test_each_package_docstring_lists_its_modules(package: Path) -> None:
    """A package's docstring names each of its modules (and sub-packages) in
    backquotes, and its `Modules:` list (`- `name`: ...` lines) names only
    modules that exist: a newcomer reads the package's map from __init__."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    present = {p.stem for p in package.glob("*.py") if not p.stem.startswith("__")}
    present |= {p.name + "/" for p in package.iterdir() if p.is_dir()
                and not p.name.startswith("__") and any(p.iterdir())}
    named = set(re.findall(r"`([a-z0-9_]+/?)`", doc))
    listed = set(re.findall(r"^- `([a-z0-9_]+/?)`", doc, re.MULTILINE))
    assert present - named == set(), f"modules the docstring does not name: {present - named}"
    assert listed - present == set(), f"listed modules that do not exist: {listed - present}"
    assert listed, "the docstring has no `Modules:` list"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_another_modules_private_names(path: Path) -> None:
    """`from llmproxy.x import _name` is refused: what another module uses is
    public, and named so."""
    private = [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmproxy")
               for alias in node.names
               if alias.name.startswith("_") and not alias.name.endswith("__")]
    assert private == []


def _assigned(tree: ast.AST, name: str) -> bool:
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
        if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
            return True
    return False


def test_the_agent_protocol_version_is_assigned_in_one_module() -> None:
    """PROTOCOL is assigned in llmproxy/agent/protocol.py only: the agent and the proxy
    import that one number, so the two ends cannot drift apart."""
    assert [str(p.relative_to(PACKAGE)) for p in modules()
            if _assigned(ast.parse(p.read_text()), "PROTOCOL")] == ["agent/protocol.py"]


AGENT_SPEAKERS = ("agent", "hosts", "testing")   # the parts that write or read agent lines


def agent_event_literals(source: str, speaker: bool,
                         events: frozenset[str]) -> list[tuple[int, str]]:
    """String literals naming an agent event outside the protocol module: in the parts that
    speak to the agent, any such literal but a dict's key (a field of another answer) or a
    docstring; anywhere, one given as a dict's ``"event"``."""
    tree = ast.parse(source)
    dicts = [n for n in ast.walk(tree) if isinstance(n, ast.Dict)]
    keys = {id(k) for d in dicts for k in d.keys if k is not None}
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    named = {id(v) for d in dicts for k, v in zip(d.keys, d.values, strict=True)
             if isinstance(k, ast.Constant) and k.value == "event"}
    return sorted((n.lineno, n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in events
                  and id(n) not in keys | docs and (speaker or id(n) in named))


def test_agent_event_names_are_spelled_only_in_the_protocol_module() -> None:
    """Every agent event is named by its constant of llmproxy/agent/protocol.py, and the
    proxy reads events only as the typed records that module decodes."""
    from llmproxy.agent.protocol import EVENTS

    protocol = PACKAGE / "agent" / "protocol.py"
    found = {str(p.relative_to(PACKAGE)):
             agent_event_literals(p.read_text(), part_of(p) in AGENT_SPEAKERS, EVENTS)
             for p in modules() if p != protocol}
    assert {p: hits for p, hits in found.items() if hits} == {}


def test_the_event_literal_rule_finds_what_it_forbids() -> None:
    """The rule above is live: a dict naming an event, and a comparison with an event's
    name in a part that speaks to the agent, are both found."""
    from llmproxy.agent.protocol import EVENTS

    code = 'A = {"event": "exit"}\nB = kind == "hello"\nC = {"lease": 1}\nD = frame("log")\n'
    assert agent_event_literals(code, True, EVENTS) == [(1, "exit"), (2, "hello"), (4, "log")]
    assert agent_event_literals(code, False, EVENTS) == [(1, "exit")]
def order_field_literals(source: str) -> list[int]:
    """Lines where ``"op"``, the order's field, is spelled: a dict's key, a subscript, or the
    first argument of a call (``order.get("op")``)."""
    tree = ast.parse(source)
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Dict):
            found.update(k.lineno for k in n.keys
                         if isinstance(k, ast.Constant) and k.value == "op")
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
            found.update([n.lineno] if n.slice.value == "op" else [])
        elif isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant):
            found.update([n.lineno] if n.args[0].value == "op" else [])
    return sorted(found)


def test_agent_orders_name_their_op_field_by_the_protocol_constant() -> None:
    """The parts that speak to the agent write and read an order's field as `OP_FIELD` of
    llmproxy/agent/protocol.py, never as the literal."""
    protocol = PACKAGE / "agent" / "protocol.py"
    found = {str(p.relative_to(PACKAGE)): order_field_literals(p.read_text())
             for p in modules() if p != protocol and part_of(p) in AGENT_SPEAKERS}
    assert {p: lines for p, lines in found.items() if lines} == {}


def test_the_order_field_rule_finds_what_it_forbids() -> None:
    code = 'a = {"op": "stop"}\nb = order["op"]\nc = order.get("op")\nd = {"x": "op"}\n'
    assert order_field_literals(code) == [1, 2, 3]


MAX_HOSTS_MODULE_LINES = 300     # hosts/: small parts composed, never a tower


@pytest.mark.parametrize("path", sorted((PACKAGE / "hosts").glob("*.py")),
                         ids=lambda p: p.name)
def test_hosts_modules_stay_under_their_cap(path: Path) -> None:
    """No module in hosts/ over 300 lines: a host is composed of small parts."""
    assert len(path.read_text().splitlines()) <= MAX_HOSTS_MODULE_LINES


def _project_classes() -> dict[str, list[str]]:
    """Every class the package defines: its name -> the names of its bases."""
    classes: dict[str, list[str]] = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).extend(_base_names(node))
    return classes


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute)
            else "" for b in node.bases]


def _reaches(name: str, classes: dict[str, list[str]], roots: set[str]) -> bool:
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in roots:
            return True
        if current not in seen:
            seen.add(current)
            todo.extend(classes.get(current, []))
    return False


def test_no_class_in_hosts_inherits_from_another_of_the_project() -> None:
    """hosts/ is composed, not a tower: a class there inherits from no class of the
    project, exceptions and interfaces (typing.Protocol, zope Interface) aside."""
    classes = _project_classes()
    allowed = {"Exception", "BaseException", "Protocol", "Interface"}
    towers = []
    for path in sorted((PACKAGE / "hosts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in _base_names(node):
                if base in classes and not _reaches(base, classes, allowed):
                    towers.append(f"{path.name}: {node.name}({base})")
    assert towers == []


# Attribute writes in hosts/ on anything but `self`: Twisted's and the standard library's
# public knobs, and the plain records a module keeps (its waiters, its engines' records).
HOSTS_WRITES_ALLOWED = {
    ("agentbundle.py", "info"),      # zipfile.ZipInfo's compress_type and external_attr
    ("idle.py", "self._loop"),       # LoopingCall.clock
    ("scheduler.py", "waiter"),      # its queue's records (hosts/waiter.py)
    ("supervise.py", "record"),      # an engine's crash record
    ("supervisor.py", "record"),
}


def test_hosts_write_no_attribute_of_another_modules_object() -> None:
    """A host's cordon, its lease, a hand-over's protection and the supervisor's hooks
    are methods or constructor arguments: in hosts/, nothing assigns an attribute of
    an object but its own (`self`), a record it keeps, or a library's public knob."""
    writes = []
    for path in sorted((PACKAGE / "hosts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if not isinstance(t, ast.Attribute):
                        continue
                    owner = ast.unparse(t.value)
                    if owner not in ("self", "cls") and (path.name, owner) not in \
                            HOSTS_WRITES_ALLOWED:
                        writes.append(f"{path.name}:{node.lineno}: {ast.unparse(t)}")
    assert writes == []
def test_the_root_service_is_a_tree_of_named_children() -> None:
    """Built from a config, the root is a MultiService whose children are the host
    locks, the listener, the fleet, the roster refresher and the watchdog, each an
    IService, in the order Twisted's machinery starts them; the web's App is a
    facade of its own, not the root."""
    from twisted.application.service import IService, MultiService
    from twisted.internet.task import Clock

    from llmproxy.config import parse_config
    from llmproxy.lifecycle.assemble import ServiceInputs, build_service
    from llmproxy.testing.fakes import FakeHTTPClient

    config = parse_config({"hosts": [{"name": "gpu1", "url": "http://10.0.0.5:8081"}]})
    root = build_service(ServiceInputs(config, Clock(), http=FakeHTTPClient()))
    assert isinstance(root, MultiService)
    children = list(root)
    assert [c.name for c in children] == ["host-locks", "listener", "fleet",
                                          "roster-refresher", "watchdog"]
    assert all(IService.providedBy(c) for c in children)
    assert root.site.resource.app is not root


def _writes_into_an_upgrade(tree: ast.AST) -> list[int]:
    """Lines that assign an attribute of `upgrade`, `x.upgrade` or `x._upgrade`, or
    call setattr on one."""
    def is_upgrade(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in {"upgrade", "_upgrade"}) or \
            (isinstance(node, ast.Attribute) and node.attr in {"upgrade", "_upgrade"})

    lines = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "setattr" and node.args and is_upgrade(node.args[0]):
            lines.append(node.lineno)
        lines += [t.lineno for t in targets
                  if isinstance(t, ast.Attribute) and is_upgrade(t.value)]
    return lines


def test_nothing_writes_into_an_upgrade_outside_its_module() -> None:
    """`Upgrade` owns its state (the successor's URL included, set as its hand-over
    begins): no module of the package or the suite but lifecycle/upgrade.py assigns
    an attribute of one."""
    tests = Path(__file__).resolve().parent
    found = {str(path): lines for path in [*modules(), *sorted(tests.rglob("*.py"))]
             if path != PACKAGE / "lifecycle" / "upgrade.py"
             and (lines := _writes_into_an_upgrade(ast.parse(path.read_text())))}
    assert found == {}
    assert _writes_into_an_upgrade(ast.parse("svc.upgrade.successor_url = 'x'")) == [1]
def _rooted_at(node: ast.AST) -> str | None:
    """The name an expression starts from (`request` for `request.channel.site`)."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


REQUEST_NAMES = {"request", "req"}


@pytest.mark.parametrize("path", [p for p in modules()
                                  if part_of(p) not in ("speedups", "compat")],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_getattr_on_a_request(path: Path) -> None:
    """What the proxy knows of a request is its typed `state` (web/requeststate.py),
    never an attribute guessed with `getattr(request, ...)` (nor `hasattr`) on
    the request or anything reached from it; speedups/ and compat/, which work
    on Twisted's own objects, aside."""
    found = [f"{node.func.id} line {node.lineno}"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in ("getattr", "hasattr") and node.args
             and _rooted_at(node.args[0]) in REQUEST_NAMES]
    assert found == []
# -- the suite's own fixtures --------------------------------------------------------------
TESTS = Path(__file__).resolve().parent
# Fixture names that more than one test file defines, each with why the definitions differ.
# Anything shared (sshd, the simulated engine, a second machine, ...) lives in conftest.py.
FIXTURES_DEFINED_AGAIN = {
    "proxy": "each module's proxy process on that module's own configuration",
    "engines": "each module's engine processes, serving that module's own models",
    "setup": "each module's proxy and engine on that module's own keys and configuration",
    "engine": "conftest.py's simulated engine process; a unit test's in-memory engine "
              "(test_engineclient, test_simengine) or a misbehaving raw-socket engine "
              "(test_integration_client_leaves, test_integration_engine_hostile) in its place",
}


def fixture_names(tree: ast.AST) -> set[str]:
    """The names of the functions `tree` decorates as fixtures (pytest's or pytest_twisted's)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if isinstance(target, ast.Attribute) and "fixture" in target.attr:
                    names.add(node.name)
    return names


def test_no_fixture_is_defined_in_two_test_files() -> None:
    """A fixture is defined once, in conftest.py or in the one module that uses it (a
    module imports another's fixture rather than copying it), but for the allowlist's."""
    where: dict[str, list[str]] = {}
    for path in sorted(TESTS.glob("*.py")):
        for name in fixture_names(ast.parse(path.read_text())):
            where.setdefault(name, []).append(path.name)
    again = {name: files for name, files in where.items()
             if len(files) > 1 and name not in FIXTURES_DEFINED_AGAIN}
    assert again == {}, "define these once, in tests/conftest.py"
    unused = {name for name in FIXTURES_DEFINED_AGAIN if len(where.get(name, [])) < 2}
    assert unused == set(), "no longer defined twice: drop them from FIXTURES_DEFINED_AGAIN"
