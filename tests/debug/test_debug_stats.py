"""fmtkit.debug's statistics equal a float64 NumPy computation on the same GEMM tensors.

The tensors are captured independently of fmtkit.debug: a hook on the policy's GEMMs
(``intercept_gemms``) adds zero arrays to each GEMM's operands and output, so the gradient
with respect to those zeros is the GEMM's dgrad, wgrad and output gradient, and the forward
tensors are returned as the loss's auxiliary output. The quantization statistics replay the
recipe's quantization with ``fmtkit.scaling`` on the operand laid out as its GEMM reads it,
and compute every statistic in NumPy float64.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmtkit.debug as debug
from fmtkit import dequantize, quantize, with_policy
from fmtkit.policy import intercept_gemms

# Sums of a few thousand f32 terms (mean, std, norms, mse) against float64: the f32
# accumulation's relative error stays well below 1e-5 at these sizes.
RTOL = 1e-5
# Clipping thresholds, hand-derived: the largest value plus half the last step (E4M3:
# 448 + 32/2; E5M2: 57344 + 8192/2).
CLIP = {"float8_e4m3fn": 464.0, "float8_e5m2": 61440.0}


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(nn.Dense(160)(x))
        return nn.Dense(8)(h)


def _linen_case(preset):
    model = with_policy(Mlp(), preset)
    x = jax.random.normal(jax.random.key(1), (6, 40), jnp.float32)
    c = jax.random.normal(jax.random.key(2), (6, 8), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def loss(p):
        return jnp.sum(model.apply(p, x).astype(jnp.float32) * c)

    return loss, params


def _function_case(preset):
    def f(params, x):
        w1, w2 = params
        return jnp.sum(jnp.tanh(x @ w1) @ w2)

    model = with_policy(f, preset)
    k = jax.random.split(jax.random.key(3), 3)
    params = (jax.random.normal(k[0], (24, 48)) * 0.3, jax.random.normal(k[1], (48, 5)))
    x = jax.random.normal(k[2], (10, 24))
    return (lambda p: model(p, x)), params


def _captured(loss, params):
    """{(path, gemm): (site, {tensor: array})} by the zero-addition hook (module docstring)."""
    found = {}

    def shapes(site, run, a, b):
        y = run(a, b, site.fp8)
        found[(site.path, site.name)] = (site, [jax.ShapeDtypeStruct(t.shape, t.dtype)
                                                for t in (a, b, y)])
        return y

    with intercept_gemms(shapes):
        jax.eval_shape(loss, params)
    eps = {f"{p}|{n}": [jnp.zeros(s.shape, s.dtype) for s in v[1]]
           for (p, n), v in found.items()}

    def wrapped(params, eps):
        store = {}

        def hook(site, run, a, b):
            ea, eb, ey = eps[f"{site.path}|{site.name}"]
            a, b = a + ea, b + eb
            y = run(a, b, site.fp8) + ey
            store[f"{site.path}|{site.name}"] = (a, b, y)
            return y

        with intercept_gemms(hook):
            out = loss(params)
        return out, store

    (_, geps), store = jax.jit(jax.grad(wrapped, argnums=(0, 1), has_aux=True))(params, eps)
    out = {}
    for (p, n), (site, _) in found.items():
        a, b, y = store[f"{p}|{n}"]
        da, db, dy = geps[f"{p}|{n}"]
        out[(p, n)] = (site, {"activation": a, "weight": b, "output": y, "output_grad": dy,
                              "dgrad": da, "wgrad": db})
    return out


def _np_base(x):
    x = np.asarray(x, np.float64)
    a = np.abs(x)

    def dr(v):
        nz = v[v > 0]
        return float(np.log2(v.max() / nz.min())) if nz.size else 0.0

    rows = a.reshape(-1, a.shape[-1])
    tiles = [dr(r[i:i + 128]) for r in rows for i in range(0, r.size, 128)]
    return {"min": x.min(), "max": x.max(), "mean": x.mean(), "std": x.std(),
            "l1_norm": a.sum(), "l2_norm": np.sqrt((x * x).sum()), "amax": a.max(),
            "dynamic_range": dr(a), "max_blockwise_dynamic_range": max(tiles)}


def _np_quant(x2, fmt, scaling):
    """Replays the quantization of a 2-D [free, contraction] operand with fmtkit.scaling
    (zero-padded to whole blocks, as the GEMM does) and computes the statistics in float64."""
    block = getattr(scaling, "block", (1, 1))
    block = (1, block) if isinstance(block, int) else tuple(block)
    f, c = x2.shape
    bf = block[0] if block[0] > 1 else 1
    bc = block[1] if block[1] > 1 else 1
    padded = jnp.pad(x2, ((0, -f % bf), (0, -c % bc)))
    sa = quantize(padded, fmt, scaling)
    d = np.asarray(dequantize(sa, jnp.float32), np.float64)[:f, :c]
    s = np.asarray(sa.scale, np.float64)
    s = np.repeat(np.repeat(s, padded.shape[0] // s.shape[0], 0),
                  padded.shape[1] // s.shape[1], 1)[:f, :c]
    x = np.asarray(x2, np.float64)
    err = (x - d) ** 2
    nz = x != 0
    return {"underflow_share": (nz & (d == 0)).sum() / nz.sum(),
            "saturation_share": (np.abs(x) / s > CLIP[sa.fmt.name]).mean(),
            "nonfinite_count": float((~np.isfinite(x)).sum()),
            "scale_min": s.min(), "scale_max": s.max(),
            "sqnr_db": 10 * np.log10((x * x).sum() / err.sum()), "mse": err.mean()}


def _debug_stats(loss, params, cfg, step=0):
    state = debug.init(cfg, loss, params)

    def f(p, s, i):
        with debug.capture(cfg, s, i):
            return loss(p)

    value, (g, stats) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, state, step)
    return state, value, g, stats


@pytest.mark.parametrize("case", ["linen", "function"])
@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-current", "fp8-blockwise"])
def test_every_statistic_matches_numpy_float64(case, preset):
    loss, params = (_linen_case if case == "linen" else _function_case)(preset)
    captured = _captured(loss, params)
    cfg = debug.DebugConfig([debug.Rule("")])
    _, value, grads, stats = _debug_stats(loss, params, cfg)
    # The taps change no number: loss and parameter gradients as without debugging.
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(params)
    assert value == ref_value
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), grads,
                                            ref_grads)))
    quantized = 0
    for (path, name), (site, tensors) in captured.items():
        got = stats[path][name]
        assert set(got) == set(debug.TENSORS)
        for t, x in tensors.items():
            want = _np_base(x)
            if site.fp8 is not None and t in ("activation", "weight", "output_grad"):
                recipe = site.fp8
                a2 = {"activation": x, "weight": x.T, "output_grad": x}[t]  # [free, contr.]
                fmt, op = {"activation": (recipe.x_format, "x"),
                           "weight": (recipe.w_format, "w"),
                           "output_grad": (recipe.grad_format, "grad")}[t]
                want.update(_np_quant(a2, fmt, recipe.scaling(op)))
                quantized += 1
            assert set(got[t]) == set(want), (path, name, t)
            for s, v in want.items():
                np.testing.assert_allclose(float(got[t][s]), v, rtol=RTOL, atol=0,
                                           err_msg=f"{path}/{name}/{t}/{s}")
    assert quantized == (0 if preset == "bf16-mixed" else 3)


def test_quantization_statistics_count_clipping_and_underflow():
    # An unscaled E4M3 cast (tile "none"): 1000 and -500 clip to 448 (|x| > 464), 470 too,
    # 460 rounds to 448 without clipping; 1e-4 flushes to zero (below E4M3's smallest
    # subnormal 2^-9 / 2); inf is non-finite.
    from fmtkit.debug._stats import Quantization, quant_stats

    x = jnp.asarray([[1000.0, -500.0, 470.0, 460.0, 1e-4, 1.0, 0.0, jnp.inf]])[None]
    got = quant_stats(x, Quantization("e4m3", None), debug.QUANT_STATS)
    assert float(got["saturation_share"]) == 4 / 8  # 1000, -500, 470, inf
    assert float(got["underflow_share"]) == np.float32(1 / 7)  # an f32 statistic
    assert float(got["nonfinite_count"]) == 1.0
    assert float(got["scale_min"]) == float(got["scale_max"]) == 1.0
