"""Each seed study in a small configuration, checked against independently derived numbers
(NumPy/ml_dtypes arithmetic, hand derivations from the format definitions, a plain-Python
GradScaler), never against the study's own earlier output."""

import math

import jax
import ml_dtypes
import numpy as np
import pytest
from studies_testlib import assert_plots

from studies.numerics import (
    format_ranges,
    fp8_outliers,
    loss_scale,
    master_weights,
    rounding,
    underflow,
)

# formats ------------------------------------------------------------------------------------

def test_formats_table_matches_ml_dtypes_finfo(tmp_path):
    res = format_ranges.run(format_ranges.Config())
    rows = {r["name"]: r for r in res["formats"]}
    assert len(rows) == 14
    for name, dtype in [("float32", np.float32), ("float16", np.float16),
                        ("bfloat16", ml_dtypes.bfloat16),
                        ("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
                        ("float8_e5m2", ml_dtypes.float8_e5m2)]:
        fi = ml_dtypes.finfo(dtype)
        r = rows[name]
        assert r["max"] == float(fi.max)
        assert r["min_normal"] == float(fi.tiny)
        assert r["min_subnormal"] == float(fi.smallest_subnormal)
        assert r["eps"] == float(fi.eps)
    assert rows["float8_e4m3fn"]["max"] == 448.0  # OCP FP8 v1.0 (seed 002 says 3.8e5: wrong)
    # fp16: 2^-24 .. 65504 spans log2(65504) + 24 binades (seed 003: "about 40").
    assert rows["float16"]["binades"] == pytest.approx(math.log2(65504) + 24)
    assert_plots(format_ranges.plot(res, tmp_path))


def test_formats_subset_and_aliases():
    res = format_ranges.run(format_ranges.Config(formats=("bf16", "e4m3", "bfloat16")))
    assert [r["name"] for r in res["formats"]] == ["bfloat16", "float8_e4m3fn"]


# underflow ----------------------------------------------------------------------------------

def test_underflow_against_numpy(tmp_path):
    grads = (2e-8, 1e-8, 5e-8, 3e-7, 1e-5, 2e-2)
    res = underflow.run(underflow.Config(grads=grads, sweep_bins=20, points_per_bin=4))
    s = np.float32(2.0**16)
    for g, row in zip(grads, res["rows"]):
        g32 = np.float32(g)
        assert row["fp16"] == float(g32.astype(np.float16))
        assert row["fp16_loss_scaled"] == float((g32 * s).astype(np.float16).astype(np.float32)
                                                / s)
        assert row["bf16"] == float(g32.astype(ml_dtypes.bfloat16))
    r2 = res["rows"][0]  # 2e-8 < 2^-25, half of fp16's smallest subnormal: flushes
    assert r2["fp16"] == 0.0 and r2["fp16_flushed"]
    assert r2["fp16_loss_scaled"] == pytest.approx(2e-8, rel=1e-3)  # seed 003: 1.999e-8
    assert not any(r["bf16_flushed"] for r in res["rows"])
    assert res["rows"][2]["fp16"] == 2.0**-24  # 5e-8 rounds to the smallest subnormal
    # The sweep's envelopes are bounded by the unit roundoffs (format definitions).
    sw = res["sweep"]
    hi = np.asarray(sw["bin_hi"])
    lo = np.asarray(sw["bin_lo"])
    normal = (lo >= 2.0**-14) & (hi <= 65504)
    assert max(np.asarray(sw["fp16"])[normal]) <= 2.0**-11
    assert max(sw["bf16"]) <= 2.0**-8
    assert np.all(np.asarray(sw["fp16"])[hi < 2.0**-25] == 1.0)  # flushed
    assert_plots(underflow.plot(res, tmp_path))


# master weights -----------------------------------------------------------------------------

def _numpy_accumulate(dtype, steps, init=1.0, update=1e-3):
    w, u = dtype(init), dtype(update)
    traj = []
    for _ in range(steps):
        w = dtype(w + u)
        traj.append(float(w))
    return traj


def test_master_weights_against_numpy(tmp_path):
    res = master_weights.run(master_weights.Config(stall_steps=5000, sr_elements=256))
    fin = res["final"]
    assert fin["bfloat16"] == 1.0  # 1 + 1e-3 rounds back to 1 (bf16 spacing 2^-7)
    f16 = _numpy_accumulate(np.float16, 1000)
    assert fin["float16"] == f16[-1]
    assert abs(fin["float16"] - 1.9766) < 1e-4  # seed 000's exercise answer
    assert fin["float16"] == 1 + 1000 * 2.0**-10  # each step adds one fp16 ulp of [1, 2)
    assert fin["float32"] == _numpy_accumulate(np.float32, 1000)[-1]
    assert f"{fin['float32']:.4f}" == "2.0000"
    # Through fmtkit.optim: f32 masters reach 2.0 for bf16 and fp16 parameters.
    assert fin["bf16_master"] == 2.0 and fin["fp16_master"] == 2.0
    assert fin["bf16_kahan"] == 2.0
    # Stochastic rounding is unbiased: the mean of 256 elements is 2 within a few standard
    # errors (per-step variance <= ulp^2 / 4 with ulp = 2^-7 in [1, 2): sd <= 0.125 / 16).
    assert abs(fin["bf16_stochastic"] - 2.0) < 4 * (2.0**-7 / 2 * math.sqrt(1000) / 16)
    stall = _numpy_accumulate(np.float16, 5000)
    assert res["stall"]["final"] == stall[-1] == 4.0  # seed 000: fp16 stops at 4.0
    first_four = stall.index(4.0) + 1
    assert res["stall"]["last_change_step"] == first_four == 2048
    assert res["stall"]["stalled"]
    assert_plots(master_weights.plot(res, tmp_path))


# loss scale ---------------------------------------------------------------------------------

def _gradscaler_reference(grads, init, growth, backoff, interval):
    """PyTorch GradScaler's update rule in plain Python; fp16 cast with NumPy."""
    scale, tracker, out = init, 0, []
    for g in grads:
        with np.errstate(over="ignore", invalid="ignore"):
            g16 = (g.astype(np.float32) * np.float32(scale)).astype(np.float16)
        finite = bool(np.isfinite(g16).all())
        used = scale
        if finite:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * growth, 0
        else:
            scale, tracker = scale * backoff, 0
        out.append((used, not finite, scale))
    return out


def test_loss_scale_against_gradscaler_reference(tmp_path):
    cfg = loss_scale.Config(steps=24, growth_interval=3, spikes=(2, 3, 9), nan_steps=(14,),
                            n_grads=64, grad_max=1e-3)
    res = loss_scale.run(cfg)
    ref = _gradscaler_reference(loss_scale.gradients(cfg), 2.0**16, 2.0, 0.5, 3)
    got = [(r["scale"], r["overflow"], r["next_scale"]) for r in res["steps"]]
    assert got == ref
    overflow_steps = [r["step"] for r in res["steps"] if r["overflow"]]
    assert {2, 3, 9, 14} <= set(overflow_steps)
    for r in res["steps"]:
        assert r["params_changed"] == (not r["overflow"])  # skipped steps leave params alone
    assert res["skipped_steps"] == len(overflow_steps)
    assert_plots(loss_scale.plot(res, tmp_path))


# rounding -----------------------------------------------------------------------------------

def _round_to_grid(v, mantissa_bits):
    """Nearest value with ``mantissa_bits`` fraction bits in v's binade (normal range)."""
    spacing = 2.0 ** (math.floor(math.log2(v)) - mantissa_bits)
    return round(v / spacing) * spacing


def test_rounding_hand_derived(tmp_path):
    res = rounding.run(rounding.Config(sweep_bins=30, points_per_bin=4))
    rows = {(r["value"], r["format"]): r for r in res["rows"]}
    for v in (0.1, 12.345):
        assert rows[(v, "float16")]["stored"] == _round_to_grid(v, 10)
        assert rows[(v, "bfloat16")]["stored"] == _round_to_grid(v, 7)
    assert rows[(12.345, "float16")]["stored"] == 12.34375
    assert rows[(12.345, "bfloat16")]["stored"] == 12.375
    assert rows[(0.1, "float16")]["bits"] == "0 01011 1001100110"
    assert rows[(70000.0, "float16")]["stored"] == math.inf  # above 65504 + 16
    assert rows[(70000.0, "float16")]["kind"] == "inf (overflow)"
    assert rows[(70000.0, "bfloat16")]["stored"] == _round_to_grid(70000.0, 7) == 70144
    assert rows[(1e-30, "float16")]["stored"] == 0.0
    assert rows[(1e-30, "float16")]["kind"] == "zero (underflow)"
    assert rows[(1e-30, "bfloat16")]["rel_error"] <= 2.0**-8
    # seed 003: 12.345 has relative error 1.0e-4 in fp16, 2.4e-3 in bf16.
    assert f"{rows[(12.345, 'float16')]['rel_error']:.1e}" == "1.0e-04"
    assert f"{rows[(12.345, 'bfloat16')]['rel_error']:.1e}" == "2.4e-03"
    errs = res["sweep"]["errors"]
    assert max(errs["bfloat16"]) <= 2.0**-8  # unit roundoff over f32's normal range
    assert_plots(rounding.plot(res, tmp_path))


# fp8 outliers -------------------------------------------------------------------------------

def _qdq_numpy(x, scale):
    """x ≈ e4m3(clip(x / scale, ±448)) * scale in NumPy + ml_dtypes (the seed's formula)."""
    v = np.clip(x / scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return v.astype(np.float32) * scale


def _blocked(x, width, scale_fn):
    r, c = x.shape
    b = x.reshape(r, c // width, width)
    amax = np.abs(b).max(axis=2, keepdims=True)
    return _qdq_numpy(b, scale_fn(amax)).reshape(r, c)


def _rel(q, x):
    return float(np.linalg.norm(q - x) / np.linalg.norm(x))


def test_fp8_outliers_against_numpy(tmp_path):
    cfg = fp8_outliers.Config(outliers=(1e2, 3e4))
    res = fp8_outliers.run(cfg)
    per = res["recipes"]
    for i, o in enumerate(cfg.outliers):
        x = np.asarray(jax.device_get(fp8_outliers.make_tensor(cfg, o)), np.float32)
        normal = x[:, 128:]
        tensor = _qdq_numpy(x, np.abs(x).max() / np.float32(448))
        row = _blocked(x, 1024, lambda a: a / np.float32(448))
        block = _blocked(x, 128, lambda a: a / np.float32(448))
        # OCP MX v1.0: X = 2^(floor(log2 amax) - 8), 8 = exponent of E4M3's largest normal.
        mx = _blocked(x, 32, lambda a: np.ldexp(np.float32(1), np.frexp(a)[1] - 1 - 8))
        for name, q in [("tensor", tensor), ("row", row), ("block", block), ("mx", mx)]:
            # fmtkit multiplies by 1/scale where NumPy divides (a rare value may round to
            # the other neighbour) and sums the norms in another order in f32: 1e-4 covers
            # both (measured: ~1e-7).
            assert per[name]["rel_error"][i] == pytest.approx(_rel(q[:, 128:], normal),
                                                              rel=1e-4), (name, o)
    t, b = per["tensor"]["rel_error"], per["block"]["rel_error"]
    assert t[1] > 3 * b[1]  # outlier 3e4: per-tensor loses, blocks do not
    assert b[0] == pytest.approx(b[1], rel=1e-6)  # blocks are blind to the outlier size
    assert 0.02 < b[1] < 0.03  # E4M3's own precision (seed: a flat 2.6%)
    assert_plots(fp8_outliers.plot(res, tmp_path))
