"""Per-expert statistics of the FP8 grouped GEMM (``lax.ragged_dot`` under an FP8 preset,
``fmtkit.fp8.ragged_dot``): one value per expert, against a float64 NumPy / ml_dtypes
emulation that computes each expert's tensors directly.

Tokens are sorted by expert: rows ``[start_g, start_g + group_sizes[g])`` of the activation
meet expert g's weight. Expert g's activation, output, output gradient and data gradient are
those rows; its weight and weight gradient its slice of the stack. An expert that received
no token has no data in its row tensors (NaN). Per-tensor current scaling (``fp8-current``):
one E4M3 scale for all tokens of the activation, one E5M2 scale for the whole output
gradient, one E4M3 scale per expert for the weight stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import fmtkit.debug as debug
from fmtkit import with_policy

pytestmark = pytest.mark.slow  # each test compiles a training step (a few seconds)

BF16, E4M3, E5M2 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
M, K, N = 16, 8, 12
GROUPS = np.array([5, 0, 7], np.int32)  # expert 1 gets no token; rows 12..15 none at all
QSTATS = ("amax", "sqnr_db", "underflow_share", "nonfinite_count", "scale_min", "scale_max")


def moe(params, x, group_sizes):
    return lax.ragged_dot(x, params["experts"], group_sizes) @ params["out"]


k = jax.random.split(jax.random.key(0), 4)
EXPERTS = jax.random.normal(k[0], (3, K, N)) * jnp.array([1.0, 4.0, 0.25])[:, None, None]
PARAMS = {"experts": EXPERTS, "out": jnp.ones((N, 1))}  # out: dy of the experts = c, exact
# Two activations far below E4M3's smallest subnormal after scaling: they underflow.
X = jax.random.normal(k[1], (M, K)).at[6, :2].set(1e-6)
C = jax.random.normal(k[2], (M, 1)).astype(jnp.bfloat16).astype(jnp.float32)


def bf(v):
    return np.asarray(v, np.float32).astype(BF16).astype(np.float64)


def qdq(v, fmt):
    """Per-tensor current scaling of v (float64 holding bf16 values): scale = amax *
    f32(1/max), values = fmt(clip(v * f32(1/scale), +-max)); (dequantized in float64,
    scale)."""
    top = float(ml_dtypes.finfo(fmt).max)
    scale = np.float32(np.abs(v).max()) * np.float32(1 / top)
    q = np.clip(v.astype(np.float32) * (np.float32(1) / scale), -top, top).astype(fmt)
    return q.astype(np.float64) * np.float64(scale), scale


def qstats(v, d, scale):
    return {"amax": np.abs(v).max(), "scale_min": scale, "scale_max": scale,
            "sqnr_db": 10 * np.log10(np.sum(v**2) / np.sum((v - d) ** 2)),
            "underflow_share": np.sum((v != 0) & (d == 0)) / np.sum(v != 0),
            "nonfinite_count": np.sum(~np.isfinite(v))}


def emulated() -> dict:
    """{tensor: {stat: [per expert]}}, each expert's tensors computed directly."""
    x, w = bf(X), bf(PARAMS["experts"])
    dy = np.broadcast_to(bf(C), (M, N))
    (xd, sx), (dyd, sdy) = qdq(x, E4M3), qdq(dy, E5M2)  # one scale for all tokens
    wd, sw = zip(*(qdq(w[g], E4M3) for g in range(3)))  # one scale per expert
    ends = np.cumsum(GROUPS)
    rows = [np.arange(e - s, e) for s, e in zip(GROUPS, ends)]
    out = {t: {s: [] for s in QSTATS} for t in ("activation", "weight", "output_grad")}
    out.update({t: {"amax": []} for t in ("output", "dgrad", "wgrad")})
    for g in range(3):
        r = rows[g]
        per = {"activation": (x[r], xd[r], sx), "weight": (w[g], wd[g], sw[g]),
               "output_grad": (dy[r], dyd[r], sdy)}
        for t, (v, d, sc) in per.items():
            for s, val in (qstats(v, d, sc) if v.size else dict.fromkeys(QSTATS, np.nan)
                           ).items():
                out[t][s].append(val)  # no token: no data
        y = bf(xd[r] @ wd[g])                          # FP8 forward GEMM, bf16 result
        dx = bf(dyd[r] @ wd[g].T)                      # FP8 dgrad GEMM
        dw = bf(xd[r].T @ dyd[r])                      # FP8 wgrad GEMM of expert g's tokens
        for t, v in (("output", y), ("dgrad", dx), ("wgrad", dw)):
            out[t]["amax"].append(np.abs(v).max() if v.size else np.nan)
    return out


def captured(cfg, params=PARAMS):
    model = with_policy(moe, "fp8-current")
    gs = jnp.asarray(GROUPS)

    def loss(p):
        return jnp.sum(model(p, X, gs).astype(jnp.float32) * C)

    state = debug.init(cfg, loss, params)

    @jax.jit
    def step(p, s):
        def f(p, s):
            with debug.capture(cfg, s, 0):
                return loss(p)
        return jax.grad(f, argnums=(0, 1))(p, s)[1]

    return state, jax.device_get(step(params, state))


def test_per_expert_statistics_equal_an_emulation_of_each_experts_tensors():
    # (the quantization statistics apply to the quantized operands only)
    cfg = debug.DebugConfig([debug.Rule("", gemm="ragged", stats=QSTATS)])
    state, stats = captured(cfg)
    entry = stats[""]["ragged_dot_general_0"]
    assert {t: {s: np.shape(v) for s, v in e.items()} for t, e in state[""][
        "ragged_dot_general_0"].items()} == {
        t: {s: (3,) for s in (QSTATS if t in ("activation", "weight", "output_grad")
                              else ("amax",))}
        for t in ("activation", "weight", "output", "output_grad", "dgrad", "wgrad")}
    want = emulated()
    for t, per in want.items():
        for s, values in per.items():
            got = np.asarray(entry[t][s], np.float64)
            if s == "sqnr_db":
                # 10 log10 of a ratio of f32 sums of at most a few hundred terms
                np.testing.assert_allclose(got, values, rtol=0, atol=1e-4, err_msg=f"{t}/{s}")
            elif t in ("output", "dgrad", "wgrad"):
                # f32 accumulation of the FP8 products (float64 here) before the bf16
                # rounding: at most one bf16 step apart
                np.testing.assert_allclose(got, values, rtol=2.0**-8, err_msg=f"{t}/{s}")
            else:  # exact: maxima, counts, and a ratio of counts rounded once to f32
                np.testing.assert_array_equal(got, np.asarray(values, np.float32),
                                              err_msg=f"{t}/{s}")


def test_the_autopilot_watches_the_experts_and_moves_them_on_a_nonfinite_weight():
    ap = debug.Autopilot()
    params = {**PARAMS, "experts": PARAMS["experts"].at[2, 0, 0].set(jnp.inf)}
    state, stats = captured(ap.config(), params)
    assert "ragged_dot_general_0" in state[""]
    counts = stats[""]["ragged_dot_general_0"]["weight"]["nonfinite_count"]
    np.testing.assert_array_equal(counts, [0, 0, 1])
    _, decisions = ap.update(ap.init(state), stats, step=0)
    assert [(d.gemm, d.tensor, d.stat, d.setting) for d in decisions] == [
        ("ragged_dot_general_0", "weight", "nonfinite_count", "blockwise")]
