"""The path of the rules goes forward: frontend -> plan resolution -> engine (``_apply``'s
docstring lists the stops). Structural checks on the sources, no model traced."""

import ast
import inspect
import pathlib

import fmtkit.policy
from fmtkit.policy._engine.interpreter import Interpreter
from fmtkit.policy._engine.runner import fp8_slots, run
from fmtkit.policy._plan import Plan

POLICY = pathlib.Path(fmtkit.policy.__file__).parent
# What only the plan module may call: the resolution and its checks (``_plan.resolve_rules``).
RESOLVING = {"of", "report_unmatched", "check_param_dtypes"}


def _sources(folder: str) -> dict[str, ast.Module]:
    return {str(p.relative_to(POLICY / folder)): ast.parse(p.read_text())
            for p in sorted((POLICY / folder).rglob("*.py"))}


def _plan_imports(tree: ast.Module) -> list[str]:
    """What a module imports from ``fmtkit.policy._plan`` (the module itself: ``"*module"``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "fmtkit.policy._plan":
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "fmtkit.policy":
            out += ["*module" for a in node.names if a.name == "_plan"]
        elif isinstance(node, ast.Import):
            out += ["*module" for a in node.names if a.name == "fmtkit.policy._plan"]
    return out


def _called(tree: ast.Module) -> set[str]:
    """The functions and methods a module calls: ``f`` for ``f(...)`` and ``x.f(...)``, and
    ``x.f`` too when ``x`` is a name (``runner.run``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute):
                out.add(f.attr)
                if isinstance(f.value, ast.Name):
                    out.add(f"{f.value.id}.{f.attr}")
            elif isinstance(f, ast.Name):
                out.add(f.id)
    return out


def test_the_engine_takes_the_plan_whole():
    engine = _sources("_engine")
    assert {"trace.py", "runner.py", "interpreter.py"} <= set(engine)
    bad = {name: imported for name, tree in engine.items()
           if (imported := [n for n in _plan_imports(tree) if n != "Plan"])}
    assert not bad, bad
    bad = {name: _called(tree) & (RESOLVING | {"resolve_rules"}) for name, tree in engine.items()}
    assert not any(bad.values()), bad
    # The entry points and the interpreter receive the plan as an argument.
    for fn in (run, fp8_slots, Interpreter.__init__):
        assert inspect.signature(fn).parameters["plan"].annotation == "Plan", fn
    assert Plan.__module__ == "fmtkit.policy._plan"


def test_each_frontend_resolves_through_resolve_only():
    frontends = _sources("_frontends")
    for name in ("linen.py", "nnx.py", "functions.py"):
        called = _called(frontends[name])
        assert {"resolve_rules", "trace.trace", "runner.run"} <= called, name
        assert not called & RESOLVING, (name, called & RESOLVING)
    # Outside the plan module, nothing in the package resolves or checks on its own.
    outside = {str(p.relative_to(POLICY)): ast.parse(p.read_text())
               for p in sorted(POLICY.rglob("*.py")) if p.name != "_plan.py"}
    bad = {name: _called(tree) & RESOLVING for name, tree in outside.items()
           if _called(tree) & RESOLVING}
    assert not bad, bad


def test_the_checks_notice_a_step_back():
    # Negative controls: an engine module importing the resolution, and a frontend calling a
    # check of the plan itself, are noticed.
    engine = ast.parse("from fmtkit.policy._plan import Plan, resolve_rules\n"
                       "import fmtkit.policy._plan\n")
    assert [n for n in _plan_imports(engine) if n != "Plan"] == ["resolve_rules", "*module"]
    frontend = ast.parse("plan = resolve_rules(rules, mods)\nplan.report_unmatched(True)\n")
    assert _called(frontend) & RESOLVING == {"report_unmatched"}
    assert "of" in _called(ast.parse("plan = Plan.of(rules, mods)\n"))
