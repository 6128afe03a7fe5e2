"""The package's architecture, checked: the layers of pyproject's import-linter contract (CI
also runs ``lint-imports``), no import cycle, function-level imports included, every
function-level import marked with why it must be lazy, and modules small enough to read.

The checks are pure functions of an import graph, read from the sources with ``ast``
(``TYPE_CHECKING`` blocks excluded); each has a negative control on a graph that breaks it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from tests.support import ROOT

SRC = ROOT / "src" / "fsdp_precision"
MAX_LINES = 400


@dataclass(frozen=True)
class Import:
    """One import of a package module by another."""

    source: str
    target: str
    line: int
    lazy: bool  # inside a function
    reason: str  # the ``# lazy: ...`` comment on its line or the line above ("" if none)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in SRC.rglob("*.py")}


def _targets(node: ast.ImportFrom | ast.Import, source: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        assert node.level == 0, f"{source}: relative import (the package imports absolutely)"
        base = node.module or ""
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
        names = subs if len(subs) == len(node.names) else [base, *subs]
    out = []
    for name in names:
        if not name.startswith("fsdp_precision"):
            continue
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name != source:
            out.append(name)
    return out


def read_imports(*, external: bool = False, type_checking: bool = False) -> list[Import]:
    """Every import between the package's modules (``TYPE_CHECKING`` blocks excluded unless
    ``type_checking``); with ``external``, function-level imports of other packages too (as
    ``Import``s whose target is the imported module)."""
    modules = _modules()
    found: list[Import] = []
    for source, path in modules.items():
        text = path.read_text()
        tree = ast.parse(text)
        found.extend(
            _visit(tree, source, text.splitlines(), modules, external, False, type_checking)
        )
    return found


def _visit(
    node: ast.AST,
    source: str,
    lines: list[str],
    modules: dict[str, Path],
    external: bool,
    lazy: bool,
    type_checking: bool = False,
) -> Iterator[Import]:
    for child in ast.iter_child_nodes(node):
        if (
            isinstance(child, ast.If)
            and "TYPE_CHECKING" in ast.unparse(child.test)
            and not type_checking
        ):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            near = " ".join(lines[max(child.lineno - 2, 0) : child.lineno])
            reason = near.partition("# lazy:")[2].strip()
            for target in _targets(child, source, modules):
                yield Import(source, target, child.lineno, lazy, reason)
            if external and lazy:
                names = (
                    [child.module or ""]
                    if isinstance(child, ast.ImportFrom)
                    else [a.name for a in child.names]
                )
                for name in names:
                    if not name.startswith("fsdp_precision"):
                        yield Import(source, name, child.lineno, True, reason)
        function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
        yield from _visit(child, source, lines, modules, external, lazy or function, type_checking)


def layers() -> list[list[str]]:
    """The layers of pyproject's import-linter contract, top first (siblings in one list)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [[name.strip() for name in layer.split("|")] for layer in contract["layers"]]


def _layer_of(module: str, stack: list[list[str]]) -> int | None:
    for index, siblings in enumerate(stack):
        if any(module == s or module.startswith(s + ".") for s in siblings):
            return index
    return None


def upward(imports: list[Import], stack: list[list[str]]) -> list[Import]:
    """Imports from a lower layer into a higher one, or between siblings of one layer."""
    bad = []
    for imp in imports:
        a, b = _layer_of(imp.source, stack), _layer_of(imp.target, stack)
        if a is None or b is None:
            continue
        sibling = a == b and not any(
            imp.source.startswith(s) and imp.target.startswith(s) for s in stack[a]
        )
        if b < a or sibling:
            bad.append(imp)
    return bad


def cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


# ------------------------------------------------------------------ the package


def test_every_package_module_is_in_a_layer() -> None:
    stack = layers()
    outside = [m for m in _modules() if m != "fsdp_precision" and _layer_of(m, stack) is None]
    assert outside == []


def test_imports_go_only_downward() -> None:
    bad = upward(read_imports(), layers())
    assert bad == [], [f"{i.source}:{i.line} imports {i.target}" for i in bad]


def test_no_import_cycle_function_level_imports_included() -> None:
    assert cycles(read_imports()) == []


def test_no_circle_through_type_checking_imports() -> None:
    """A module that names a type of a module importing it (``plan.py`` imports ``report.py``,
    whose signatures name ``PrecisionPlan``) is a circle the runtime graph hides: the data
    knows its reports. The plan's data lives below what reads it (issue 48)."""
    assert cycles(read_imports(type_checking=True)) == []


def test_every_function_level_import_says_why_it_is_lazy() -> None:
    """Only where it must be: no FSDP2 internal before the source hashes matched, an optional
    dependency, a command's own imports; each says which, in a ``# lazy:`` comment."""
    unmarked = [i for i in read_imports(external=True) if i.lazy and not i.reason]
    assert unmarked == [], [f"{i.source}:{i.line} imports {i.target}" for i in unmarked]


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: module_name(p))
def test_modules_are_small_enough_to_read(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES


# ------------------------------------------------------------------ negative controls


def _imp(source: str, target: str, *, lazy: bool = False, reason: str = "") -> Import:
    return Import(source, target, 1, lazy, reason)


def test_an_upward_import_is_caught() -> None:
    stack = [["pkg._top"], ["pkg._a", "pkg._b"], ["pkg._low"]]
    assert upward([_imp("pkg._top.x", "pkg._low.y")], stack) == []
    assert len(upward([_imp("pkg._low.y", "pkg._top.x")], stack)) == 1  # upward
    assert len(upward([_imp("pkg._a.m", "pkg._b.n")], stack)) == 1  # between siblings
    assert upward([_imp("pkg._a.m", "pkg._a.n")], stack) == []  # within one package


def test_a_cycle_through_a_function_level_import_is_caught() -> None:
    graph = [_imp("a", "b"), _imp("b", "c"), _imp("c", "a", lazy=True, reason="x")]
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles(graph[:2]) == []
