"""The studies and benchmarks the command line lists are the modules of their folders, each
named by its own constants (``studies.app.registry``); no hand-kept list."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from studies.app import cli, runner
from studies.app.registry import Entry, discover

ROOT = Path(__file__).resolve().parents[2]


def _stems(folder: str) -> set[str]:
    return {f"studies.{folder}.{p.stem}" for p in (ROOT / "studies" / folder).glob("*.py")
            if not p.stem.startswith("_")}


def test_every_module_of_the_folders_is_listed():
    # Cheap (no import): each public module of the folders is on the command line's lists.
    assert set(runner.MODULES.values()) == _stems("numerics") | _stems("lm")
    assert len(runner.STUDIES) == len(runner.MODULES) == 18
    assert {e.module for e in cli.benchmarks().values()} == _stems("bench")


def test_the_package_docstring_names_every_study_and_folder():
    import studies

    doc = studies.__doc__
    for module in [*runner.MODULES.values(), *_stems("lib"), *_stems("app")]:
        assert f"``{module.rsplit('.', 1)[1]}``" in doc, module
    for folder in ("app", "lib", "numerics", "lm", "bench", "training"):
        assert f"``{folder}/``" in doc, folder


def _modules(folder: str) -> list:
    """Every public module of a folder, imported (walked here from the files, not through
    the registry)."""
    return [importlib.import_module(f"studies.{folder.replace('/', '.')}.{p.stem}")
            for p in sorted((ROOT / "studies" / folder).glob("*.py"))
            if not p.stem.startswith("_")]


@pytest.mark.slow  # imports every study (~2 s)
def test_the_study_list_is_the_modules_found():
    modules = _modules("numerics") + _modules("lm")
    assert len(modules) == 18
    by_order = sorted(modules, key=lambda m: m.ORDER)
    assert list(runner.STUDIES) == [m.NAME for m in by_order]
    assert runner.STUDIES == {m.NAME: m.SUMMARY for m in modules}
    assert runner.MODULES == {m.NAME: m.__name__ for m in modules}
    assert len({m.ORDER for m in modules}) == len(modules)  # no two share a place
    # The ids the command line has always used, whatever the module stem.
    assert runner.module_name("formats") == "studies.numerics.format_ranges"
    assert runner.module_name("memory") == "studies.numerics.memory_footprint"
    assert runner.module_name("fp8_long") == "studies.lm.fp8_long"
    assert list(runner.STUDIES)[:7] == ["formats", "underflow", "master-weights", "loss-scale",
                                         "rounding", "fp8-outliers", "ablate"]


@pytest.mark.slow  # imports every benchmark (~4 s)
def test_the_bench_list_is_the_modules_found(capsys):
    modules = _modules("bench")
    assert len(modules) >= 8
    found = cli.benchmarks()
    assert list(found) == sorted(m.NAME for m in modules)
    assert {e.module for e in found.values()} == {m.__name__ for m in modules}
    assert all(callable(m.main) for m in modules)
    assert cli.main(["bench", "list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{m.NAME}  " in out and m.SUMMARY in out for m in modules)


def _package(tmp_path, monkeypatch, name: str, files: dict[str, str]) -> str:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for stem, text in files.items():
        (pkg / f"{stem}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return name


GOOD = 'NAME = "good-one"\nSUMMARY = "a study"\nORDER = 20\n'


def test_a_new_module_registers_itself(tmp_path, monkeypatch):
    pkg = _package(tmp_path, monkeypatch, "reg_new", {
        "good_one": GOOD, "_helper": "X = 1\n",
        "first": 'import os\nNAME: str = "first"\nSUMMARY = "listed first"\nORDER = 10\n'})
    assert discover(pkg, ordered=True) == [
        Entry("first", "listed first", "reg_new.first", 10),
        Entry("good-one", "a study", "reg_new.good_one", 20)]
    # Benchmarks need no ORDER: listed by name.
    assert [e.name for e in discover(pkg)] == ["first", "good-one"]
    assert "reg_new.good_one" not in sys.modules  # read from the source, not imported


@pytest.mark.parametrize("text, missing", [
    ('SUMMARY = "no name"\nORDER = 1\n', "NAME"),
    ('NAME = "x"\nORDER = 1\n', "SUMMARY"),
    ('NAME = "x"\nSUMMARY = "no order"\n', "ORDER"),
    ('NAME = "x" + "y"\nSUMMARY = "s"\nORDER = 1\n', "NAME"),        # not a literal
    ('NAME = "x"\nSUMMARY = "s"\nORDER = "1"\n', "ORDER"),           # wrong type
    ('NAME = "x"\nSUMMARY = "s"\nORDER = True\n', "ORDER"),
    ('def f():\n    NAME = "x"\nSUMMARY = "s"\nORDER = 1\n', "NAME"),  # not module level
])
def test_a_module_without_the_constants_fails_clearly(tmp_path, monkeypatch, text, missing):
    pkg = _package(tmp_path, monkeypatch, "reg_bad", {"good_one": GOOD, "broken": text})
    with pytest.raises(TypeError, match=rf"reg_bad\.broken must declare the module constants "
                                        rf"NAME \(str\), SUMMARY \(str\), ORDER \(int\).*"
                                        rf"missing or wrong: {missing}\."):
        discover(pkg, ordered=True)


def test_a_bench_module_needs_name_and_summary_only(tmp_path, monkeypatch):
    pkg = _package(tmp_path, monkeypatch, "reg_bench",
                   {"moe": 'NAME = "moe"\nSUMMARY = "s"\n', "bare": "def main(argv): pass\n"})
    with pytest.raises(TypeError, match=r"reg_bench\.bare must declare the module constants "
                                        r"NAME \(str\), SUMMARY \(str\) .*NAME, SUMMARY\."):
        discover(pkg)


def test_two_modules_with_one_name_fail(tmp_path, monkeypatch):
    a = _package(tmp_path, monkeypatch, "reg_a", {"one": GOOD})
    b = _package(tmp_path, monkeypatch, "reg_b", {"two": GOOD})
    assert len(discover(a, ordered=True)) == len(discover(b, ordered=True)) == 1
    with pytest.raises(ValueError, match=r"reg_b\.two and reg_a\.one both declare "
                                         r"NAME = 'good-one'"):
        discover(a, b, ordered=True)
    with pytest.raises(ValueError, match="packages must be importable packages"):
        discover("reg_a.one")
