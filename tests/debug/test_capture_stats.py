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
from fmtkit import TensorScaling, dequantize, quantize, with_policy
from fmtkit._switches import flipped
from fmtkit.policy import intercept_gemms

# Sums of a few thousand f32 terms (mean, std, norms, mse) against float64: the f32
# accumulation's relative error stays well below 1e-5 at these sizes.
RTOL = 1e-5
# SQNR in dB is 10 log10 of a ratio of such sums: its absolute error is about 4.3 times the
# ratio's relative error (an SQNR near 0 dB has no meaningful relative tolerance).
SQNR_ATOL = 1e-4
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


def _nnx_case(preset):
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(40, 160, rngs=rngs)
            self.out = nnx.Linear(160, 8, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.fc(x)))

    model = with_policy(Mlp(nnx.Rngs(0)), preset)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (6, 40), jnp.float32)

    def loss(p):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, p, rest)(x).astype(jnp.float32)))

    return loss, params


def _equinox_case(preset):
    import equinox as eqx

    class Mlp(eqx.Module):
        fc: eqx.nn.Linear
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.fc = eqx.nn.Linear(40, 160, key=k1)
            self.out = eqx.nn.Linear(160, 8, key=k2)

        def __call__(self, x):  # one example; eqx.nn.Linear computes weight @ x + bias
            return self.out(jax.nn.relu(self.fc(x)))

    params, static = eqx.partition(Mlp(jax.random.key(0)), eqx.is_array)
    forward = with_policy(lambda m, x: jax.vmap(m)(x), preset)
    x = jax.random.normal(jax.random.key(1), (6, 40), jnp.float32)
    c = jax.random.normal(jax.random.key(2), (6, 8), jnp.float32)

    def loss(p):
        return jnp.sum(forward(eqx.combine(p, static), x).astype(jnp.float32) * c)

    return loss, params


CASES = {"linen": _linen_case, "nnx": _nnx_case, "function": _function_case,
         "equinox": _equinox_case}


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
        if site.weight_operand == 0:  # the weight on the left (Equinox's weight @ x)
            (a, da), (b, db) = (b, db), (a, da)
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


def _np_quant(x2, fmt, scaling, amax=None):
    """Replays the quantization of a 2-D [free, contraction] operand with fmtkit.scaling
    (zero-padded to whole blocks, as the GEMM does) and computes the statistics in float64."""
    block = getattr(scaling, "block", (1, 1))
    block = (1, block) if isinstance(block, int) else tuple(block)
    f, c = x2.shape
    bf = block[0] if block[0] > 1 else 1
    bc = block[1] if block[1] > 1 else 1
    padded = jnp.pad(x2, ((0, -f % bf), (0, -c % bc)))
    sa = quantize(padded, fmt, scaling, amax=amax)
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


# Every framework under fp8-current, each other preset on one framework in the fast set;
# the whole grid under `make test-all`.
_FAST = {("fp8-current", c) for c in CASES} | {("bf16-mixed", "function"),
                                               ("fp8-blockwise", "linen")}


@pytest.mark.parametrize(("preset", "case"), [
    pytest.param(p, c, id=f"{p}-{c}",
                 marks=() if (p, c) in _FAST else pytest.mark.slow)
    for p in ("bf16-mixed", "fp8-current", "fp8-blockwise") for c in sorted(CASES)])
def test_every_statistic_matches_numpy_float64(preset, case):
    _check(case, preset)


# A delayed recipe's histories, row maxima x, w, grad: below the tensors' own amaxes, so
# values saturate (the recorded amax decides the scale, as after a jump in the data).
DELAYED_AMAX = (0.5, 0.05, 1e-3)


def test_delayed_scaling_statistics_match_numpy_float64():
    loss, variables = _linen_case("fp8-delayed")
    hist = jnp.zeros((3, 1024)).at[:, 3].set(jnp.asarray(DELAYED_AMAX))
    variables = {**variables, "fp8_state": {"Dense_0:dot0": hist}}
    captured = _captured(loss, variables)
    _, _, _, stats = _debug_stats(loss, variables, debug.DebugConfig([debug.Rule("Dense_0")]))
    site, tensors = captured[("Dense_0", "dot_general_0")]
    recipe = site.fp8
    assert recipe.delayed
    got = stats["Dense_0"]["dot_general_0"]
    for t, a2, fmt, amax in (("activation", tensors["activation"], recipe.x_format, 0.5),
                             ("weight", tensors["weight"].T, recipe.w_format, 0.05),
                             ("output_grad", tensors["output_grad"], recipe.grad_format,
                              1e-3)):
        want = _np_quant(a2, fmt, TensorScaling(recipe.power_of_two, recipe.margin),
                         jnp.float32(amax))
        assert want["saturation_share"] > 0, t
        for s, v in want.items():
            np.testing.assert_allclose(float(got[t][s]), v, rtol=RTOL,
                                       atol=SQNR_ATOL if s == "sqnr_db" else 0,
                                       err_msg=f"{t}/{s}")


def test_the_comparison_sees_a_wrong_operand_layout():
    # Negative control: quantization statistics of the weight replayed on the kernel as
    # stored ([K, N]) instead of as the GEMM reads it ([N, K]); row-wise scales then differ.
    with flipped(debug_weight_as_read=False), pytest.raises(AssertionError,
                                                             match="weight/scale_m"):
        _check("linen", "fp8-rowwise")


def _free_contraction(x, contracting):
    """A 2-D GEMM operand laid out [free, contraction] (its contracting axis last)."""
    assert x.ndim == 2 and len(contracting) == 1
    return x.T if int(contracting[0]) % 2 == 0 else x


def _check(case, preset):
    loss, params = CASES[case](preset)
    captured = _captured(loss, params)
    cfg = debug.DebugConfig([debug.Rule("")])
    _, value, grads, stats = _debug_stats(loss, params, cfg)
    # The taps change no number: loss and parameter gradients as without debugging.
    # Equinox's jax.vmap(model)(x) runs each GEMM as weight @ x and transposes the output;
    # without the taps XLA folds that transpose into the head's dot (a bf16 dot of two
    # transposed operands into f32), which sums the loss in another order (1 ulp; a few
    # ulp where the hidden GEMM is FP8): there only the statistics are compared.
    if case != "equinox" or preset == "bf16-mixed":
        ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(params)
        if case == "equinox":
            np.testing.assert_array_max_ulp(np.asarray(value), np.asarray(ref_value), 1)
        else:
            assert value == ref_value
        assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), grads,
                                                ref_grads)))
    quantized = 0
    # The weight is the parameter, whichever side of the GEMM it is written on: the tensor
    # filed as "weight" has a parameter's shape, the one filed as "activation" has not.
    param_shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(params) if leaf.ndim == 2}
    for (path, name), (site, tensors) in captured.items():
        got = stats[path][name]
        assert set(got) == set(debug.TENSORS)
        if site.fp8 is not None:
            assert tuple(tensors["weight"].shape) in param_shapes, (path, name)
            assert tuple(tensors["activation"].shape) not in param_shapes, (path, name)
        for t, x in tensors.items():
            want = _np_base(x)
            if site.fp8 is not None and t in ("activation", "weight", "output_grad"):
                recipe = site.fp8
                # [free, contraction] as the GEMM contracts it (Flax's kernel [K, N] is
                # transposed, Equinox's weight [N, K] is not); the output gradient [M, N] is
                # contracted along N by the data-gradient GEMM (Equinox's weight @ x under
                # jax.vmap gives its output as [N, M]).
                (lc, rc), _ = site.dimension_numbers
                left = site.weight_operand == 0
                ac, wc = (rc, lc) if left else (lc, rc)
                a2 = {"activation": _free_contraction(x, ac),
                      "weight": _free_contraction(x, wc),
                      "output_grad": x.T if left else x}[t]
                fmt, op = {"activation": (recipe.x_format, "x"),
                           "weight": (recipe.w_format, "w"),
                           "output_grad": (recipe.grad_format, "grad")}[t]
                want.update(_np_quant(a2, fmt, recipe.scaling(op)))
                quantized += 1
            assert set(got[t]) == set(want), (path, name, t)
            for s, v in want.items():
                np.testing.assert_allclose(float(got[t][s]), v, rtol=RTOL,
                                           atol=SQNR_ATOL if s == "sqnr_db" else 0,
                                           err_msg=f"{path}/{name}/{t}/{s}")
    assert quantized == (0 if preset == "bf16-mixed" else 3)


def test_quantization_statistics_count_clipping_and_underflow():
    # An unscaled E4M3 cast (tile "none"): 1000 and -500 clip to 448 (|x| > 464), 470 too,
    # 460 rounds to 448 without clipping; 1e-4 flushes to zero (below E4M3's smallest
    # subnormal 2^-9 / 2); inf is non-finite.
    from fmtkit.stats import Quantization, quant_stats

    x = jnp.asarray([[1000.0, -500.0, 470.0, 460.0, 1e-4, 1.0, 0.0, jnp.inf]])[None]
    got = quant_stats(x, Quantization("e4m3", None), debug.QUANT_STATS)
    assert float(got["saturation_share"]) == 4 / 8  # 1000, -500, 470, inf
    assert float(got["underflow_share"]) == np.float32(1 / 7)  # an f32 statistic
    assert float(got["nonfinite_count"]) == 1.0
    assert float(got["scale_min"]) == float(got["scale_max"]) == 1.0
