"""The study runner: registry, options from Config fields, results folder, bad input."""

import dataclasses
import json
import sys
import types
from pathlib import Path
from typing import Literal

import ml_dtypes
import numpy as np
import pytest
from studies_testlib import assert_plots, plain

from studies.app import runner
from studies.app.cli import main as cli_main
from studies.lib import common


def _reject_constants(name):
    raise ValueError(f"non-strict JSON constant {name}")


def test_list(capsys):
    assert runner.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in ("formats", "underflow", "master-weights", "loss-scale", "rounding",
                 "fp8-outliers"):
        assert name in out


def test_cli_dispatches_to_the_runner(capsys):
    assert cli_main(["study", "--list"]) == 0
    assert "fp8-outliers" in capsys.readouterr().out


def test_unknown_study_lists_the_valid_ones(capsys):
    assert runner.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown study 'nope'" in err
    for name in runner.STUDIES:
        assert name in err
    assert cli_main(["study", "nope"]) == 2


def test_no_study_name_is_an_error(capsys):
    assert runner.main([]) == 2
    assert "usage" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["rounding", "--sweep-bins", "abc"], "'abc'"),
    (["rounding", "--sweep-bins", "-1"], "sweep_bins must be >= 0"),
    (["rounding", "--nope", "1"], "--nope"),
    (["formats", "--formats", "fp9"], "Valid names"),
    (["fp8-outliers", "--cols", "1000"], "must be a multiple of block=128"),
    (["fp8-outliers", "--mx-rounding", "up"], "invalid choice 'up'"),
    (["fp8-outliers", "--outliers", "1e2", "x"], "'x'"),
    (["ablate", "--steps", "0"], "steps must be >= 1"),
    (["ablate", "--policies", "fp32,fp64"], "unknown policies 'fp64'"),
    (["master-weights", "--steps", "0"], "steps must be a positive int"),
    (["loss-scale", "--spikes", "99"], "spikes must be steps in 1..64"),
    (["loss-scale", "--backoff-factor", "2"], "backoff_factor must be in the open interval"),
])
def test_bad_option_values(capsys, tmp_path, argv, message):
    assert runner.main([*argv, "--out", str(tmp_path)]) == 2
    assert message in plain(capsys.readouterr().err)
    assert not list(tmp_path.iterdir())  # nothing written


def test_help_shows_field_docs(capsys):
    assert runner.main(["fp8-outliers", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--outlier-channels" in out and "how many leading columns" in out
    assert "{floor,ceil,even,rceil}" in out
    assert "--no-plot" in out and "--out" in out


def test_every_study_builds_its_options():
    for name in runner.STUDIES:
        module = runner.load(name)
        inv = runner.parse_args(name, [], module)
        assert inv.config == module.Config()  # the defaults round-trip through the CLI
        assert inv.out == Path("runs") and inv.plot


def test_nested_training_options_have_no_prefix():
    # The training settings are declared once (TrainConfig) and nested in each training
    # study's Config; on the command line they read as flat options.
    inv = runner.parse_args("ablate", ["--steps", "7", "--lr", "1e-3", "--policies",
                                       "fp32,bf16-mixed", "pure-bf16", "--no-plot"])
    assert inv.config.train.steps == 7 and inv.config.train.lr == 1e-3
    assert inv.config.policies == ("fp32", "bf16-mixed", "pure-bf16")
    assert inv.config.train.model_size == "tiny" and not inv.plot
    inv = runner.parse_args("fp8-recipes", ["--recipes", "blockwise", "--num-layers", "2"])
    assert inv.config.recipes == ("blockwise",) and inv.config.train.num_layers == 2
    assert inv.config.train.steps == 100  # the study's own default


def test_tuple_options_take_one_value_per_argument():
    module = runner.load("fp8-outliers")
    inv = runner.parse_args("fp8-outliers", ["--outliers", "1e2", "3e2", "3e4"], module)
    assert inv.config.outliers == (100.0, 300.0, 30000.0)


def test_runner_writes_results_and_png(tmp_path, capsys):
    argv = ["rounding", "--sweep-bins", "8", "--points-per-bin", "4", "--out", str(tmp_path)]
    assert runner.main(argv) == 0
    out = capsys.readouterr().out
    assert "0 01011 1001100110" in out  # the summary table: 0.1 in fp16
    (folder,) = (tmp_path / "rounding").iterdir()
    record = json.loads((folder / "results.json").read_text(), parse_constant=_reject_constants)
    assert record["study"] == "rounding"
    assert record["config"]["sweep_bins"] == 8
    assert set(record["env"]["versions"]) >= {"jax", "flax", "optax", "ml_dtypes", "fmtkit"}
    assert all(record["env"]["versions"][k] for k in ("jax", "optax", "ml_dtypes", "fmtkit"))
    assert record["env"]["device"].startswith("cpu")
    assert record["timing"]["run_seconds"] >= 0
    rows = {(r["value"], r["format"]): r for r in record["results"]["rows"]}
    assert rows[(70000.0, "float16")]["stored"] == "inf"  # strict JSON: non-finite as strings
    assert record["plots"] == ["rounding.png"]
    assert_plots([folder / "rounding.png"])


def test_no_plot(tmp_path):
    assert runner.main(["formats", "--formats", "fp16", "--no-plot", "--out", str(tmp_path)]) == 0
    (folder,) = (tmp_path / "formats").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["results.json"]


def test_run_study_warns_when_excess_precision_is_allowed(monkeypatch, tmp_path):
    """From Python without the CLI's XLA flag, a study says so and records it."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    with pytest.warns(UserWarning, match="xla_allow_excess_precision=false"):
        _, record = runner.run_study("formats", out_root=tmp_path, plot=False)
    assert record["env"]["xla_allow_excess_precision"] is True
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=false")
    _, record = runner.run_study("formats", out_root=tmp_path, plot=False)  # no warning
    assert record["env"]["xla_allow_excess_precision"] is False


def test_run_dirs_are_unique(tmp_path):
    a, b = common.run_dir(tmp_path, "x"), common.run_dir(tmp_path, "x")
    assert a != b and a.is_dir() and b.is_dir()


def test_to_jsonable():
    out = common.to_jsonable({
        "a": np.float32(0.5), "b": np.array([1.0, np.inf, np.nan]), "c": (1, True, None),
        "d": ml_dtypes.bfloat16(0.1), "e": np.int32(3), "f": float("-inf")})
    assert out["a"] == 0.5 and out["b"] == [1.0, "inf", "nan"] and out["c"] == [1, True, None]
    assert out["d"] == 0.10009765625 and out["e"] == 3 and out["f"] == "-inf"
    json.dumps(out, allow_nan=False)
    with pytest.raises(TypeError, match="Cannot write object"):
        common.to_jsonable(object())


# A study added the documented way: one module + one registry line.

@dataclasses.dataclass(frozen=True)
class _ToyConfig:
    """Toy study configuration.

    Attributes:
      steps: how many steps.
      rate: a float option.
      mode: a choice.
      noisy: a flag.
      data: an optional path.
    """

    steps: int = 3
    rate: float = 0.5
    mode: Literal["a", "b"] = "a"
    noisy: bool = False
    data: str | None = None

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}.")


def _toy_module():
    module = types.ModuleType("studies.toy_study")
    module.__doc__ = "A toy study."
    module.Config = _ToyConfig

    def run(config, progress=common.no_progress):
        if config.data == "missing.txt":
            from studies.lib.corpus import load_text
            load_text(config.data)
        if config.rate < 0:
            raise common.StudyError(f"loss is NaN at step 2 (rate={config.rate})")
        xs = [config.rate * i for i in progress(range(config.steps), total=config.steps)]
        return {"xs": xs, "mode": config.mode, "noisy": config.noisy, "data": config.data}

    module.run = run
    module.summarize = lambda results: f"sum={sum(results['xs'])}"
    return module


def test_registering_a_new_study(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(runner.STUDIES, "toy-study", "a toy study")
    monkeypatch.setitem(runner.MODULES, "toy-study", "studies.toy_study")
    monkeypatch.setitem(sys.modules, "studies.toy_study", _toy_module())
    argv = ["toy-study", "--steps", "4", "--rate", "2", "--mode", "b", "--noisy",
            "--data", "x.txt", "--out", str(tmp_path)]
    assert runner.main(argv) == 0
    assert "sum=12.0" in capsys.readouterr().out
    (folder,) = (tmp_path / "toy-study").iterdir()
    record = json.loads((folder / "results.json").read_text())
    assert record["config"] == {"steps": 4, "rate": 2.0, "mode": "b", "noisy": True,
                                "data": "x.txt"}
    assert record["results"]["xs"] == [0.0, 2.0, 4.0, 6.0]
    assert record["plots"] == []
    assert runner.main(["toy-study", "--mode", "c"]) == 2
    assert runner.main(["toy-study", "--steps", "0"]) == 2
    capsys.readouterr()
    assert runner.main(["toy-study", "--data", "missing.txt", "--out", str(tmp_path)]) == 2
    assert "'missing.txt': no such file" in plain(capsys.readouterr().err)
    assert runner.main(["toy-study", "--rate", "-1", "--out", str(tmp_path)]) == 1
    assert "failed: loss is NaN at step 2" in capsys.readouterr().err
    assert len(list((tmp_path / "toy-study").iterdir())) == 1  # failed runs write nothing


def test_reserved_option_names_are_rejected(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Config:
        out: str = "x"

    module = types.ModuleType("studies.clash")
    module.Config, module.run = Config, lambda c: {}
    monkeypatch.setitem(runner.STUDIES, "clash", "clashes")
    monkeypatch.setitem(runner.MODULES, "clash", "studies.clash")
    monkeypatch.setitem(sys.modules, "studies.clash", module)
    with pytest.raises(TypeError, match="clashes with a runner option"):
        runner.parse_args("clash", [])


def test_run_study_rejects_a_foreign_config():
    with pytest.raises(TypeError, match=r"config must be a studies\.numerics\.rounding\.Config"):
        runner.run_study("rounding", _ToyConfig())
