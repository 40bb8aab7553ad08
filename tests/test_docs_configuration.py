"""docs/configuration.md documents exactly the keys the config parser accepts.

How the accepted keys are found: the parser has no single list, but every key
it accepts is one an "unknown key" error is checked against. So the test reads
the source of llmproxy/config/ (an AST walk, nothing is hard-coded) for each
`if` whose body reports "unknown key", and takes what its condition compares
the key with (`key not in SOME_KEYS`, `key != "keys"`):

- a module-level name or attribute (`_TLS_KEYS`, `catalog_entry.MODEL_KEYS`)
  is evaluated in its module, giving a tuple of keys;
- a string constant is one key;
- a parameter of the enclosing function (the parser's `mapping(value, path,
  keys)`) stands for the argument given in that place at each call of the
  function (`self.mapping(item, path, _HOST_KEYS)`); `None` there means a
  free-form object (model names, aliases) and has no key list.

Each list found is named by where it is (`parse:_HOST_KEYS`) and must be one of
SECTIONS, which says under which heading of the page its keys are documented:
a list the parser gains without a section here fails the test, naming it.

The page's keys are the first cell of each table row that starts with a
backticked name, under the nearest heading above it. The test fails naming
every accepted key a section does not document, and every key a section
documents that the parser does not accept (or a documented key under a heading
that is no section at all).
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "llmproxy" / "config"
PAGE = ROOT / "docs" / "configuration.md"
UNKNOWN = "unknown key"

# Where each key list is (module:expression) -> the heading that documents it.
SECTIONS = {
    "parse:_TOP_KEYS": "Top level",
    "parse:_HOST_KEYS": "Hosts",
    "parse:_ENGINE_KEYS": "Engines",
    "wake:WAKE_KEYS": "Wake",
    "wake:SLEEP_KEYS": "Sleep",
    "parse:catalog_entry.MODEL_KEYS": "Models",
    "security:_TLS_KEYS": "TLS listener",
    "security:_CORS_KEYS": "CORS",
    "tracing:_KEYS": "Tracing",
    "capture:KEYS": "Capture",
    "keys:'keys'": "Keys file",
    "keys:_KEY_KEYS": "Each key",
}


def _modules() -> list[Path]:
    return sorted(p for p in CONFIG.glob("*.py") if p.name != "__init__.py")


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _enclosing_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.FunctionDef | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef):
            return node
    return None


def _reports_unknown(node: ast.If) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == UNKNOWN
               for stmt in node.body for n in ast.walk(stmt))


def _compared_with(test: ast.expr) -> Iterator[ast.expr]:
    """What the key is compared with in an `if`'s condition (`not in X`, `!= X`)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 \
                and isinstance(node.ops[0], ast.NotIn | ast.NotEq):
            yield node.comparators[0]


def _call_arguments(trees: dict[str, ast.Module], function: ast.FunctionDef,
                    parameter: str) -> Iterator[tuple[str, ast.expr]]:
    """The argument given for `parameter` at every call of `function` (a method
    called as `obj.name(...)` or a function as `name(...)`), with its module."""
    names = [a.arg for a in function.args.args]
    index = names.index(parameter)
    method = bool(names) and names[0] == "self"
    for module, tree in trees.items():
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            callee = call.func
            called = callee.attr if isinstance(callee, ast.Attribute) else \
                callee.id if isinstance(callee, ast.Name) else None
            if called != function.name:
                continue
            position = index - 1 if method and isinstance(callee, ast.Attribute) else index
            given = [k.value for k in call.keywords if k.arg == parameter]
            if position < len(call.args):
                given.append(call.args[position])
            for value in given:
                yield module, value


def key_lists() -> dict[str, tuple[str, ...]]:
    """Every list of keys an "unknown key" error is checked against, by where it is."""
    trees = {p.stem: ast.parse(p.read_text(), str(p)) for p in _modules()}
    found: list[tuple[str, ast.expr]] = []
    for module, tree in trees.items():
        parents = _parents(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.If) and _reports_unknown(node)):
                continue
            for compared in _compared_with(node.test):
                function = _enclosing_function(node, parents)
                params = [a.arg for a in function.args.args] if function else []
                if isinstance(compared, ast.Name) and compared.id in params:
                    assert function is not None
                    found += _call_arguments(trees, function, compared.id)
                else:
                    found.append((module, compared))
    lists: dict[str, tuple[str, ...]] = {}
    for module, expr in found:
        if isinstance(expr, ast.Constant) and expr.value is None:
            continue                          # a free-form object: any key
        namespace: dict[str, Any] = vars(importlib.import_module(f"llmproxy.config.{module}"))
        value = eval(compile(ast.Expression(expr), module, "eval"), dict(namespace))
        keys = (value,) if isinstance(value, str) else tuple(value)
        assert keys and all(isinstance(k, str) for k in keys), (module, ast.unparse(expr))
        lists[f"{module}:{ast.unparse(expr)}"] = keys
    return lists


_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*(?:\{#[^}]*\})?\s*$")
_KEY_ROW = re.compile(r"^\|\s*`([^`]+)`")


def documented() -> dict[str, set[str]]:
    """The keys of each heading's tables on the page: heading -> keys."""
    out: dict[str, set[str]] = {}
    heading, fenced = "", False
    for line in PAGE.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if m := _HEADING.match(line):
            heading = m.group(1)
        elif m := _KEY_ROW.match(line):
            out.setdefault(heading, set()).add(m.group(1))
    return out


def test_every_key_list_of_the_parser_has_a_section() -> None:
    """A key list the parser gains (or renames) needs its heading in SECTIONS."""
    found = key_lists()
    assert set(found) == set(SECTIONS), (
        "key lists without a section of docs/configuration.md: "
        f"{sorted(set(found) - set(SECTIONS))}; sections whose list is gone: "
        f"{sorted(set(SECTIONS) - set(found))}")


def test_the_page_documents_exactly_the_accepted_keys() -> None:
    """Every accepted key is on the page under its heading, and nothing else is."""
    accepted: dict[str, set[str]] = {}
    for where, keys in key_lists().items():
        if where in SECTIONS:
            accepted.setdefault(SECTIONS[where], set()).update(keys)
    on_page = documented()
    problems = []
    for heading in sorted(set(accepted) | set(on_page)):
        missing = accepted.get(heading, set()) - on_page.get(heading, set())
        extra = on_page.get(heading, set()) - accepted.get(heading, set())
        if missing:
            problems.append(f'"{heading}": not documented: {", ".join(sorted(missing))}')
        if extra:
            problems.append(f'"{heading}": documented, but the parser does not accept: '
                            f'{", ".join(sorted(extra))}')
    assert not problems, "docs/configuration.md and the parser differ:\n" + "\n".join(problems)
