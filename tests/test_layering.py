"""Imports flow one way: formats -> casting -> scaling -> stats -> {policy, optim, fp8} -> studies.

The test reads every module of ``fmtkit``, ``pallas_kernels``, ``studies`` and ``tools`` with
``ast``
(nothing is imported, so lazy imports inside functions count too) and checks each
first-party import against ``ALLOWED``: the table of which unit may import which. A unit is a
module, or a package taken as a whole (``fmtkit.policy``, ``fmtkit.optim``,
``pallas_kernels``, ``studies``); imports inside one unit are free. ``pallas_kernels`` is a
GEMM backend on top of the core; ``studies`` (with the ``fmtkit`` command line,
``studies.app.cli``) is the application on top of everything, and nothing imports it.
``tools`` (the GPU check, ``python3 -m tools.gpu_check``) is a repository tool beside the
application: it imports the core, the kernels and the studies' libraries (``studies.lib``:
the timing loop, the environment, the results writer; never the reverse), runs the
``fmtkit`` command line as a command and never imports the application or a study; nothing
imports ``tools``.

Inside ``studies``, the libraries sit below the rest: ``studies.lib`` (models, corpus,
regimes, statistics, common) and ``studies.training`` (the training engine) never import the
application (``studies.app``), a study or a benchmark. ``studies.lib.models`` (the studies'
reference models) is a leaf of its own: it imports no other module of ``studies`` (nor
``pallas_kernels``), so the core's tests can use the same models without the application.

The tests follow the same order: only ``tests/studies`` tests the application, so no other
test file imports ``studies`` or runs one of its modules (``python -m studies.app.cli``); the
one exception is ``studies.lib.models``, which the test zoo (``tests/policy/zoo.py``) imports
so that the core's tests and the studies train one transformer, not two copies of it.

The low-precision GEMMs live in one private package, ``fmtkit._lowp``, on the core only (it
never imports the policy, a kernel package or its own faces); its two public faces
``fmtkit.fp8`` and ``fmtkit.fp4`` re-export it and import nothing of each other, and every
unit above them imports the faces, never the private package.

Also checked: no module imports a private name (``from m import _x``) of another module, and
no module imports a private module of another package (``fmtkit.optim._master`` from
``fmtkit.memory``). Inside a package, its private modules (``pallas_kernels._backend``) are
the "internal module meant for it" and may be imported by its other modules.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fmtkit", "pallas_kernels", "studies", "tools")

# The statistics of a tensor and of its quantization are core: every unit above reports them.
# The private switches (fmtkit._switches) are read by every unit of the library that has one.
CORE = ("fmtkit.formats", "fmtkit.casting", "fmtkit.scaling", "fmtkit.stats", "fmtkit._switches")
LIBRARY = ("fmtkit", "fmtkit.telemetry", "fmtkit.distributed", "fmtkit.fp8", "fmtkit.fp4",
           "fmtkit.optim", "fmtkit.policy", "fmtkit.memory")
ALLOWED: dict[str, set[str]] = {
    # unit: the units it may import (besides itself and third-party packages)
    "fmtkit.formats": set(),
    "fmtkit._switches": set(),
    "fmtkit.casting": {"fmtkit.formats"},
    "fmtkit.scaling": {"fmtkit.formats", "fmtkit.casting"},
    "fmtkit.stats": {"fmtkit.formats", "fmtkit.casting", "fmtkit.scaling"},
    "fmtkit.telemetry": {*CORE},
    "fmtkit.distributed": {*CORE},
    # The low-precision GEMMs (FP8 and FP4), private; the policy places their recipes on
    # modules, never the reverse.
    "fmtkit._lowp": {*CORE},
    # Its two public faces, equal: each re-exports the private package, neither the other.
    "fmtkit.fp8": {*CORE, "fmtkit._lowp"},
    "fmtkit.fp4": {*CORE, "fmtkit._lowp"},
    "fmtkit.optim": {*CORE},
    # Policies place FP8 recipes on modules: policy -> fp8, never the reverse. The package's
    # public modules (rules, plans, the op table, reports) sit on its two groups: the engine
    # (trace, analysis, interpreter, handlers) and the frontends (linen, NNX, functions), which
    # run on the engine; the engine never imports a frontend.
    "fmtkit.policy": {*CORE, "fmtkit.fp8", "fmtkit.fp4", "fmtkit.policy._engine",
                      "fmtkit.policy._frontends"},
    "fmtkit.policy._engine": {*CORE, "fmtkit.fp8", "fmtkit.fp4", "fmtkit.policy"},
    "fmtkit.policy._frontends": {*CORE, "fmtkit.fp8", "fmtkit.fp4", "fmtkit.policy",
                                 "fmtkit.policy._engine"},
    "fmtkit.memory": {*CORE, "fmtkit.optim", "fmtkit.fp4"},
    # The qwix provider and QArray converters (optional dependency qwix): fp8 under qwix.
    "fmtkit.qwix": {*CORE, "fmtkit.fp8"},
    # Per-GEMM statistics and overrides, built on the policy's GEMM hook: debug -> policy.
    "fmtkit.debug": {*CORE, "fmtkit.fp8", "fmtkit.fp4", "fmtkit.policy"},
    # The deprecated former path of fmtkit.debug.log, re-exporting it.
    "fmtkit.debuglog": {"fmtkit.debug"},
    # The package facade re-exports the public names of every core module.
    "fmtkit": {*CORE, "fmtkit.telemetry", "fmtkit.distributed", "fmtkit.fp8", "fmtkit.fp4",
               "fmtkit.optim",
               "fmtkit.policy", "fmtkit.memory"},
    # A GEMM backend: the core (quantizers, formats) and fp8's backend registry (through the
    # public face), nothing above.
    "pallas_kernels": {*CORE, "fmtkit.fp8"},
    # The studies' models, the one studies module the core tests import: a leaf (the core at
    # most, no other studies module, no kernels).
    "studies.lib.models": {*CORE, "fmtkit", "fmtkit.telemetry", "fmtkit.distributed",
                           "fmtkit.fp8", "fmtkit.fp4", "fmtkit.optim", "fmtkit.policy",
                           "fmtkit.memory"},
    # The studies' shared libraries: the library, never the application (studies.app) nor a
    # study.
    "studies.lib": {*CORE, *LIBRARY, "studies.lib.models"},
    # The training engine the language-model studies share: the libraries below it.
    "studies.training": {*CORE, *LIBRARY, "studies.lib", "studies.lib.models"},
    # The application, the studies and the benchmarks: anything below them.
    "studies": {*CORE, *LIBRARY, "fmtkit.debug", "pallas_kernels", "studies.lib.models",
                "studies.lib", "studies.training"},
    # Repository tools: the core, the kernels and the studies' libraries (timing, environment,
    # results writer); the application only as a command.
    "tools": {*CORE, "fmtkit", "fmtkit.telemetry", "fmtkit.distributed", "fmtkit.fp8",
              "fmtkit.fp4", "fmtkit.optim", "fmtkit.policy", "fmtkit.memory", "pallas_kernels",
              "studies.lib"},
}

KNOWN_EDGES: dict[tuple[str, str], str] = {
    # Known violations, each with its reason; none today.
}

PENDING_PRIVATE: dict[tuple[str, str], str] = {
    # Private names imported across modules while their owners make them public; none today.
}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the first-party packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _unit(module: str) -> str:
    """The unit of the table a module belongs to: its longest prefix in ``ALLOWED``."""
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in ALLOWED:
            return ".".join(parts[:k])
    raise KeyError(module)


def _imports(module: str, path: Path) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every first-party import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: resolve against this module's package
                pkg = module.split(".")
                pkg = pkg if is_pkg else pkg[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in MODULES:  # `from pkg import submodule`
                    out.append((sub, None, node.lineno))
                else:
                    out.append((base, a.name, node.lineno))
    return [(m, n, line) for m, n, line in out if m.split(".")[0] in PACKAGES]


def _private_module(target: str) -> str | None:
    """The first private component's module path of ``target`` (``fmtkit.optim._master``)."""
    parts = target.split(".")
    for k, p in enumerate(parts):
        if p.startswith("_") and not p.startswith("__"):
            return ".".join(parts[:k + 1])
    return None


def test_every_module_is_in_the_table():
    assert len(MODULES) > 30  # the walk found the packages
    missing = []
    for m in MODULES:
        try:
            _unit(m)
        except KeyError:
            missing.append(m)
    assert not missing, f"modules without a layer: {missing}; add them to ALLOWED"
    # A package is one unit with its submodules (the low-precision concepts are the modules of
    # the private package fmtkit._lowp), and its faces are units of their own.
    assert "fmtkit._lowp.gemm" in MODULES and _unit("fmtkit._lowp.gemm") == "fmtkit._lowp"
    assert _unit("fmtkit.fp8") == "fmtkit.fp8" and _unit("fmtkit.fp4") == "fmtkit.fp4"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layer_order(module):
    unit = _unit(module)
    bad = []
    for target, _, line in _imports(module, MODULES[module]):
        t_unit = _unit(target)
        if t_unit == unit or t_unit in ALLOWED[unit] or (unit, t_unit) in KNOWN_EDGES:
            continue
        bad.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} "
                   f"({unit} -> {t_unit}; allowed: {sorted(ALLOWED[unit]) or 'nothing'})")
    assert not bad, "\n".join(bad)


def _private_imports(module: str, path: Path) -> list[str]:
    """Where ``module`` (read from ``path``) imports a private name or another package's
    private module."""
    bad = []
    for target, name, line in _imports(module, path):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"
        private = _private_module(target)
        if (_unit(module), _unit(target)) in KNOWN_EDGES:
            continue
        if private is not None and (module, private) not in PENDING_PRIVATE:
            pkg = private.rsplit(".", 1)[0]  # a private module is internal to its package
            if module != pkg and not module.startswith(pkg + "."):
                bad.append(f"{where} imports the private module {private} of another package")
        if name is not None and name.startswith("_") and not name.startswith("__") \
                and (module, name) not in PENDING_PRIVATE:
            bad.append(f"{where} imports the private name {name} from {target}")
    return bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules(module):
    bad = _private_imports(module, MODULES[module])
    assert not bad, "\n".join(bad)


def test_the_checker_sees_violations(tmp_path):
    # The two checks on a module written to break them: the test cannot pass vacuously.
    path = tmp_path / "bad.py"
    path.write_text("import studies.lm.ablate\nfrom fmtkit.casting import _FP6\n"
                    "def f():\n    from fmtkit.optim._master import x\n")
    found = _imports("fmtkit.scaling", path)
    assert ("studies.lm.ablate", None, 1) in found
    assert ("fmtkit.casting", "_FP6", 2) in found
    assert ("fmtkit.optim._master", "x", 4) in found  # lazy imports count
    assert _unit("studies.lm.ablate") not in ALLOWED["fmtkit.scaling"]
    assert _private_module("fmtkit.optim._master") == "fmtkit.optim._master"
    # The private package fmtkit._lowp: its faces may import it, and inside it a private name
    # stays private to its module; another package's module (a kernel) may not import it,
    # and the layer table keeps it below its faces (the policy, debug, qwix, the kernels,
    # the studies and the tools import fmtkit.fp8 and fmtkit.fp4 only; neither face imports
    # the other; the private package never imports the policy).
    faces = tmp_path / "faces.py"
    faces.write_text("from fmtkit._lowp.recipes import Fp4Recipe\n"
                     "from fmtkit.optim._master import x\n"
                     "from fmtkit._lowp.operands import _quantize\n")
    inside = [f"{faces}:2 imports the private module fmtkit.optim._master of another package",
              f"{faces}:3 imports the private name _quantize from fmtkit._lowp.operands"]
    assert _private_imports("fmtkit.fp4", faces) == inside
    assert _private_imports("fmtkit._lowp.dot", faces) == inside
    outside = "imports the private module fmtkit._lowp of another package"
    assert _private_imports("pallas_kernels.grouped_fp8_matmul", faces) == [
        f"{faces}:1 {outside}", inside[0], f"{faces}:3 {outside}", inside[1]]
    for unit in ("fmtkit.policy", "fmtkit.debug", "fmtkit.qwix", "fmtkit.memory", "fmtkit",
                 "pallas_kernels", "studies", "tools"):
        assert _unit("fmtkit._lowp.recipes") not in ALLOWED[unit], unit
    assert "fmtkit.fp8" not in ALLOWED["fmtkit.fp4"] and "fmtkit.fp4" not in ALLOWED["fmtkit.fp8"]
    assert ALLOWED["fmtkit._lowp"] == set(CORE) and "fmtkit.policy" not in ALLOWED["fmtkit._lowp"]

def test_the_policy_engine_never_imports_a_frontend(tmp_path):
    assert "fmtkit.policy._frontends" not in ALLOWED["fmtkit.policy._engine"]
    engine = [m for m in MODULES if _unit(m) == "fmtkit.policy._engine"]
    frontends = [m for m in MODULES if _unit(m) == "fmtkit.policy._frontends"]
    assert "fmtkit.policy._engine.interpreter" in engine and len(frontends) >= 3
    bad = [f"{m} imports {t}" for m in engine for t, _, _ in _imports(m, MODULES[m])
           if _unit(t) == "fmtkit.policy._frontends"]
    assert not bad, "\n".join(bad)
    # The jaxpr helpers are a leaf: they import nothing of the policy package.
    leaf = "fmtkit.policy._engine.jaxprs"
    assert not [t for t, _, _ in _imports(leaf, MODULES[leaf]) if t.startswith("fmtkit.policy")]
    # A lazy import of a frontend from the engine is caught.
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from fmtkit.policy._frontends import nnx\n")
    (target, _, _), = _imports("fmtkit.policy._engine.trace", path)
    assert _unit(target) not in ALLOWED["fmtkit.policy._engine"]


def _module_of(target: str) -> str | None:
    """The module of ``MODULES`` an import names (a name imported from it: its module)."""
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target if target in MODULES else None


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_policy_package_has_no_import_circle():
    # Every import counts: module level, lazy, and under TYPE_CHECKING (type-only circles
    # too). A package imports its own submodules, so only module -> module edges are kept.
    policy = [m for m in MODULES if m.startswith("fmtkit.policy.")]
    edges = {m: {t for t in (_module_of(t) for t, _, _ in _imports(m, MODULES[m]))
                 if t in policy and t != m} for m in policy}
    assert len(policy) > 15
    assert not _cycles(edges), _cycles(edges)
    # The check sees a circle.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


TESTS = ROOT / "tests"


def _uses_of_studies(path: Path) -> list[tuple[int, str]]:
    """``(line, what)`` wherever a test file imports ``studies`` (lazy imports count) or starts
    one of its modules in a subprocess (``"-m", "studies..."`` in a list or tuple)."""
    out = [(line, f"imports {target}") for target, _, line in _imports("tests", path)
           if target.split(".")[0] == "studies"]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.List, ast.Tuple)):
            args = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            out += [(node.lineno, f"runs -m {b}") for a, b in itertools.pairwise(args)
                    if a == "-m" and isinstance(b, str) and b.split(".")[0] == "studies"]
    return sorted(out)


TESTS_MAY_IMPORT = "studies.lib.models"
"""The one module of ``studies`` tests outside ``tests/studies`` may import (a leaf)."""


def _test_files_outside_studies() -> list[Path]:
    return [p for p in sorted(TESTS.rglob("*.py")) if (TESTS / "studies") not in p.parents]


def test_only_the_studies_tests_use_studies():
    files = _test_files_outside_studies()
    assert len(files) > 30 and (TESTS / "policy" / "zoo.py") in files  # the walk found them
    allowed = f"imports {TESTS_MAY_IMPORT}"
    bad = [f"{path.relative_to(ROOT)}:{line} {what}"
           for path in files for line, what in _uses_of_studies(path) if what != allowed]
    assert not bad, ("\n".join(bad) + "\nmove the test under tests/studies, or build its "
                     f"model from the test zoo (tests/policy/zoo.py, {TESTS_MAY_IMPORT})")
    # The zoo's reference models are the studies' own (one source, not a copy).
    assert allowed in {what for _, what in _uses_of_studies(TESTS / "policy" / "zoo.py")}


def test_the_models_the_tests_share_are_a_leaf():
    # studies.lib.models imports nothing of studies (nor the kernels), so a core test importing
    # it does not import the application.
    assert _unit(TESTS_MAY_IMPORT) == TESTS_MAY_IMPORT
    found = [target for target, _, _ in _imports(TESTS_MAY_IMPORT, MODULES[TESTS_MAY_IMPORT])]
    assert not [t for t in found if t.split(".")[0] in ("studies", "pallas_kernels")], found
    assert not ALLOWED[TESTS_MAY_IMPORT] & {"studies", "pallas_kernels"}


def test_the_studies_check_sees_uses(tmp_path):
    # The check on a file written to break it, and on a studies test (found, and exempt).
    studies_test = TESTS / "studies" / "test_cli.py"
    assert _uses_of_studies(studies_test)
    assert studies_test not in _test_files_outside_studies()
    bad = tmp_path / "test_bad.py"
    bad.write_text("import sys\nfrom studies.lib import models\nimport fmtkit\n"
                   "def f():\n    import studies.training as T\n"
                   "CMD = [sys.executable, '-m', 'studies.app.cli', 'run']\n"
                   "OK = ('-m', 'pytest', 'studies')\nfrom studies.lib.models import lm_loss\n")
    assert _uses_of_studies(bad) == [
        (2, "imports studies.lib.models"), (5, "imports studies.training"),
        (6, "runs -m studies.app.cli"), (8, "imports studies.lib.models")]


def test_nothing_imports_the_tools():
    # No package unit may import tools, and no test but the tools' own imports it.
    assert [u for u in ALLOWED if "tools" in ALLOWED[u]] == []
    assert any(m.startswith("tools.gpu_check.") for m in MODULES)  # the walk found them
    assert "studies" not in ALLOWED["tools"] and "pallas_kernels" in ALLOWED["tools"]
    assert {u for u in ALLOWED["tools"] if u.startswith("studies")} == {"studies.lib"}
    outside = [p for p in sorted(TESTS.rglob("*.py")) if (TESTS / "tools") not in p.parents]
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}" for path in outside
           for target, _, line in _imports("tests", path) if target.split(".")[0] == "tools"]
    assert not bad, "\n".join(bad)


STUDIES_LIBRARIES = ("studies.lib", "studies.lib.models", "studies.training")
"""The units of the studies' libraries; ``studies`` (the rest: ``studies.app``, the studies,
the benchmarks) sits above them."""


def test_the_studies_libraries_never_import_the_application(tmp_path):
    # The table never lets a library reach the unit of the application, the studies and the
    # benchmarks; test_imports_follow_the_layer_order holds every module to it.
    assert all("studies" not in ALLOWED[lib] for lib in STUDIES_LIBRARIES)
    libs = {m for m in MODULES if _unit(m) in STUDIES_LIBRARIES}
    assert {"studies.lib.common", "studies.lib.regimes", "studies.training.loop"} <= libs
    assert _unit("studies.app.runner") == _unit("studies.numerics.rounding") == "studies"
    # A library module that imports the application is caught.
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from studies.app import runner\n")
    (target, _, _), = _imports("studies.lib.stats", path)
    assert target == "studies.app.runner"
    assert _unit(target) not in ALLOWED[_unit("studies.lib.stats")]
