"""A GEMM in the branch of ``lax.cond`` that a step does not take has no statistics that
step: NaN ("no data", as on a step that does not log), never made-up zeros; the autopilot
leaves it alone and ``fmtkit debug`` does not rank it. The branch that runs has the
statistics of a float64 NumPy / ml_dtypes emulation of its per-tensor E4M3 quantization.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import fmtkit.debug as debug
from fmtkit import with_policy
from fmtkit.debug.log import StatsLogger

pytestmark = pytest.mark.slow  # each test compiles a training step (a few seconds)

STATS = ("amax", "sqnr_db", "underflow_share", "nonfinite_count")
# SQNR is 10 log10 of a ratio of f32 sums of a few hundred terms: their relative error is far
# below 1e-6, so the dB value is within 1e-4 of the float64 one.
SQNR_ATOL = 1e-4


def f(params, x, flag):
    h = lax.cond(flag, lambda x: x @ params["a"], lambda x: x @ params["b"], x)
    return jnp.tanh(h) @ params["out"]


k = jax.random.split(jax.random.key(0), 4)
PARAMS = {"a": jax.random.normal(k[0], (8, 16)), "b": 3 * jax.random.normal(k[1], (8, 16)),
          "out": jax.random.normal(k[2], (16, 4))}
# Three activations far below E4M3's smallest subnormal after scaling: they underflow.
X = jax.random.normal(k[3], (32, 8)).at[0, :3].set(1e-6)
CFG = debug.DebugConfig([debug.Rule("", tensors=("activation", "weight"), stats=STATS)])
# lax.cond's branches are (false_fn, true_fn): the GEMMs are named in that order.
GEMM = {False: "dot_general_0", True: "dot_general_1"}


def statistics(flag):
    model = with_policy(f, "fp8-current")

    def loss(p, flag):
        return jnp.sum(model(p, X, flag).astype(jnp.float32))

    state = debug.init(CFG, loss, PARAMS, True)

    @jax.jit
    def step(p, s, flag, i):
        def g(p, s):
            with debug.capture(CFG, s, i):
                return loss(p, flag)
        return jax.grad(g, argnums=(0, 1))(p, s)[1]

    return state, jax.device_get(step(PARAMS, state, flag, 0))[""]


def emulated(x):
    """STATS of a bf16 operand under per-tensor current E4M3 scaling, by NumPy + ml_dtypes:
    scale = amax * f32(1/448), values = e4m3(clip(x * f32(1/scale), +-448))."""
    xb = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    amax = np.float32(np.abs(xb).max())
    scale = amax * np.float32(1 / 448)
    q = np.clip(xb * (np.float32(1) / scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    d = q.astype(np.float64) * np.float64(scale)
    x64 = xb.astype(np.float64)
    return {"amax": float(amax),
            "sqnr_db": 10 * np.log10(np.sum(x64**2) / np.sum((x64 - d) ** 2)),
            "underflow_share": np.sum((x64 != 0) & (d == 0)) / np.sum(x64 != 0),
            "nonfinite_count": 0.0}


@pytest.mark.parametrize("flag", [True, False])
def test_the_branch_not_taken_has_no_data_and_the_taken_one_its_statistics(flag):
    _, stats = statistics(flag)
    skipped = stats[GEMM[not flag]]
    assert all(np.isnan(v) for t in skipped.values() for v in t.values()), skipped
    ran = stats[GEMM[flag]]
    w = PARAMS["a" if flag else "b"]
    for tensor, value in (("activation", X), ("weight", w)):
        want = emulated(value)
        got = ran[tensor]
        assert got["amax"] == want["amax"]
        assert got["underflow_share"] == want["underflow_share"]
        assert got["nonfinite_count"] == want["nonfinite_count"]
        np.testing.assert_allclose(got["sqnr_db"], want["sqnr_db"], rtol=0, atol=SQNR_ATOL)


def test_the_autopilot_and_the_report_ignore_the_branch_not_taken(tmp_path):
    state, stats = statistics(True)
    ap = debug.Autopilot(sqnr_db=100.0, underflow_share=None, saturation_share=None,
                         patience=1)
    _, decisions = ap.update(ap.init(state), {"": stats}, step=0)
    # Every GEMM that ran with quantized operands is below 100 dB; the one that did not run
    # is not moved.
    assert [(d.gemm, d.stat) for d in decisions] == [(GEMM[True], "sqnr_db")]
    # The log holds no value of the GEMM that did not run: fmtkit debug, which ranks the
    # values of stats.jsonl, cannot rank it.
    with StatsLogger(tmp_path, tensorboard=False) as log:
        log.write(0, {"": stats})
    [record] = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text()
                .splitlines()]
    assert {tag.split("/")[0] for tag in record["stats"]} == {GEMM[True], "dot_general_2"}


def test_a_scanned_layer_that_skips_its_gemm_has_no_data_in_that_slot():
    def g(params, x, use):
        def layer(h, inp):
            w, on = inp
            return jnp.tanh(lax.cond(on, lambda h: h @ w, lambda h: h, h)), None

        h, _ = lax.scan(layer, x, (params["layers"], use))
        return h @ params["out"]

    model = with_policy(g, "fp8-current")
    params = {"layers": jax.random.normal(k[0], (3, 8, 8)), "out": PARAMS["out"][:8]}
    use = jnp.array([True, False, True])
    cfg = debug.DebugConfig([debug.Rule("", gemm="dot_general_0", tensors=("weight",),
                                        stats=("amax",))])

    def loss(p):
        return jnp.sum(model(p, X, use).astype(jnp.float32))

    state = debug.init(cfg, loss, params)

    def f(p, s):
        with debug.capture(cfg, s, 0):
            return loss(p)

    amax = jax.jit(jax.grad(f, argnums=(0, 1)))(params, state)[1][""]["dot_general_0"]
    amax = np.asarray(amax["weight"]["amax"])
    # The layers' bf16 weights' amax where the layer ran, NaN where it skipped its GEMM.
    w = np.asarray(params["layers"]).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(amax, [np.abs(w[0]).max(), np.nan, np.abs(w[2]).max()])
