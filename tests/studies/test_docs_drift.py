"""Prose that names code names code that exists (here, beside the studies tests: it reads
the command line's own `--help`).

The README, CHANGELOG, CONTRIBUTING, every page under docs/ and every docstring of fmtkit,
pallas_kernels and studies are read for four kinds of reference, each checked against the
code itself (imports, the command line's own ``--help``, the constants that validate
arguments), never against a list kept here:

- a dotted name of a module or an attribute in code (```fmtkit.debug.capture```,
  ```studies.training.TrainConfig```, the short ```fp8.update_state``` for fmtkit's
  submodules) must import and resolve;
- a ``*.py`` path under one of the repository's folders must be a file;
- a command line ``fmtkit CMD ...`` in code must name a command, a study or benchmark that
  exists, and only options that command's ``--help`` lists;
- a string value of an option in code must be one the code accepts: a preset or recipe name,
  a rounding or overflow mode, a debug override or autopilot ladder rung, a
  ``log_decision`` setting, an ``fmtkit ablate --policies`` setup or ``--regime``.

The mutation tests reintroduce one drift of each kind into a real page or docstring and
assert that the check reports it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
import io
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fmtkit", "pallas_kernels", "studies")
REPO_DIRS = ("fmtkit", "pallas_kernels", "studies", "tests", "examples", "tools", "docs")
# fmtkit's submodules that prose names by their short form (`fp8.update_state`). `policy` is
# left out: prose uses it as a variable (`policy.compute_dtype`).
SHORT_MODULES = ("fp8", "fp4", "optim", "debug", "telemetry", "debuglog", "scaling",
                 "casting", "formats", "memory", "distributed")

# Names prose gives on purpose although they no longer import: removed spellings, named where
# the docs give their replacement (docs/deprecated.md, the CHANGELOG's history).
REMOVED_ON_PURPOSE = {"pallas_kernels.gpu_check"}
# A dotted name ending in a file extension is a file name (`debug.yaml`, `memory.png`).
FILE_SUFFIXES = ("yaml", "yml", "toml", "json", "jsonl", "png", "md", "txt", "py")

# Values prose shows on purpose because the code rejects them (each sentence says it raises).
REJECTED_ON_PURPOSE = {"bf16", "bf16_mixed", "block-wise", "compute_dtype_x"}

# --- Where the prose is ----------------------------------------------------------------


def _docstrings(path: Path) -> Iterator[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                line = getattr(node, "lineno", 1)
                yield f"{path.relative_to(ROOT).as_posix()}:{line}", doc


def prose() -> list[tuple[str, str]]:
    """``(where, text)`` of every page and docstring the checks read."""
    out = [(name, (ROOT / name).read_text())
           for name in ("README.md", "CHANGELOG.md", "CONTRIBUTING.md")]
    out += [(p.relative_to(ROOT).as_posix(), p.read_text())
            for p in sorted((ROOT / "docs").rglob("*.md"))]
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            out += list(_docstrings(path))
    return out


_FENCE = re.compile(r"^\s*```[^\n]*\n(.*?)^\s*```", re.S | re.M)
_INLINE = re.compile(r"``(.+?)``|`([^`\n]+)`")


def code_spans(text: str) -> list[str]:
    """The code in a text: fenced blocks, inline code (single or double backticks), indented
    lines (markdown code, docstring examples) and doctest lines without their prompts."""
    spans = [m.group(1) for m in _FENCE.finditer(text)]
    rest = _FENCE.sub("", text)
    spans += [a or b for a, b in _INLINE.findall(rest)]
    spans += [line.strip() for line in rest.splitlines() if line.startswith("    ")]
    spans += [line.strip()[4:] for line in text.splitlines()
              if line.strip().startswith((">>> ", "... "))]
    return spans


# --- 1. Dotted names ---------------------------------------------------------------------

_DOTTED = re.compile(r"(?<![\w./-])((?:fmtkit|studies|pallas_kernels|tools)(?:\.[A-Za-z_]\w*)+)"
                     r"(?![\w/-])")
_SHORT = re.compile(r"(?<![\w./-])((?:" + "|".join(SHORT_MODULES)
                    + r")(?:\.[A-Za-z_]\w*)+)(?![\w/-])")


@functools.cache
def resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` is an importable module, optionally followed by attributes (a
    dataclass field or annotated attribute of a class counts)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():  # a deprecated module (fmtkit.debuglog) still exists
                warnings.simplefilter("ignore", DeprecationWarning)
                obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is not None and ".".join(parts[:i]).startswith(e.name) and i > 1:
                continue
            if i == 1:
                return False
            continue
        for attr in parts[i:]:
            with warnings.catch_warnings():  # a deprecated spelling still exists
                warnings.simplefilter("ignore", DeprecationWarning)
                found = hasattr(obj, attr)
                if found:
                    obj = getattr(obj, attr)
            if found:
                continue
            fields = getattr(obj, "__dataclass_fields__", None) or {}
            annotated = {}
            if inspect.isclass(obj):
                for klass in obj.__mro__:
                    annotated.update(getattr(klass, "__annotations__", {}))
            return attr in fields or attr in annotated
        return True
    return False


@functools.cache
def entry_point_groups() -> set[str]:
    """The entry-point groups pyproject.toml declares (`fmtkit.gemm_backends`)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project.get("entry-points", {}))


def _known(name: str, full: str) -> bool:
    return (name.rsplit(".", 1)[-1] in FILE_SUFFIXES or full in REMOVED_ON_PURPOSE
            or full in entry_point_groups() or resolves(full))


def unknown_names(text: str) -> list[str]:
    bad = []
    for span in code_spans(text):
        bad += [n for n in _DOTTED.findall(span) if not _known(n, n)]
        bad += [n for n in _SHORT.findall(span) if not _known(n, "fmtkit." + n)]
    return bad


# --- 2. *.py paths -----------------------------------------------------------------------

_PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(REPO_DIRS)
                   + r")/(?:[\w.-]+/)*[\w-]+\.py)(?![\w])")


def missing_paths(text: str) -> list[str]:
    return [p for p in _PATH.findall(text)
            if not (ROOT / p).is_file() and not _is_placeholder(Path(p).stem)]


# --- 3. Command lines --------------------------------------------------------------------

_COMMAND = re.compile(r"(?<![\w./-])(?<!from )(?<!import )fmtkit[ \t]+([a-z][\w-]*)([^\n`#]*)")


def _help(fn, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        with contextlib.suppress(SystemExit):
            fn(argv)
    return out.getvalue()


def _options(help_text: str) -> set[str]:
    opts = set()
    for line in help_text.splitlines():
        if line.strip().startswith("-"):
            head = re.split(r"\s{2,}", line.strip())[0]   # the options, before their help
            opts |= set(re.findall(r"(?<![\w-])-{1,2}[a-zA-Z][\w-]*", head))
    return opts


@functools.cache
def cli() -> dict:
    """The command line as its own ``--help`` describes it: commands, studies, benchmarks,
    and the options of each."""
    from studies.app import cli as cli_module
    from studies.app import runner

    commands = set(re.findall(r'sub\.add_parser\("([\w-]+)"',
                              (ROOT / "studies" / "app" / "cli.py").read_text()))
    options = {c: _options(_help(cli_module.main, [c, "--help"]))
               for c in commands - {"study", "bench"}}
    options["study"] = {"--list", "--help", "-h"}
    study_options = {name: _options(_help(cli_module.main, ["study", name, "--help"]))
                     for name in runner.STUDIES}
    options["ablate"] = study_options["ablate"]
    bench_options = {name: _options(_help(importlib.import_module(entry.module).main,
                                          ["--help"]))
                     for name, entry in cli_module.benchmarks().items()}
    return {"commands": commands, "options": options, "studies": study_options,
            "benches": bench_options}


# Options prose writes as placeholders (`fmtkit study NAME [--option value]`).
GENERIC_OPTIONS = {"--option", "--options", "--flag", "--no-flag"}


def _is_placeholder(token: str) -> bool:
    return (len(token) <= 1 or token.isupper() or bool(re.search(r"[A-Z]{3,}", token))
            or token[0] in "<[{(|.'\"$" or "..." in token or token == "list")


def bad_command_lines(text: str) -> list[str]:
    spec, bad = cli(), []
    for span in code_spans(text):
        for cmd, tail in _COMMAND.findall(span):
            tokens = tail.split("|")[0].split()     # `--list | NAME`: the first form
            if cmd not in spec["commands"]:
                bad.append(f"fmtkit {cmd}")
                continue
            allowed = spec["options"].get(cmd, set())
            if cmd in ("study", "bench") and tokens and not tokens[0].startswith("-"):
                name = tokens.pop(0)
                table = spec["studies"] if cmd == "study" else spec["benches"]
                if _is_placeholder(name):
                    continue  # `fmtkit study NAME --help`: any study's options
                if name not in table:
                    bad.append(f"fmtkit {cmd} {name}")
                    continue
                allowed = table[name] | {"--help", "-h"}
            for i, token in enumerate(tokens):
                option = token.split("=")[0].lstrip("[(").rstrip(",;.:)]")
                if not re.fullmatch(r"-{1,2}[a-z][\w-]*", option):
                    continue
                if option not in allowed and option not in GENERIC_OPTIONS:
                    bad.append(f"fmtkit {cmd} {option}")
                    continue
                value = token.split("=", 1)[1] if "=" in token else (
                    tokens[i + 1] if i + 1 < len(tokens) else "")
                bad += [f"fmtkit {cmd} {option} {v}"
                        for v in _bad_cli_values(cmd, option, value)]
    return bad


def _bad_cli_values(cmd: str, option: str, value: str) -> list[str]:
    from studies.lib.regimes import REGIMES
    from studies.training import SETUPS

    if _is_placeholder(value) or value.startswith("-"):
        return []
    if cmd == "ablate" and option == "--policies":
        return [v for v in value.split(",") if v and not _is_placeholder(v) and v not in SETUPS]
    if option == "--regime":
        return [] if value in REGIMES or value == "none" else [value]
    return []


# --- 4. String values of options in Python code ------------------------------------------


@functools.cache
def accepted() -> dict[str, set[str]]:
    import fmtkit
    from fmtkit import casting, debug, fp4, fp8

    overrides = {o for o in debug.OVERRIDES if "<" not in o}
    return {"preset": set(fmtkit.list_presets()),
            "recipe": set(fp8.RECIPES) | set(fp4.RECIPES),
            "rounding": set(casting.ROUNDING_MODES),
            "overflow": set(casting.OVERFLOW_MODES),
            "override": overrides}


def _is_override(value: str) -> bool:
    return value in accepted()["override"] or value.startswith("fake_quant:")


# call name -> (positional index or None, keyword or None, kind)
_CALLS = {
    "with_policy": [(1, None, "policy")],
    "get_preset": [(0, None, "preset")],
    "dot_general_fn": [(0, "recipe", "recipe")],
    "dot_general": [(None, "recipe", "recipe")],
    "get_recipe": [(0, None, "recipe")],
    "cast": [(None, "rounding", "rounding"), (None, "overflow", "overflow")],
    "log_decision": [(3, "setting", "override")],
    "Rule": [(None, "override", "override")],
    "Autopilot": [(None, "ladder", "override")],
}


def _value_ok(kind: str, value: str) -> bool:
    if value in REJECTED_ON_PURPOSE or _is_placeholder(value):
        return True
    if kind == "override":
        return _is_override(value)
    if kind == "policy":  # a preset name or a Policy string ("p=f32,c=bf16")
        return value in accepted()["preset"] or "=" in value
    return value in accepted()[kind]


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def bad_values(text: str) -> list[str]:
    bad = []
    for span in code_spans(text):
        try:
            tree = ast.parse(inspect.cleandoc(span))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            for pos, kw, kind in _CALLS.get(name, []):
                args = []
                if pos is not None and len(node.args) > pos:
                    args.append(node.args[pos])
                args += [k.value for k in node.keywords if kw is not None and k.arg == kw]
                for arg in args:
                    bad += [f"{name}: {v!r}" for v in _strings(arg) if not _value_ok(kind, v)]
    return bad


# --- The tests ---------------------------------------------------------------------------

CHECKS = {"name": unknown_names, "path": missing_paths, "command": bad_command_lines,
          "value": bad_values}


@pytest.mark.slow  # ~10 s: every page and docstring, and each command's --help
@pytest.mark.parametrize("kind", list(CHECKS))
def test_prose_names_only_what_exists(kind):
    problems = [f"{where}: {p}" for where, text in prose() for p in CHECKS[kind](text)]
    assert not problems, "\n".join(problems)


def _docstring_of(path: str, owner: str) -> str:
    for _, doc in _docstrings(ROOT / path):
        if owner in doc:
            return doc
    raise AssertionError(f"no docstring of {path} holds {owner!r}")


# Each drift the docs once had, put back into the text where it was.
MUTATIONS = [
    ("name", "docs/guides/studies.md", "`studies.training.TrainConfig`",
     "`studies.train.TrainConfig`"),
    ("name", "docs/guides/studies.md", "(`models`, `corpus`,", "(`studies.seeds`, `corpus`,"),
    ("name", "docs/guides/fp8.md", "`fp8.update_state(state,", "`fp8.update_states(state,"),
    ("path", "docs/guides/debug-logs.md", "## What is written",
     "See tests/debug/test_no_such_file.py.\n\n## What is written"),
    ("command", "README.md", "fmtkit debug RUNDIR [--plots --top N]",
     "fmtkit debug RUNDIR [--plot --top N]"),
    ("command", "docs/guides/studies.md", "fmtkit ablate --full", "fmtkit ablate --fulll"),
    ("command", "docs/guides/studies.md", "fmtkit study --list", "fmtkit studies --list"),
    ("command", "docs/guides/studies.md", "fmtkit study fp8-outliers --outliers",
     "fmtkit study fp8-outlier --outliers"),
    ("command", "docs/guides/studies.md", "--policies fp32,bf16-mixed,",
     "--policies fp32,bf16_mixed,"),
    ("value", "docs/guides/debug-logs.md", '"dot_general_0", "compute",',
     '"dot_general_0", "compute_dtype",'),
    ("value", "docs/getting-started.md", 'with_policy(MLP(), "bf16-mixed")',
     'with_policy(MLP(), "bf16-mix")'),
    ("value", "docs/guides/fp8.md", 'recipe="blockwise"', 'recipe="block_wise"'),
]


@pytest.mark.slow  # builds the command line's option table (~5 s)
@pytest.mark.parametrize("kind, page, old, new", MUTATIONS,
                         ids=[f"{k}-{i}" for i, (k, *_) in enumerate(MUTATIONS)])
def test_a_reintroduced_drift_fails_the_check(kind, page, old, new):
    text = (ROOT / page).read_text()
    assert old in text, f"{page} no longer holds {old!r}: update the mutation"
    assert not CHECKS[kind](text)
    assert CHECKS[kind](text.replace(old, new, 1))


def test_a_docstring_naming_a_missing_test_file_fails_the_check():
    doc = _docstring_of("fmtkit/debug/log.py", "log_decision") + "\n"
    assert not missing_paths(doc)
    assert missing_paths(doc + "Tested by tests/test_no_such_file.py.\n") == [
        "tests/test_no_such_file.py"]


def test_the_patterns():
    assert code_spans("a `x.y` b ``z`` c\n```python\nq = 1\n```\n    ind\n>>> d(1)\n") == [
        "q = 1\n", "x.y", "z", "ind", ">>> d(1)"[4:]]
    assert resolves("fmtkit.debug.capture") and resolves("fmtkit.scaling.DelayedScaling.history")
    assert not resolves("fmtkit.debug.captures") and not resolves("studies.train")
    assert missing_paths("see fmtkit/nope.py and `examples/linen_bf16_mixed.py`") == [
        "fmtkit/nope.py"]
    assert bad_values('`with_policy(m, "p=f32,c=bf16")` `cast(x, "bf16", rounding="up")`') == [
        "cast: 'up'"]
