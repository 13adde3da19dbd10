"""No import circles among the modules of ``fmtkit``, ``pallas_kernels``, ``studies`` and
``tools``: the graph of their first-party imports has no cycle.

Every import counts, wherever it is written (read with ``ast`` by ``tests/test_layering.py``'s
walk; nothing is imported): at module level, under ``if TYPE_CHECKING:`` (a type-only
import is a dependency too, and a circle of them is one refactoring away from a circular
import at run time) and inside a function (a lazy import written to dodge a circular import
hides the circle rather than removing it). An import names a module, or a name of a module
(``from fmtkit.fp8 import RECIPES`` is an edge to the package ``fmtkit.fp8``, whose
``__init__`` defines it). A circle is a strongly connected component of the graph; the
failure message lists, for each, its cycles as paths with the file, line and kind of each
import.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
from test_layering import MODULES, ROOT, _imports

KNOWN_CYCLES: list[tuple[str, ...]] = [
    # Circles allowed for now, each as its sorted modules with the reason; none today.
]

MAX_PATHS = 10
"""Cycles printed per circle (a circle of n modules can hold many)."""


def _kinds(path: Path) -> dict[int, str]:
    """``{line: kind}`` of every import statement in ``path``: "module", "type-only" (under
    ``if TYPE_CHECKING:``) or "lazy" (inside a function)."""
    out: dict[int, str] = {}
    blocks = (ast.stmt, ast.excepthandler, ast.match_case)  # imports are statements

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out[node.lineno] = kind
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = "lazy"
        if isinstance(node, ast.If) and kind == "module" and _is_type_checking(node.test):
            for child in node.body:
                visit(child, "type-only")
            for child in node.orelse:
                visit(child, kind)
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, blocks):
                visit(child, kind)

    visit(ast.parse(path.read_text(), filename=str(path)), "module")
    return out


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, list[str]]]:
    """``{module: {imported module: ["file:line (kind)", ...]}}`` among ``modules``; an import
    of a name resolves to the longest prefix of its path that is one of ``modules``."""
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in modules}
    for module, path in modules.items():
        kinds = _kinds(path)
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for target, name, line in _imports(module, path):
            if name is not None and f"{target}.{name}" in modules:  # `from pkg import module`
                target = f"{target}.{name}"
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != module:
                at = f"{where}:{line} ({kinds.get(line, 'module')})"
                if at not in graph[module].setdefault(target, []):  # one per statement
                    graph[module][target].append(at)
    return graph


def circles(graph: dict[str, dict[str, list[str]]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
                out.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(out)


def cycle_paths(graph: dict[str, dict[str, list[str]]], circle: tuple[str, ...],
                limit: int = MAX_PATHS) -> list[str]:
    """Up to ``limit`` elementary cycles of ``circle``, each as a path
    ``a -> b [file:line (kind)] -> ... -> a``, each cycle once (from its smallest module)."""
    members = set(circle)
    paths: list[str] = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if len(paths) >= limit or nxt not in members or nxt < start:
                continue
            if nxt == start:
                hops = [*path, start]
                paths.append(hops[0] + "".join(
                    f" -> {b} [{'; '.join(graph[a][b])}]" for a, b in itertools.pairwise(hops)))
            elif nxt not in path:
                walk(start, nxt, [*path, nxt])

    for start in circle:
        walk(start, start, [start])
    return paths


def _report(graph, found: list[tuple[str, ...]]) -> str:
    return "\n".join(f"import circle among {', '.join(c)}:\n  "
                     + "\n  ".join(cycle_paths(graph, c)) for c in found)


def problems(graph: dict[str, dict[str, list[str]]], known: list[tuple[str, ...]]) -> list[str]:
    """The circles of ``graph`` not in ``known``, with their cycles, and the circles of
    ``known`` that ``graph`` no longer has ([]: none)."""
    found = circles(graph)
    new = [c for c in found if c not in known]
    gone = [c for c in known if c not in found]
    out = [_report(graph, new)] if new else []
    if gone:
        out.append("KNOWN_CYCLES lists circles that no longer exist (remove them):\n  "
                   + "\n  ".join(", ".join(c) for c in gone))
    return out


@pytest.mark.slow
def test_no_import_cycles():
    assert len(MODULES) > 30 and "fmtkit._lowp.gemm" in MODULES  # the walk found the packages
    found = problems(import_graph(MODULES), KNOWN_CYCLES)
    assert not found, "\n".join(found)


def _write(tmp_path: Path, sources: dict[str, str]) -> dict[str, Path]:
    """Synthetic modules ``{name: source}`` as files; ``{name: path}``."""
    out = {}
    for name, source in sources.items():
        path = tmp_path / f"{name.replace('.', '_')}.py"
        path.write_text(source)
        out[name] = path
    return out


def test_the_checker_sees_type_only_and_lazy_circles(tmp_path):
    # Negative controls: a circle closed by an import under `if TYPE_CHECKING:` only, one
    # closed by an import inside a function, and a chain without a circle.
    type_only = _write(tmp_path, {
        "fmtkit.ta": "from fmtkit.tb import B\n",
        "fmtkit.tb": ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from fmtkit.ta import A\n"),
    })
    graph = import_graph(type_only)
    assert graph["fmtkit.tb"] == {"fmtkit.ta": [f"{type_only['fmtkit.tb']}:4 (type-only)"]}
    assert circles(graph) == [("fmtkit.ta", "fmtkit.tb")]
    [path] = cycle_paths(graph, ("fmtkit.ta", "fmtkit.tb"))
    assert path == (f"fmtkit.ta -> fmtkit.tb [{type_only['fmtkit.ta']}:1 (module)] -> fmtkit.ta "
                    f"[{type_only['fmtkit.tb']}:4 (type-only)]")

    lazy = _write(tmp_path, {
        "fmtkit.la": "import fmtkit.lb\n",
        "fmtkit.lb": "import typing\nif typing.TYPE_CHECKING:\n    pass\n"
                     "def f():\n    from fmtkit import la\n",
        "fmtkit.lc": "from fmtkit.la import x\n",  # into the circle, not part of it
    })
    graph = import_graph(lazy)
    assert graph["fmtkit.lb"] == {"fmtkit.la": [f"{lazy['fmtkit.lb']}:5 (lazy)"]}
    assert circles(graph) == [("fmtkit.la", "fmtkit.lb")]

    chain = _write(tmp_path, {"fmtkit.ca": "import fmtkit.cb\n", "fmtkit.cb": "import jax\n"})
    assert circles(import_graph(chain)) == []

    # The comparison with KNOWN_CYCLES: a circle not listed fails, and so does a listed one
    # that is gone.
    [new] = problems(import_graph(type_only), known=[])
    assert new.startswith("import circle among fmtkit.ta, fmtkit.tb:\n  fmtkit.ta -> ")
    assert problems(import_graph(type_only), known=[("fmtkit.ta", "fmtkit.tb")]) == []
    [gone] = problems(import_graph(chain), known=[("fmtkit.ca", "fmtkit.cb")])
    assert "no longer exist" in gone and gone.endswith("fmtkit.ca, fmtkit.cb")


def test_every_cycle_of_a_circle_is_printed(tmp_path):
    # a -> b -> a and a -> c -> b -> a: one circle, two cycles, each named with its imports.
    mods = _write(tmp_path, {
        "fmtkit.a": "import fmtkit.b\nimport fmtkit.c\n",
        "fmtkit.b": "import fmtkit.a\n",
        "fmtkit.c": "from fmtkit.b import x\n",
    })
    graph = import_graph(mods)
    assert circles(graph) == [("fmtkit.a", "fmtkit.b", "fmtkit.c")]
    assert [p.split(" [")[0] + " ..." for p in cycle_paths(graph, circles(graph)[0])] == [
        "fmtkit.a -> fmtkit.b ...", "fmtkit.a -> fmtkit.c ..."]
    report = _report(graph, circles(graph))
    assert "fmtkit.a -> fmtkit.c [" in report and "-> fmtkit.b [" in report
