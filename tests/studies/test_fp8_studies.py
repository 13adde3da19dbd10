"""The FP8 dose-response studies end to end at tiny sizes: results, tables, plots, resume.

Each runs a few steps of small models (one compile per setup), so they are marked slow;
the numbers of the default runs are on the docs' results page.
"""

import dataclasses
import json

import numpy as np
import pytest

from studies.app import runner
from studies.lib.models import TransformerConfig
from studies.lm import delayed_lag, fp8_long, grad_blocks, outlier_dose
from studies.training.config import TrainConfig
from tests.studies.studies_testlib import assert_plots

MICRO = TransformerConfig(d_model=32, num_heads=2, num_layers=1, d_ff=64, max_len=16)
SMALL = dict(steps=3, seeds=2, batch=2, seq_len=16, warmup=1, corpus_bytes=4096)


def test_studies_are_registered():
    for name in ("outlier-dose", "delayed-lag", "grad-blocks", "fp8-long"):
        assert name in runner.STUDIES
        runner.load(name)


@pytest.mark.parametrize(("cls", "kwargs", "match"), [
    (outlier_dose.Config, dict(magnitudes=(0.5,)), "magnitudes must be"),
    (outlier_dose.Config, dict(d_model=128), "d_model must be a multiple of 128 and >= 256"),
    (outlier_dose.Config, dict(setups=("bf16-mixed",)), "must be FP8 setups"),
    (outlier_dose.Config, dict(resume="/nonexistent/units"), "no such folder"),
    (delayed_lag.Config, dict(histories=(0,)), "histories must be ints >= 1"),
    (delayed_lag.Config, dict(ramp_steps=-1), "steps must be an int >= 0"),
    (grad_blocks.Config, dict(magnitudes=()), "magnitudes must be"),
    (fp8_long.Config, dict(resume="/nonexistent/ckpt"), "no such folder"),
    (fp8_long.Config, dict(control="fp8-blockwise"), "control must be one of"),
    (fp8_long.Config, dict(control="fp64"), "control must be one of"),
])
def test_configs_reject_bad_values(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.slow  # three vmapped units of the 256-wide one-block model, then again cached
def test_outlier_dose_runs_and_resumes_from_its_units(tmp_path):
    cfg = outlier_dose.Config(magnitudes=(1e2, 1e5), setups=("fp8-current", "fp8-blockwise"),
                              parallel=1, work_dir=str(tmp_path / "units"),
                              train=TrainConfig(**SMALL))
    res = outlier_dose.run(cfg)
    assert res["magnitudes"] == [1e2, 1e5] and res["seeds"] == [0, 1]
    assert set(res["gaps"]) == {"fp8-current", "fp8-blockwise"}
    assert len(res["per_tensor_vs_fine"]["fp8-current"]) == 2
    unit = res["units"]["fp8-current"]
    assert [(r["seed"], r["magnitude"]) for r in unit["runs"]] == [
        (0, 1e2), (1, 1e2), (0, 1e5), (1, 1e5)]
    assert all(len(r["history"]["loss"]) == 3 for r in unit["runs"])
    # The recorded magnitude is the run's; current scaling never saturates.
    assert all(r["history"]["magnitude"][0] == pytest.approx(r["magnitude"], rel=1e-6)
               for r in unit["runs"])
    assert all(max(r["history"]["saturated"]) == 0 for r in unit["runs"])
    # The mechanism column: per-tensor loses the normal tile at 1e5, 1x128 does not.
    sq = res["tile_sqnr"]
    assert sq[1]["fp8-current"]["other"] < sq[0]["fp8-current"]["other"] - 15
    assert sq[1]["fp8-blockwise"]["other"] == pytest.approx(sq[0]["fp8-blockwise"]["other"],
                                                            abs=0.1)
    text = outlier_dose.summarize(res)
    assert "fp8-current - fp8-blockwise" in text and "100000" in text
    assert_plots(outlier_dose.plot(res, tmp_path))
    # Resume: the same config on the same units folder trains nothing and gives the same.
    again = outlier_dose.run(dataclasses.replace(cfg, resume=res["units_folder"]))
    assert again["reference"]["cached"] and all(u["cached"] for u in again["units"].values())
    assert again["gaps"] == res["gaps"]
    json.dumps(again["gaps"])


@pytest.mark.slow  # four units of the 128-wide one-block model
def test_delayed_lag_counts_saturation_only_under_delayed_scaling(tmp_path):
    cfg = delayed_lag.Config(magnitude=1e4, ramp_start=1, ramp_steps=2, histories=(1,),
                             d_model=128, parallel=1, work_dir=str(tmp_path),
                             train=TrainConfig(**{**SMALL, "steps": 5}))
    res = delayed_lag.run(cfg)
    assert set(res["units"]) == {"bf16-mixed", "fp8-current", "fp8-delayed-h1"}
    cur = res["units"]["fp8-current"]["runs"][0]["history"]
    lag = res["units"]["fp8-delayed-h1"]["runs"][0]["history"]
    np.testing.assert_allclose(lag["magnitude"], [1.0, 1.0, 100.0, 1e4, 1e4], rtol=1e-5)
    assert max(cur["saturated"]) == 0 and cur["amax_used"] == cur["amax"]
    # History 1: step t's scale is step t-1's amax; while the outlier grows (steps 2 and
    # 3) every step's amax exceeds it and the outlier channel's values saturate.
    assert lag["amax_used"][0] == lag["amax"][0]  # bootstrapped from the first step
    for t in (2, 3):
        assert lag["amax_used"][t] == pytest.approx(lag["amax"][t - 1], rel=1e-6)
        assert lag["saturated"][t] > 0
    assert res["events"]["fp8-delayed-h1"][0]["during_ramp"] == 2
    assert "fp8-delayed-h1" in delayed_lag.summarize(res)
    assert_plots(delayed_lag.plot(res, tmp_path))


@pytest.mark.slow  # three units of the micro model
def test_grad_blocks_records_the_monitor(tmp_path):
    cfg = grad_blocks.Config(magnitudes=(1e2, 1e4), parallel=1, work_dir=str(tmp_path),
                             train=TrainConfig(model=MICRO, **SMALL))
    res = grad_blocks.run(cfg)
    assert set(res["units"]) == {"bf16-mixed", "fp8-blockwise", "fp8-blockwise-g128"}
    for u in res["units"].values():
        for r in u["runs"]:
            h = r["history"]
            assert len(h["grad_norm"]) == 3 and all(np.isfinite(h["grad_norm"]))
            assert h["nonfinite"] == [0, 0, 0]
            assert r["monitor"]["spikes"] == [] and r["monitor"]["diverged"] is False
    assert len(res["gaps"]["g128_vs_blockwise"]) == 2
    text = grad_blocks.summarize(res)
    assert "divergence monitor" in text
    assert_plots(grad_blocks.plot(res, tmp_path))


@pytest.mark.slow  # three setups of the micro model, then resumed from the checkpoints
def test_fp8_long_gap_curve_control_and_resume(tmp_path):
    train = TrainConfig(model=MICRO, **{**SMALL, "steps": 4}, checkpoint_every=2)
    cfg = fp8_long.Config(checkpoint_dir=str(tmp_path / "ck"), parallel=1, train=train)
    assert cfg.setups == ("bf16-mixed", "fp8-blockwise", "fp32")
    res = fp8_long.run(cfg)
    rows = res["rows"]
    loss = {n: np.asarray([p["history"]["loss"] for p in rows[n]["per_seed"]])
            for n in cfg.setups}
    ref, fp8, f32 = loss["bf16-mixed"], loss["fp8-blockwise"], loss["fp32"]
    assert ref.shape == (2, 4)
    # The curves are paired relative gaps, checked by hand without smoothing (smooth 4 here).
    np.testing.assert_allclose(fp8_long.relative_gap_curve(ref.tolist(), fp8.tolist()),
                               (fp8 - ref) / ref.mean(axis=0), rtol=1e-12)
    control = (f32.mean(axis=1) - ref.mean(axis=1)) / ref.mean()
    np.testing.assert_allclose(res["control_gap"]["gap_curve_mean"], [control.mean()],
                               rtol=1e-9)
    assert res["control"] == "fp32" and not np.allclose(control, 0)
    text = fp8_long.summarize(res)
    assert "0.25%" in text and "noise floor, fp32 vs bf16-mixed" in text
    assert_plots(fp8_long.plot(res, tmp_path))
    again = fp8_long.run(dataclasses.replace(cfg, resume=res["checkpoint_dir"]))
    assert again["rows"]["fp8-blockwise"]["resumed_from"] == 4
    assert again["rows"]["fp32"]["resumed_from"] == 4
    assert again["gap_curve_mean"] == res["gap_curve_mean"]
    assert again["control_gap"] == res["control_gap"]


@pytest.mark.slow  # two setups of the micro model
def test_fp8_long_without_control(tmp_path):
    train = TrainConfig(model=MICRO, **{**SMALL, "steps": 2})
    res = fp8_long.run(fp8_long.Config(control="none", parallel=1, train=train))
    assert set(res["rows"]) == {"bf16-mixed", "fp8-blockwise"} and res["control_gap"] is None
    assert "noise floor" not in fp8_long.summarize(res)


def test_relative_gap_curve_smooths_before_dividing():
    ref = [[2.0, 2.0, 4.0], [2.0, 2.0, 4.0]]
    cand = [[2.2, 2.0, 4.4], [1.8, 2.0, 3.6]]
    got = fp8_long.relative_gap_curve(ref, cand, smooth=2)
    # moving averages: ref [2, 3], cand seed 0 [2.1, 3.2], seed 1 [1.9, 2.8]
    np.testing.assert_allclose(got, [[0.05, 0.2 / 3], [-0.05, -0.2 / 3]], rtol=1e-12)
