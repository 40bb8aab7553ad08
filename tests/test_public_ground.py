"""The reference path stands on public Twisted: every private Twisted name, and
every swap of a Twisted method, lives in llmproxy/speedups/ (or the small
llmproxy/compat/), and no speedup replaces a method of the reactor.

A private name is one with a leading underscore (not a dunder). Outside those
two packages this test fails on:

- an import from a Twisted (or treq) module whose path has a private part, or
  of a private name from one;
- an attribute `x._name` read or written on anything but `self` or `cls`
  (llmproxy's own objects keep their privates to themselves, too);
- `self._name` (or `def _name`) in a class with a Twisted base, where `_name`
  is a private attribute of that base (inherited state, or a private hook
  overridden);
- a private name spelled as a string for getattr, hasattr, setattr or delattr.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "llmproxy"
QUARANTINE = {"speedups", "compat"}
# Documented Python API that happens to start with an underscore.
DOCUMENTED = {("os", "_exit")}
THIRD_PARTY = ("twisted", "treq")


def public_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).parts[0] not in QUARANTINE)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


@cache
def _twisted_privates(cls: type) -> frozenset[str]:
    """The private attribute names a Twisted class has: in its namespace, and
    assigned as `self._x` in its source."""
    names = {n for n in vars(cls) if _private(n)}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "self" and _private(node.attr):
            names.add(node.attr)
    return frozenset(names)


def _inherited_privates(module: object | None, class_name: str) -> frozenset[str]:
    """Private names of the Twisted classes in `class_name`'s MRO."""
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        return frozenset()
    found: set[str] = set()
    for base in cls.__mro__[1:]:
        if base.__module__.split(".")[0] in THIRD_PARTY:
            found |= _twisted_privates(base)
    return frozenset(found)


def private_uses(path: Path, module_name: str | None = None) -> list[str]:
    """What `path` (the module `module_name`, by default the llmproxy module at
    that path) does with private names that the rule forbids."""
    tree = ast.parse(path.read_text())
    # A __main__ module runs when imported; it defines no classes to look into.
    module = None if path.name == "__main__.py" else \
        importlib.import_module(module_name or _module_name(path))
    found: list[str] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] in THIRD_PARTY:
            if any(_private(part) for part in node.module.split(".")):
                found.append(f"{line}: from {node.module} import ...")
            found += [f"{line}: imports {a.name} from {node.module}"
                      for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in THIRD_PARTY
                      and any(_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and (owner.id in {"self", "cls"} or
                                                (owner.id, node.attr) in DOCUMENTED):
                continue
            found.append(f"{line}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in {"getattr", "hasattr", "setattr", "delattr"} and \
                len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and \
                isinstance(node.args[1].value, str) and _private(node.args[1].value):
            found.append(f"{line}: {ast.unparse(node)}")
        elif isinstance(node, ast.ClassDef):
            inherited = _inherited_privates(module, node.name)
            for inner in ast.walk(node):
                name = None
                if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) \
                        and inner.value.id == "self":
                    name = inner.attr
                elif isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                    name = inner.name
                if name is not None and name in inherited:
                    found.append(f"{inner.lineno}: {node.name} uses Twisted's private {name}")
    return found


@pytest.mark.parametrize("path", public_modules(),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_twisted_name_outside_the_quarantine(path: Path) -> None:
    """Outside speedups/ and compat/, no private name of Twisted (or of another
    module's object) is imported, read, written, overridden or spelled for getattr."""
    assert private_uses(path) == []


def test_the_rule_catches_what_it_forbids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """The checker itself finds each kind of use (so a pass above means something)."""
    bad = tmp_path / "ground_probe.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    bad.write_text(textwrap.dedent('''
        from twisted.web._newclient import RequestNotSent
        from twisted.web.http_headers import _nameEncoder
        from twisted.web.http import HTTPChannel

        class Channel(HTTPChannel):
            def requestDone(self, request):
                return self._dataBuffer

            def _respondToBadRequestAndDisconnect(self):
                pass

        def peek(headers):
            return headers._rawHeaders, getattr(headers, "_rawHeaders")
        '''))
    uses = private_uses(bad, "ground_probe")
    text = "\n".join(uses)
    for expected in ("from twisted.web._newclient", "imports _nameEncoder",
                     "private _dataBuffer", "private _respondToBadRequestAndDisconnect",
                     "headers._rawHeaders", "getattr(headers, '_rawHeaders')"):
        assert expected in text, (expected, uses)


def test_nothing_replaces_a_reactor_method() -> None:
    """No module assigns to an attribute of a reactor (doIteration, mainLoop,
    ...): the reactor is shared by every part of the process."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and \
                            "reactor" in ast.unparse(target.value).lower():
                        raise AssertionError(f"{path}:{node.lineno}: {ast.unparse(target)}")
