"""fmtkit.fp8: scaled dot_general with FP8 operands in all three GEMMs.

References are independent: float64 NumPy products of the unquantized inputs (accuracy), and
a float64 NumPy re-implementation of the documented per-tile quantization with ml_dtypes
casts (exactness up to f32 accumulation round-off).
"""

import dataclasses
import math
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jaxpr_utils import dot_operand_dtypes, iter_eqns, iter_eqns_with_trips

from fmtkit import fp8, scaling
from fmtkit.formats import get_format
from fmtkit.fp8 import _backends, _gemm
from fmtkit.scaling import BlockScaling, DelayedScalingState, ScaledArray

DN = (((1,), (0,)), ((), ()))  # x [M, K] · w [K, N]

# Accuracy floors per recipe on Gaussian data (SQNR in dB against float64 on the unquantized
# inputs). E4M3 has 3 mantissa bits: RNE noise alone is ~ 6.02 * 4 + 10.8 ≈ 30 dB per operand,
# and a product of two quantized operands loses ~3 dB. E5M2 (gradients of the per-tensor and
# row-wise recipes) has one bit less: ~6 dB lower on the gradient GEMMs.
SQNR_FLOOR = {
    #            forward, gradients
    "current": (25.0, 20.0),
    "delayed": (25.0, 20.0),
    "rowwise": (25.0, 20.0),
    "blockwise": (25.0, 25.0),
    "mxfp8": (25.0, 25.0),
}


def _data(m=256, k=512, n=256, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (m, k), jnp.float32)
    w = jax.random.normal(k2, (k, n), jnp.float32) / np.sqrt(k)
    dy = jax.random.normal(k3, (m, n), jnp.float32)
    return x, w, dy


def _sqnr(ref, y):
    ref, y = np.asarray(ref, np.float64), np.asarray(y, np.float64)
    return 10 * np.log10(np.sum(ref**2) / np.sum((ref - y) ** 2))


def _fwd_bwd(recipe, x, w, dy, state=None):
    dg = fp8.dot_general_fn(recipe)
    kw = {} if state is None else {"fp8_state": state}
    y, vjp = jax.vjp(lambda a, b: dg(a, b, DN, **kw), x, w)
    gx, gw = vjp(dy)
    return y, gx, gw


@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_accuracy_against_float64(name):
    x, w, dy = _data()
    state = fp8.init_state() if fp8.RECIPES[name].delayed else None
    y, gx, gw = jax.jit(lambda a, b, g: _fwd_bwd(name, a, b, g, state))(x, w, dy)
    xr, wr, dyr = (np.asarray(a, np.float64) for a in (x, w, dy))
    fwd_floor, grad_floor = SQNR_FLOOR[name]
    assert _sqnr(xr @ wr, y) >= fwd_floor
    assert _sqnr(dyr @ wr.T, gx) >= grad_floor
    assert _sqnr(xr.T @ dyr, gw) >= grad_floor


def _np_block_qdq(t, block, fmt_dtype, fmax):
    """float64 reference of the documented tile quantization (scale = amax * f32(1/max))."""
    t = np.asarray(t, np.float32)
    f, c = t.shape
    bf, bc = block
    blocks = t.reshape(f // bf, bf, c // bc, bc)
    amax = np.abs(blocks).max(axis=(1, 3), keepdims=True)
    scale = (amax * np.float32(1.0 / fmax)).astype(np.float32)
    scale = np.where(amax == 0, np.float32(1.0), np.maximum(scale, np.float32(2.0**-126)))
    inv = (np.float32(1.0) / scale).astype(np.float32)
    vals = np.clip((blocks * inv).astype(np.float32), -fmax, fmax).astype(fmt_dtype)
    return (vals.astype(np.float64) * scale.astype(np.float64)).reshape(f, c)


def test_blockwise_equals_float64_reference_of_same_quantization():
    x, w, dy = _data()
    y, gx, gw = jax.jit(lambda a, b, g: _fwd_bwd("blockwise", a, b, g))(x, w, dy)
    e4m3, mx = ml_dtypes.float8_e4m3fn, 448.0
    # forward: x tiles 1x128 along K; w [N, K] blocks 128x128
    y_ref = _np_block_qdq(x, (1, 128), e4m3, mx) @ _np_block_qdq(w.T, (128, 128), e4m3, mx).T
    # dgrad: dy [M, N] tiles 1x128 along N; wᵀ as [K, N] blocks 128x128
    gx_ref = _np_block_qdq(dy, (1, 128), e4m3, mx) @ _np_block_qdq(w, (128, 128), e4m3, mx).T
    # wgrad: dyᵀ [N, M] and xᵀ [K, M], tiles 1x128 along the tokens M (128x1 of dy and x)
    gw_ref = (_np_block_qdq(dy.T, (1, 128), e4m3, mx)
              @ _np_block_qdq(x.T, (1, 128), e4m3, mx).T).T
    # Same quantized values; only f32 accumulation order differs (K = 512 terms).
    for got, ref in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2e-5, atol=2e-5)


def test_per_tensor_equals_float64_reference_of_same_quantization():
    x, w, dy = _data()
    y, gx, _ = jax.jit(lambda a, b, g: _fwd_bwd("current", a, b, g))(x, w, dy)
    m, k = x.shape
    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    xq = _np_block_qdq(x, (m, k), e4m3, 448.0)
    wq = _np_block_qdq(w.T, w.T.shape, e4m3, 448.0)
    dyq = _np_block_qdq(dy, dy.shape, e5m2, 57344.0)
    np.testing.assert_allclose(np.asarray(y, np.float64), xq @ wq.T, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(gx, np.float64), dyq @ wq, rtol=2e-5, atol=2e-5)


def _on_h200():
    """Traces as for an H200 (``fp8``'s GPU checks read the abstract mesh's device)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev))


@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_all_three_gemms_take_fp8_operands(name):
    """On a GPU every GEMM of every recipe's pure-JAX path is an FP8 dot (where no kernel
    backend takes it). (Off GPUs the power-of-two recipes fold their scales into one f32
    dot: see the next test.)"""
    x, w, dy = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _data(128, 256, 128))
    recipe = dataclasses.replace(fp8.RECIPES[name], use_kernel="never")
    state = fp8.init_state() if recipe.delayed else None
    with _on_h200():
        jaxpr = jax.make_jaxpr(lambda a, b, g: _fwd_bwd(recipe, a, b, g, state))(x, w, dy)
    dots = dot_operand_dtypes(jaxpr, entered=True)  # the dtypes entering the dots
    assert len(dots) == 3
    for dtypes in dots:
        assert all(jnp.dtype(d).itemsize == 1 for d in dtypes), dtypes


_POW2_RECIPES = {
    "mxfp8": fp8.RECIPES["mxfp8"],
    "blockwise-pow2": dataclasses.replace(fp8.RECIPES["blockwise"], power_of_two=True),
}


@pytest.mark.parametrize("name", [*fp8.RECIPES, "blockwise-pow2"])
def test_off_gpu_fp8_dots_read_bf16_operands_and_power_of_two_scales_fold(name):
    """On CPU (XLA:CPU runs an FP8 dot as an f32 GEMM of converted operands, a bf16 one as
    its faster bf16 GEMM) every GEMM's dot reads its FP8 operands widened exactly to bf16,
    with f32 output, in a scope that names the FP8 formats for jaxpr readers
    (``inspect_policy``); a GEMM whose operands both have power-of-two block scales is one
    dot of the dequantized operands over the whole contraction, and other block-scaled
    GEMMs keep their per-block partials: one 2-D dot of a 128-block, run once per block
    (a ``lax.scan``), never a batched dot (XLA:CPU runs those in f32)."""
    recipe = _POW2_RECIPES.get(name, fp8.RECIPES.get(name))
    x, w, dy = _data(256, 384, 512)  # 2, 3 and 4 128-blocks along the three contractions
    state = fp8.init_state() if recipe.delayed else None
    jaxpr = jax.make_jaxpr(lambda a, b, g: _fwd_bwd(recipe, a, b, g, state))(x, w, dy)
    dots = [(e, trips) for e, trips in iter_eqns_with_trips(jaxpr)
            if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # one dot equation per GEMM
    # (contracted size, times it runs) of each GEMM: forward K, dgrad N, wgrad M
    per_block = [(128, 3), (128, 4), (128, 2)]
    whole = [(384, 1), (512, 1), (256, 1)]
    got = sorted((math.prod(e.invars[0].aval.shape[d] for d in e.params[
        "dimension_numbers"][0][0]), trips) for e, trips in dots)
    assert got == sorted(per_block if name == "blockwise" else whole), (name, got)
    formats = {"current": ("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"),
               "delayed": ("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"),
               "rowwise": ("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2")}.get(
                   name, ("float8_e4m3fn",) * 3)
    for e, _ in dots:
        assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16, jnp.bfloat16]  # exact
        assert e.outvars[0].aval.dtype == jnp.float32
        stack = str(e.source_info.name_stack)
        named = re.findall(re.escape(fp8.WIDENED_SCOPE) + r"-(\w+)-(\w+)", stack)
        assert named and set(named[-1]) <= set(formats), stack
        assert e.params["dimension_numbers"][1] == ((), ())  # no batched dot
    assert dot_operand_dtypes(jaxpr)  # the walker reports the formats, not bf16
    assert all(jnp.dtype(d).itemsize == 1 for pair in dot_operand_dtypes(jaxpr) for d in pair)


def test_delayed_bootstrap_history_and_accumulation():
    recipe = fp8.get_recipe("delayed")
    x, w, dy = _data(128, 256, 128)
    dg = fp8.dot_general_fn(recipe)

    def loss(x, w, state):
        return jnp.sum(dg(x, w, DN, fp8_state=state) * dy)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    state = fp8.init_state(recipe)
    # First step: bootstrapped from the current amax, so it equals "current" scaling exactly.
    y_delayed = dg(x, w, DN, fp8_state=state)
    y_current = fp8.dot_general_fn("current")(x, w, DN)
    np.testing.assert_array_equal(np.asarray(y_delayed), np.asarray(y_current))
    _, _, obs = grad(x, w, state)
    expected = [np.abs(np.asarray(x)).max(), np.abs(np.asarray(w)).max(),
                np.abs(np.asarray(dy)).max()]
    np.testing.assert_allclose(np.asarray(obs.amax_history[:, 0]), expected, rtol=0)
    state = fp8.update_state(state, obs)
    assert float(state.amax_history[0, 1]) == 0.0  # rolled: one step recorded
    # Four micro-batches of growing size: the recorded amax is the max over them.
    micro = [(x * s, w) for s in (0.5, 3.0, 1.0, 2.0)]
    acc = None
    for xm, wm in micro:
        o = grad(xm, wm, state)[2]
        acc = o if acc is None else fp8.combine_observations(acc, o)
    state = fp8.update_state(state, acc)
    assert float(state.amax_history[0, 1]) == expected[0]  # previous step rolled back
    np.testing.assert_allclose(float(state.amax_history[0, 0]), 3.0 * expected[0], rtol=1e-6)
    np.testing.assert_allclose(float(state.amax_history[0, 1]), expected[0], rtol=1e-6)
    # The scale now follows the history (max of 3x and 1x amax), not the current tensor.
    hist_scale = 3.0 * expected[0] * np.float32(1 / 448)
    y = dg(x, w, DN, fp8_state=state)
    xq = np.clip(np.asarray(x) / np.float32(hist_scale), -448, 448).astype(
        ml_dtypes.float8_e4m3fn)
    assert np.asarray(xq).astype(np.float32).std() < 448  # sanity: values in range
    assert not np.array_equal(np.asarray(y), np.asarray(y_current))


def test_margin_doubles_scale():
    base = fp8.get_recipe("current")
    x, w, _ = _data(128, 256, 128)
    y0 = fp8.dot_general_fn(base)(x, w, DN)
    y1 = fp8.dot_general_fn(dataclasses.replace(base, margin=1))(x, w, DN)
    assert _sqnr(np.asarray(y0), y1) > 10  # still accurate...
    assert not np.array_equal(np.asarray(y0), np.asarray(y1))  # ...but a different grid


def test_outlier_channels_blockwise_vs_per_tensor():
    """Seeds' comparison inside a real GEMM: 4 channels of x scaled by 1e4.

    w's rows for the first K-block (which holds the outlier channels) are zeroed, so the
    output measures how well the *other* channels survive quantization.
    """
    x, w, _ = _data(256, 512, 128)
    w = w.at[:128].set(0.0)

    def err(name, xx):
        y = np.asarray(fp8.dot_general_fn(name)(xx, w, DN), np.float64)
        ref = np.asarray(xx, np.float64) @ np.asarray(w, np.float64)
        return np.linalg.norm(y - ref) / np.linalg.norm(ref)

    for outlier, factor in ((1e4, 1.4), (3e4, 3.0)):
        x_out = x.at[:, :4].multiply(outlier)
        assert err("blockwise", x_out) < 1.1 * err("blockwise", x)  # format's own level
        # Per-tensor: normal channels fall into E4M3's subnormals (seeds: 4.9% at 1e4,
        # 14.1% at 3e4, against ~2.6% per operand for blocks).
        assert err("current", x_out) > factor * err("blockwise", x_out)


def test_bad_recipes():
    with pytest.raises(ValueError, match=r"FP8 recipes: current, delayed.*FP4 recipes: nvfp4"):
        fp8.get_recipe("fp8-magic")
    with pytest.raises(ValueError, match="unscaled gradients need E5M2's range"):
        fp8.Fp8Recipe(grad_format="e4m3", grad_tile="none")
    with pytest.raises(ValueError, match="is not a tiling"):
        fp8.Fp8Recipe(x_tile="1by128")
    with pytest.raises(ValueError, match="not an FP8/FP6/FP4 format"):
        fp8.Fp8Recipe(x_format="bf16")
    with pytest.raises(ValueError, match="pass fp8_state"):
        fp8.dot_general_fn("delayed")(jnp.ones((4, 4)), jnp.ones((4, 4)), DN)
    with pytest.raises(ValueError, match="use_kernel must be"):
        fp8.Fp8Recipe(use_kernel="always")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lhs must be a floating-point array"):
        fp8.dot_general_fn("current")(jnp.ones((4, 4), jnp.int32), jnp.ones((4, 4)), DN)


def test_general_dimension_numbers_match_lax():
    """DenseGeneral/Einsum-style dims: multiple contracting dims and a batch dim."""
    k1, k2 = jax.random.split(jax.random.key(3))
    lhs = jax.random.normal(k1, (2, 64, 4, 32), jnp.float32)  # B, T, heads, head_dim
    rhs = jax.random.normal(k2, (2, 4, 32, 128), jnp.float32)  # B, heads, head_dim, N
    dn = (((2, 3), (1, 2)), ((0,), (0,)))
    ref = jax.lax.dot_general(lhs, rhs, dn, precision="highest")
    got = fp8.dot_general_fn("blockwise")(lhs, rhs, dn)
    assert got.shape == ref.shape
    assert _sqnr(ref, got) > 25


def test_accumulation_emulation_promotion_matters():
    """Limited accumulation (13 mantissa bits) over K = 4096: promotion every 128 recovers."""
    k1, k2 = jax.random.split(jax.random.key(5))
    a = jax.random.uniform(k1, (8, 4096), jnp.float32)  # positive: errors do not cancel
    b = jax.random.uniform(k2, (8, 4096), jnp.float32)
    a8 = a.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    b8 = b.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    ref = np.asarray(a8, np.float64) @ np.asarray(b8, np.float64).T
    no_promo = fp8.limited_precision_matmul(a8, b8, mantissa_bits=13, promote_every=None)
    promo = fp8.limited_precision_matmul(a8, b8, mantissa_bits=13, promote_every=128)
    rel = lambda y: np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max()  # noqa: E731
    # Truncating a sum near 1000 to 13 bits drops up to 2^(10-13) = 0.125 per add: large.
    assert rel(no_promo) > 1e-3
    assert rel(promo) < rel(no_promo) / 4


def test_blockwise_reaches_the_pallas_kernel_for_all_three_gemms():
    """Guard: with the kernel requested, forward, dgrad and wgrad run the Pallas kernel
    (GPU-interpret mode on CPU) and agree with the pure-JAX path to f32 round-off."""
    import pallas_kernels  # noqa: F401  (importing it registers the kernel backend)

    recipe = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="interpret")
    x, w, dy = _data(128, 256, 128)
    kernel_fn = lambda a, b, g: _fwd_bwd(recipe, a, b, g)  # noqa: E731
    text = str(jax.make_jaxpr(kernel_fn)(x, w, dy))
    assert text.count("blockwise_fp8_matmul") >= 3
    assert "blockwise_fp8_matmul" not in str(jax.make_jaxpr(
        lambda a, b, g: _fwd_bwd("blockwise", a, b, g))(x, w, dy))  # CPU: the JAX path
    got = kernel_fn(x, w, dy)
    ref = _fwd_bwd("blockwise", x, w, dy)
    for g_, r_ in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g_), np.asarray(r_), rtol=1e-5, atol=1e-5)


def test_update_state_ignores_non_finite_observations():
    state = fp8.init_state(dataclasses.replace(fp8.RECIPES["delayed"], history=4))
    obs = DelayedScalingState(jnp.zeros((3, 4)).at[:, 0].set(jnp.array([1.0, 2.0, 3.0])))
    state = fp8.update_state(state, obs)
    bad = DelayedScalingState(jnp.zeros((3, 4)).at[:, 0].set(jnp.array([1.0, 2.0, jnp.inf])))
    same = fp8.update_state(state, bad)  # an overflowing step (skipped by loss scaling)
    np.testing.assert_array_equal(np.asarray(same.amax_history), np.asarray(state.amax_history))
    assert float(state.amax_history[2, 0]) == 3.0


# ---------------------------------------------------------------------------------------------
# Real shapes: every dimension that a tiling blocks is zero-padded inside the GEMM.

_FMT = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def _np_tile_qdq(t, tile, fmt):
    """float64 reference of one operand's quantization [F, C] (C the contraction) for the
    recipes' tilings, with edge blocks completed by zeros; returns the dequantized [F, C]."""
    dtype, fmax = _FMT[fmt]
    t = np.asarray(t, np.float32)
    f, c = t.shape
    if tile == "tensor":
        bf, bc = f, c
    elif tile == "row":
        bf, bc = 1, c
    elif tile == "mx32":
        bf, bc = 1, 32
    else:
        bf, bc = (int(v) for v in tile.split("x"))
    fp, cp = -(-f // bf) * bf, -(-c // bc) * bc
    padded = np.zeros((fp, cp), np.float32)
    padded[:f, :c] = t
    blocks = padded.reshape(fp // bf, bf, cp // bc, bc)
    amax = np.abs(blocks).max(axis=(1, 3), keepdims=True).astype(np.float64)
    if tile == "mx32":  # "rceil": the smallest power of two 2^k with amax <= 448 * 2^k
        k = np.ceil(np.log2(np.where(amax == 0, 1.0, amax / fmax)))
        k = np.where(amax > fmax * 2.0**k, k + 1, k)
        k = np.where(amax <= fmax * 2.0 ** (k - 1), k - 1, k)
        scale = np.where(amax == 0, 1.0, 2.0**k).astype(np.float32)
    else:
        scale = (amax.astype(np.float32) * np.float32(1.0 / fmax)).astype(np.float32)
        scale = np.where(amax == 0, np.float32(1.0), np.maximum(scale, np.float32(2.0**-126)))
    inv = (np.float32(1.0) / scale).astype(np.float32)
    vals = np.clip((blocks * inv).astype(np.float32), -fmax, fmax).astype(dtype)
    deq = vals.astype(np.float64) * scale.astype(np.float64)
    return deq.reshape(fp, cp)[:f, :c]


def _reference_gemms(recipe, x, w, dy):
    """float64 products of the recipe's quantized operands: y, dx, dw (w is [K, N])."""
    r = fp8.get_recipe(recipe)
    x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
    y = _np_tile_qdq(x, r.x_tile, r.x_format) @ _np_tile_qdq(w.T, r.w_tile, r.w_format).T
    dx = _np_tile_qdq(dy, r.grad_tile, r.grad_format) @ _np_tile_qdq(w, r.w_tile, r.w_format).T
    dw = (_np_tile_qdq(dy.T, r.grad_tile, r.grad_format)
          @ _np_tile_qdq(x.T, r.x_tile, r.x_format).T).T
    return y, dx, dw


# Sizes no block divides: 100 tokens (the weight gradient's contraction), K = 200, N = 72
# (a 10-class head or a vocabulary of 72 behaves the same), and one aligned case.
_ODD_SHAPES = [(100, 200, 72), (256, 130, 300), (128, 256, 128)]


@pytest.mark.parametrize("shape", _ODD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", [n for n in fp8.RECIPES if n != "delayed"])
def test_any_shape_equals_float64_reference_of_same_quantization(name, shape):
    m, k, n = shape
    x, w, dy = _data(m, k, n, seed=7)
    y, gx, gw = jax.jit(lambda a, b, g: _fwd_bwd(name, a, b, g))(x, w, dy)
    assert (y.shape, gx.shape, gw.shape) == ((m, n), (m, k), (k, n))
    # Same quantized values; the only difference is f32 accumulation (at most ~300 terms of
    # magnitude <= |ref| max): 1e-5 of the largest output covers it with room.
    for got, ref in zip((y, gx, gw), _reference_gemms(name, x, w, dy)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())


def test_delayed_any_shape_trains_a_step():
    x, w, dy = _data(100, 200, 72, seed=8)
    state = fp8.init_state()
    y, gx, gw = jax.jit(lambda a, b, g: _fwd_bwd("delayed", a, b, g, state))(x, w, dy)
    # first step bootstraps: equals current scaling, which the reference above checks
    y_ref, gx_ref, gw_ref = _reference_gemms("current", x, w, dy)
    for got, ref in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())


def test_padded_gemms_still_take_fp8_operands():
    x, w, dy = _data(100, 200, 72)
    dots = dot_operand_dtypes(jax.make_jaxpr(
        lambda a, b, g: _fwd_bwd("blockwise", a, b, g))(x, w, dy))
    assert len(dots) == 3
    assert all(jnp.dtype(d).itemsize == 1 for pair in dots for d in pair), dots


def test_errors_name_the_module():
    name = "Block_0/MlpBlock_0/Dense_1"
    with pytest.raises(ValueError, match=f"{name}.*pass fp8_state"):
        fp8.dot_general_fn("delayed", name=name)(jnp.ones((4, 4)), jnp.ones((4, 4)), DN)
    with pytest.raises(TypeError, match=f"{name}.*lhs must be a floating-point array"):
        fp8.dot_general_fn("current", name=name)(jnp.ones((4, 4), jnp.int32), jnp.ones((4, 4)),
                                              DN)
    with pytest.raises(ValueError, match=f"{name}.*lhs dim 1 .size 4. and rhs dim 0 .size 5"):
        fp8.dot_general_fn("current", name=name)(jnp.ones((4, 4)), jnp.ones((5, 4)), DN)
    stacked = DelayedScalingState(jnp.zeros((2, 3, 1024)))  # a scanned stack's whole state
    with pytest.raises(ValueError, match=f"{name}.*shape \\(2, 3, 1024\\).*variable_axes"):
        fp8.dot_general_fn("delayed", name=name)(jnp.ones((4, 4)), jnp.ones((4, 4)), DN,
                                              fp8_state=stacked)
    with pytest.raises(ValueError, match=f"{name}.*needs \\(2, 3, 1024\\) .one history per batch"):
        fp8.dot_general_fn("delayed", name=name)(
            jnp.ones((2, 4, 4)), jnp.ones((2, 4, 4)), (((2,), (1,)), ((0,), (0,))),
            fp8_state=fp8.init_state())


# ---------------------------------------------------------------------------------------------
# One delayed-scaling state and update rule.


def test_one_state_type_for_every_delayed_recipe():
    from fmtkit.scaling import DelayedScaling

    st = fp8.init_state()
    assert type(st) is DelayedScalingState
    assert st.amax_history.shape == (3, 1024) and st.count is None
    # The same rule records into both: a non-finite amax is skipped by each.
    d = DelayedScaling(history=4)
    s1 = d.update(d.init(), jnp.float32(jnp.inf))
    np.testing.assert_array_equal(np.asarray(s1.amax_history), np.zeros(4))
    assert int(s1.count) == 0


def test_delayed_bootstrap_is_per_row_of_the_history():
    """x's row is empty (bootstraps from the current amax); w's row holds 2.0 (used)."""
    recipe = dataclasses.replace(fp8.RECIPES["delayed"], history=4)
    x, w, _ = _data(64, 128, 64, seed=9)
    hist = jnp.zeros((3, 4)).at[1, 2].set(2.0)
    y = fp8.dot_general_fn(recipe)(x, w, DN, fp8_state=DelayedScalingState(hist))
    e4m3 = ml_dtypes.float8_e4m3fn

    def q(t, amax):
        scale = np.float32(amax) * np.float32(1 / 448)
        v = np.clip(np.asarray(t, np.float32) * (np.float32(1) / scale), -448, 448)
        return v.astype(e4m3).astype(np.float64) * np.float64(scale)

    ref = q(x, np.abs(np.asarray(x)).max()) @ q(w, 2.0)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5,
                               atol=1e-5 * np.abs(ref).max())


def test_update_state_on_a_stack_of_layers():
    """[L, 3, H] histories (a scanned stack): rolled along H, skipped per layer."""
    h = 4
    hist = np.zeros((3, 3, h), np.float32)
    hist[:, :, 0] = 1.0
    obs = np.zeros((3, 3, h), np.float32)
    obs[:, :, 0] = [[2, 3, 4], [5, np.inf, 6], [7, 8, 9]]
    tree = {"blocks": DelayedScalingState(jnp.asarray(hist)), "head": jnp.asarray(hist[0])}
    got = fp8.update_state(tree, {"blocks": DelayedScalingState(jnp.asarray(obs)),
                                  "head": jnp.asarray(obs[2])})
    want = hist.copy()
    for layer in (0, 2):  # layer 1 saw an inf: unchanged
        want[layer, :, 1:] = hist[layer, :, :-1]
        want[layer, :, 0] = obs[layer, :, 0]
    np.testing.assert_array_equal(np.asarray(got["blocks"].amax_history), want)
    np.testing.assert_array_equal(np.asarray(got["head"]), want[2])
    with pytest.raises(ValueError, match=r"\[\.\.\., 3, history\]"):
        fp8.update_state(jnp.zeros((4, 8)), jnp.zeros((4, 8)))


# ---------------------------------------------------------------------------------------------
# GEMM backend registry and recipe names.


def test_fp8_never_imports_a_kernel_package():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(fp8))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n and n.startswith("pallas_kernels")], names


def test_registered_backend_is_used_when_it_applies():
    calls = []

    def fake(a, a_scale, b, b_scale, *, impl, out_dtype):
        calls.append(impl)
        return fp8.scaled_matmul(
            ScaledArray(a, a_scale, get_format("e4m3"), None),
            ScaledArray(b, b_scale, get_format("e4m3"), None)).astype(out_dtype)

    saved = dict(_backends._GEMM_BACKENDS)
    try:
        _backends._GEMM_BACKENDS.clear()  # only the fake (pallas_kernels may be registered)
        fp8.register_gemm_backend("fake", fake, applies=lambda a, b: a.block == (1, 128),
                                  available=lambda: False)
        x, w, dy = _data(128, 256, 128)
        interp = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="interpret")
        got = _fwd_bwd(interp, x, w, dy)
        assert calls == ["interpret"] * 3
        ref = _fwd_bwd("blockwise", x, w, dy)  # "auto": registered, but not available here
        assert calls == ["interpret"] * 3
        for g_, r_ in zip(got, ref):
            np.testing.assert_allclose(np.asarray(g_), np.asarray(r_), rtol=1e-6, atol=1e-6)
        with pytest.raises(TypeError, match="applies must be callable"):
            fp8.register_gemm_backend("bad", fake, applies=None, available=lambda: True)
    finally:
        _backends._GEMM_BACKENDS.clear()
        _backends._GEMM_BACKENDS.update(saved)



def test_blockwise_on_a_gpu_without_a_kernel_package_warns_once(monkeypatch):
    """A GPU trace whose blockwise GEMMs find no kernel package (a checkout that is not
    installed has no entry point) says it runs them emulated, once; the result is the
    emulated GEMM's; with a package registered, or use_kernel="never", nothing is said."""
    x, w, dy = _data(128, 256, 128)
    ref = _fwd_bwd("blockwise", x, w, dy)
    monkeypatch.setattr(_backends, "_entry_points_loaded", True)
    monkeypatch.setattr(_backends, "_GEMM_BACKENDS", {
        k: v for k, v in _backends._GEMM_BACKENDS.items() if k in _backends._BUILT_IN})
    monkeypatch.setattr(_backends, "_warned_no_kernel", set())
    for mod in (_gemm, _backends):
        monkeypatch.setattr(mod, "on_gpu", lambda: True)
    with pytest.warns(UserWarning, match=r"'blockwise' .* runs its blockwise GEMMs emulated"):
        got = _fwd_bwd("blockwise", x, w, dy)
    for g_, r_ in zip(got, ref):  # the GPU path's operand layout: another f32 summation order
        np.testing.assert_allclose(np.asarray(g_), np.asarray(r_), rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fwd_bwd("blockwise", x, w, dy)  # once per recipe
        _fwd_bwd(dataclasses.replace(fp8.RECIPES["current"], name="current2"), x, w, dy)
        _fwd_bwd(dataclasses.replace(fp8.RECIPES["blockwise"], name="b2", use_kernel="never"),
                 x, w, dy)
        fp8.register_gemm_backend("other", lambda *a, **k: None, applies=lambda a, b: False,
                                  available=lambda: False)
        _fwd_bwd(dataclasses.replace(fp8.RECIPES["blockwise"], name="b3"), x, w, dy)

def test_recipes_print_what_they_are():
    assert str(fp8.RECIPES["blockwise"]) == "blockwise"
    assert str(dataclasses.replace(fp8.RECIPES["blockwise"], margin=1)) == "blockwise(margin=1)"
    custom = fp8.Fp8Recipe(x_tile="row", power_of_two=True)
    assert str(custom) == "custom(x_tile='row', power_of_two=True)"
    assert str(fp8.Fp8Recipe()) == "custom"


# ---------------------------------------------------------------------------------------------
# The fallback GEMM scales: no [K/block, M, N] intermediate.


def _blockwise_operands(m, k, n):
    """The blockwise GEMM on already-quantized operands (1x128 a, 128x128 b) and their
    abstract arguments: what the fallback itself allocates, without the quantization."""
    e4m3 = get_format("e4m3")
    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n // 128, k // 128), jnp.float32))

    def gemm(a, sa, b, sb):
        return fp8.scaled_matmul(ScaledArray(a, sa, e4m3, BlockScaling((1, 128))),
                                 ScaledArray(b, sb, e4m3, BlockScaling((128, 128))))

    return gemm, args


def test_fallback_has_no_per_block_partials_array():
    # All partials at once would be an [8, 2048, 1024] f32 array (64 MiB), over the budget,
    # so the 8 K-blocks are accumulated one at a time.
    m, k, n = 2048, 1024, 1024
    assert 4 * (k // 128) * m * n > fp8.PARTIALS_BUDGET_BYTES
    gemm, args = _blockwise_operands(m, k, n)
    jaxpr = jax.make_jaxpr(gemm)(*args)
    biggest = max(math.prod(v.aval.shape) for e in iter_eqns(jaxpr) for v in e.outvars)
    assert biggest <= m * max(n, k)  # the output or an input, never 8 * m * n
    # Compiled on CPU: peak footprint (arguments + temporaries + output) within 2x that of
    # an f32 matmul of the same shape. (XLA:CPU runs FP8 dots in f32 and hoists the
    # conversion of one operand out of the loop: one [M, K] f32 temporary, as large as the
    # f32 matmul's own argument.)
    def footprint(f, *a):
        mem = jax.jit(f).lower(*a).compile().memory_analysis()
        return mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes

    f32 = footprint(lambda x, w: x @ w.T, jax.ShapeDtypeStruct((m, k), jnp.float32),
                    jax.ShapeDtypeStruct((n, k), jnp.float32))
    assert footprint(gemm, *args) <= 2 * f32


def test_fallback_lowered_for_the_h200_has_no_per_block_partials():
    """The GPU compiler need not fuse what XLA:CPU fuses: lower for CUDA (no GPU needed) and
    check the StableHLO's largest f32 tensor."""
    import re

    m, k, n = 2048, 1024, 1024
    gemm, args = _blockwise_operands(m, k, n)
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=h200)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(gemm).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    sizes = [math.prod(int(d) for d in dims.split("x"))
             for dims in re.findall(r"tensor<((?:\d+x)+)f32>", text)
             for dims in [dims.rstrip("x")]]
    assert sizes and max(sizes) <= m * max(n, k)


# ---------------------------------------------------------------------------------------------
# MXFP8 on Blackwell: JAX's native block-scaled dot as a GEMM backend.


def _lower_for(kind, fn, *args):
    dev = jax.sharding.AbstractDevice(device_kind=kind, platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_mxfp8_uses_the_native_block_scaled_dot_on_blackwell_only():
    x, w, dy = (jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in _data(128, 256, 64))
    fn = lambda a, b, g: _fwd_bwd("mxfp8", a, b, g)  # noqa: E731
    assert _lower_for("NVIDIA B200", fn, x, w, dy).count("block_scaled_dot") == 3
    assert "block_scaled_dot" not in _lower_for("NVIDIA H200", fn, x, w, dy)


def test_block_scaled_dot_equals_the_emulated_mxfp8_gemms():
    """The backend off Blackwell (JAX's decomposition) against the pure-JAX path: the same
    quantized operands and f32 accumulation, so equal up to f32 summation order."""
    x, w, dy = _data(128, 200, 72)  # padded to 224 along K: the backend sees padded operands
    native = dataclasses.replace(fp8.RECIPES["mxfp8"], use_kernel="interpret")
    got = jax.jit(lambda a, b, g: _fwd_bwd(native, a, b, g))(x, w, dy)
    text = str(jax.make_jaxpr(lambda a, b, g: _fwd_bwd(native, a, b, g))(x, w, dy))
    assert "scaled_matmul" in text or "block_scaled" in text
    plain = str(jax.make_jaxpr(lambda a, b, g: _fwd_bwd("mxfp8", a, b, g))(x, w, dy))
    assert "scaled_matmul" not in plain and "block_scaled" not in plain  # CPU: the JAX path
    for g_, ref in zip(got, _reference_gemms("mxfp8", x, w, dy)):
        np.testing.assert_allclose(np.asarray(g_, np.float64), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("name,first_block_hit", [("current", True), ("rowwise", True),
                                                  ("blockwise", False), ("mxfp8", False)])
def test_recipe_scaling_is_what_the_forward_gemm_reads_of_x(name, first_block_hit):
    """``Fp8Recipe.scaling("x")``: one outlier in column 0 of a [2, 256] activation sets the
    scale of everything that shares its tile: the whole tensor (current), its row (rowwise),
    only its 1x128 block (blockwise) or 32-block (mxfp8). The second 128 columns are checked
    against an independent E4M3 cast (ml_dtypes) of x * 448 / amax_of_their_tile."""
    x = np.tile(np.linspace(0.01, 1.0, 256, dtype=np.float32), (2, 1))
    x[:, 0] = 1e4
    recipe = fp8.RECIPES[name]
    got = np.asarray(scaling.qdq(jnp.asarray(x), recipe.x_format, recipe.scaling("x")))
    tail = x[:, 128:].astype(np.float64)
    tile_amax = 1e4 if first_block_hit else (
        np.abs(tail).max() if name == "blockwise" else None)
    if name == "mxfp8":  # E8M0 scales, rceil: 2^ceil(log2(amax / 448)) per 32-block
        blocks = tail.reshape(2, 4, 32)
        s = 2.0 ** np.ceil(np.log2(np.abs(blocks).max(-1, keepdims=True) / 448.0))
        want = ((blocks / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s)
        want = want.reshape(2, 128)
    else:
        scale = tile_amax / 448.0
        want = (tail / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    np.testing.assert_allclose(got[:, 128:], want, rtol=1e-6)
    assert recipe.scaling("w") is not None
    with pytest.raises(ValueError, match="operand must be"):
        recipe.scaling("y")


# ---------------------------------------------------------------------------------------------
# Non-finite in, non-finite out: every recipe, every GEMM, so loss scaling sees the overflow.


def _overflow_step(name):
    """A jitted step of ``sum(dot(x, w) * c)`` under ``dynamic_loss_scale(sgd)``, x and w the
    parameters, ``c`` the cotangent of the dot's output (an inf there is an fp16 overflow in
    the backward pass). Delayed recipes run with a recorded history (amax 2 for each row),
    so their scales come from the history, not from the injected tensor."""
    import optax

    from fmtkit.optim import dynamic_loss_scale, loss_scale, scale_loss

    recipe = fp8.get_recipe(name)
    dg = fp8.dot_general_fn(recipe)
    opt = dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**4)
    state = None
    if recipe.delayed:
        state = fp8.init_state(recipe)
        state = state._replace(amax_history=state.amax_history.at[:, 0].set(2.0))

    @jax.jit
    def step(params, opt_state, c, fp8_state):
        def loss(p, s):
            kw = {} if s is None else {"fp8_state": s}
            y = dg(p["x"], p["w"], DN, **kw)
            return scale_loss(jnp.sum(y * c), opt_state), y

        (grads, observed), y = jax.grad(loss, argnums=(0, 1), has_aux=True)(params, fp8_state)
        updates, new_opt = opt.update(grads, opt_state, params)
        new_state = None if fp8_state is None else fp8.update_state(fp8_state, observed)
        return (y, grads, optax.apply_updates(params, updates), new_opt, new_state,
                loss_scale(new_opt))

    return opt, state, step


@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_inf_in_any_operand_or_cotangent_skips_the_step_and_backs_off_once(name):
    x = jax.random.normal(jax.random.key(0), (8, 48), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (48, 24), jnp.float32) / 8
    c = jnp.ones((8, 24), jnp.float32)
    opt, fp8_state, step = _overflow_step(name)
    params = {"x": x, "w": w}
    opt_state = opt.init(params)
    finite = lambda a: bool(np.all(np.isfinite(np.asarray(a))))  # noqa: E731

    # control: a clean step is taken at the same scale
    y, grads, new_params, _, new_state, scale = step(params, opt_state, c, fp8_state)
    assert finite(y) and finite(grads["x"]) and finite(grads["w"])
    assert float(scale) == 16.0 and not np.array_equal(new_params["w"], w)

    # (injected tensor, the GEMM outputs that must then be non-finite)
    cases = {
        "x": (x.at[3, 5].set(jnp.inf), c, ("y", "dw")),  # forward and wgrad read x
        "w": (x, c, ("y", "dx")),  # forward and dgrad read w
        "cotangent": (x, c.at[2, 7].set(jnp.inf), ("dx", "dw")),  # dgrad and wgrad read dy
    }
    for where, (xi, ci, bad) in cases.items():
        wi = w.at[4, 6].set(-jnp.inf) if where == "w" else w
        p = {"x": xi, "w": wi}
        y, grads, new_params, _, new_state, scale = step(p, opt.init(p), ci, fp8_state)
        outs = {"y": y, "dx": grads["x"], "dw": grads["w"]}
        for gemm in bad:
            assert not finite(outs[gemm]), f"{name}: inf in {where} gives a finite {gemm}"
        # the step is skipped (parameters unchanged) and the scale backs off exactly once
        for k in p:
            np.testing.assert_array_equal(np.asarray(new_params[k]), np.asarray(p[k]))
        assert float(scale) == 8.0, (name, where, float(scale))
        if fp8_state is not None:  # the history skips the non-finite observation
            np.testing.assert_array_equal(np.asarray(new_state.amax_history),
                                          np.asarray(fp8_state.amax_history))


def test_delayed_inf_check_has_a_negative_control(set_fp8_switch):
    """Without ``keep_nonfinite`` the delayed recipe clips an inf to E4M3's max with the
    history's scale: the output is finite, which the test above would catch."""
    set_fp8_switch("keep_nonfinite", lambda x, v: v, obj=scaling)
    dg = fp8.dot_general_fn("delayed")
    state = fp8.init_state("delayed")
    state = state._replace(amax_history=state.amax_history.at[:, 0].set(2.0))
    x = jnp.ones((4, 16)).at[0, 0].set(jnp.inf)
    y = dg(x, jnp.ones((16, 4)), DN, fp8_state=state)
    assert np.all(np.isfinite(np.asarray(y)))


def test_unscaled_tile_keeps_inf():
    """A "none" tile (a plain saturating cast) turns inf into NaN, not into the format max."""
    recipe = fp8.Fp8Recipe(grad_tile="none", x_tile="none", w_tile="none")
    y = fp8.dot_general_fn(recipe)(jnp.ones((4, 16)).at[1, 2].set(jnp.inf), jnp.ones((16, 4)), DN)
    assert np.isnan(np.asarray(y)[1]).all() and np.isfinite(np.asarray(y)[0]).all()


# ---------------------------------------------------------------------------------------------
# lax.dot_general's keywords, the op and the factory, one spelling, bad input.


def test_dot_general_keywords_are_honoured_or_rejected():
    x = jax.random.normal(jax.random.key(0), (8, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (32, 16), jnp.float32)
    dg = fp8.dot_general_fn("current")
    ref = np.asarray(dg(x, w, DN))
    # accepted by name: DEFAULT precision (alone or per operand) changes nothing
    for p in (jax.lax.Precision.DEFAULT, (jax.lax.Precision.DEFAULT,) * 2, "default"):
        np.testing.assert_array_equal(np.asarray(dg(x, w, DN, precision=p)), ref)
    # preferred_element_type is the output dtype
    y16 = dg(x, w, DN, preferred_element_type=jnp.bfloat16)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y16), ref.astype(ml_dtypes.bfloat16))
    # out_sharding is applied (one-device mesh: the result carries the requested sharding)
    mesh = jax.make_mesh((1,), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))
    y = dg(x, w, DN, out_sharding=sharding)
    assert y.sharding == sharding
    np.testing.assert_array_equal(np.asarray(y), ref)
    # what an FP8 GEMM cannot honour, or what is not a keyword of lax.dot_general, raises
    with pytest.raises(ValueError, match=r"precision=.*HIGHEST.*FP8 GEMM"):
        dg(x, w, DN, precision=jax.lax.Precision.HIGHEST)
    with pytest.raises(ValueError, match="precision"):
        dg(x, w, DN, precision="highest")
    with pytest.raises(TypeError, match="out_sharding must be"):
        dg(x, w, DN, out_sharding="junk")
    with pytest.raises(TypeError, match="preferred_element_type must be a floating"):
        dg(x, w, DN, preferred_element_type=jnp.int32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'algorithm'"):
        dg(x, w, DN, algorithm="fast")


def test_dot_general_is_an_op_and_a_factory():
    x = jax.random.normal(jax.random.key(0), (8, 200), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (200, 24), jnp.float32)
    # the op, like lax.dot_general, with the recipe as a keyword
    y_op = fp8.dot_general(x, w, DN, recipe="blockwise")
    # the factory, named as one, and the deprecated factory form (a recipe as the only
    # argument, or none): it warns, naming dot_general_fn, and returns the same function
    fn = fp8.dot_general_fn("blockwise")
    assert fn.recipe == fp8.RECIPES["blockwise"]
    np.testing.assert_array_equal(np.asarray(fn(x, w, DN)), np.asarray(y_op))
    for args in (("blockwise",), (fp8.RECIPES["blockwise"],), ()):
        with pytest.warns(DeprecationWarning, match=r"use fmtkit\.fp8\.dot_general_fn\(recipe\)"):
            fn = fp8.dot_general(*args)
        assert fn.recipe == fp8.RECIPES["blockwise"]
        np.testing.assert_array_equal(np.asarray(fn(x, w, DN)), np.asarray(y_op))
    with pytest.warns(DeprecationWarning, match="dot_general_fn"):
        assert fp8.dot_general(recipe="current").recipe.name == "current"
    # gradients flow through the op
    gx = jax.grad(lambda a: fp8.dot_general(a, w, DN, recipe="current").sum())(x)
    assert gx.shape == x.shape
    # ambiguous or incomplete calls say what the two forms are
    with pytest.raises(TypeError, match="returns the FP8 function"):
        fp8.dot_general("current", w, DN)
    with pytest.raises(TypeError, match="recipe was given twice"):
        fp8.dot_general("current", recipe="blockwise")
    with pytest.raises(TypeError, match="rhs and dimension_numbers are required"):
        fp8.dot_general(x)
    with pytest.raises(TypeError, match="lhs is None"):
        fp8.dot_general(None)
    with pytest.raises(TypeError, match="RECIPES"):
        fp8.dot_general(x, w, DN, recipe=3)


def test_one_spelling_of_fp8_in_class_names():
    assert fp8.Fp8Recipe.__name__ == "Fp8Recipe" and isinstance(fp8.RECIPES["current"],
                                                                 fp8.Fp8Recipe)
    assert "Fp8Recipe" in fp8.__all__ and "dot_general_fn" in fp8.__all__
    # The earlier names are deprecated aliases of the same objects, not second classes.
    assert "FP8Recipe" not in fp8.__all__ and "Fp8DotState" not in fp8.__all__
    with pytest.warns(DeprecationWarning,
                      match=r"FP8Recipe is deprecated: use fmtkit\.fp8\.Fp8Recipe"):
        assert fp8.FP8Recipe is fp8.Fp8Recipe
    with pytest.warns(DeprecationWarning, match=r"use fmtkit\.DelayedScalingState"):
        assert fp8.Fp8DotState is DelayedScalingState
    with pytest.warns(DeprecationWarning, match="Fp8Recipe"):
        from fmtkit.fp8 import FP8Recipe
    assert FP8Recipe is fp8.Fp8Recipe
    with pytest.raises(AttributeError, match="no attribute 'Fp9Recipe'"):
        fp8.Fp9Recipe  # noqa: B018


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-no-2d",
                                  "mxfp4"])
def test_fp8_entry_points_take_fp4_recipe_names(name):
    """An FP4 recipe goes wherever an FP8 recipe goes: fp8's entry points take FP4 names
    (the same recipe objects as fmtkit.fp4's) and compute what fmtkit.fp4's function does."""
    from fmtkit import fp4

    assert fp8.get_recipe(name) is fp4.RECIPES[name] is fp4.get_recipe(name)
    assert fp8.init_state(name).amax_history.shape == (3, fp4.RECIPES[name].history)
    x = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (64, 16), jnp.float32)
    want = np.asarray(fp4.dot_general_fn(name)(x, w, DN))
    dg = fp8.dot_general_fn(name)
    assert dg.recipe is fp4.RECIPES[name]
    np.testing.assert_array_equal(np.asarray(dg(x, w, DN)), want)
    np.testing.assert_array_equal(np.asarray(fp8.dot_general(x, w, DN, recipe=name)), want)
    with pytest.raises(ValueError, match="Unknown recipe 'nvfp5'") as info:
        fp8.dot_general_fn("nvfp5")
    assert "Unknown FP8 recipe" not in str(info.value)


@pytest.mark.parametrize("xs,ws", [((0, 64), (64, 8)), ((4, 0), (0, 8)), ((4, 64), (64, 0))])
def test_empty_operands_give_lax_dot_generals_zeros(xs, ws):
    x, w = jnp.ones(xs), jnp.ones(ws)
    y = fp8.dot_general(x, w, DN, recipe="blockwise")
    ref = jax.lax.dot_general(x, w, DN)
    assert y.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    gx, gw = jax.grad(lambda a, b: fp8.dot_general(a, b, DN, recipe="current").sum(),
                      (0, 1))(x, w)
    assert gx.shape == xs and gw.shape == ws and not np.any(np.asarray(gw))


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(power_of_two=1), TypeError, "power_of_two must be True or False"),
    (dict(delayed="yes"), TypeError, "delayed must be True or False"),
    (dict(mx_scale_rounding="up"), ValueError, "mx_scale_rounding must be one of"),
    (dict(promote_every=1.5), TypeError, "promote_every must be an int"),
    (dict(accum_mantissa_bits=True), TypeError, "accum_mantissa_bits must be an int"),
    (dict(x_tile=5), ValueError, "x_tile=5 is not a tiling"),
    (dict(name=3), TypeError, "name must be a string"),
])
def test_recipe_fields_are_validated_at_construction(kwargs, err, match):
    with pytest.raises(err, match=match):
        fp8.Fp8Recipe(**kwargs)


def test_update_state_with_a_wrong_tree_says_what_it_expects():
    state = fp8.init_state(dataclasses.replace(fp8.RECIPES["delayed"], history=4))
    for wrong in (state.amax_history, {"dot": state}, None):
        with pytest.raises(ValueError, match="same structure as state, the gradient of the loss"):
            fp8.update_state(state, wrong)


def test_inf_reaches_every_gemm_through_the_pallas_kernel():
    """The kernel backends (GPU-interpret mode on CPU) keep the rule too: an inf in x, w or
    the cotangent makes the GEMMs that read it non-finite."""
    import pallas_kernels  # noqa: F401  (importing it registers the kernel backend)

    recipe = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="interpret")
    x, w, dy = _data(128, 128, 128)
    run = jax.jit(lambda a, b, g: _fwd_bwd(recipe, a, b, g))
    finite = [np.all(np.isfinite(np.asarray(t))) for t in run(x, w, dy)]
    assert finite == [True, True, True]
    cases = {"x": ((x.at[3, 5].set(jnp.inf), w, dy), (False, True, False)),  # y, dx, dw
             "w": ((x, w.at[3, 5].set(jnp.inf), dy), (False, False, True)),
             "cotangent": ((x, w, dy.at[3, 5].set(jnp.inf)), (True, False, False))}
    for where, (args, expected) in cases.items():
        got = tuple(bool(np.all(np.isfinite(np.asarray(t)))) for t in run(*args))
        assert got == expected, where


def _exact_operand(key, shape, fmt, e, dtype):
    """Half the elements ±fmax·2^e, the others ±q·2^(E-mb-j) with q in [2^mb, 2^(mb+1)),
    j in {1, 2} (mb the format's mantissa bits, E = floor(log2 fmax) + e): every mantissa of
    the format occurs, so a wrong element format rounds some of them. Every tile's amax is
    fmax·2^e (or, in the unlikely tile without such an element, a power of two below that),
    so its scale amax·f32(1/fmax) is exactly a power of two (f32(448)·f32(1/448) == 1,
    likewise 57344), every scaled element is exact in the format, and every sum of at most
    256 products is a multiple of one power of two with fewer than 2^21 of them: exact in f32
    in any order. The fast path's f32 result then has one right answer, the float64 product
    of the reference."""
    f = get_format(fmt)
    mb, top = f.mantissa_bits, int(np.floor(np.log2(f.max))) + e
    k1, k2, k3, k4 = jax.random.split(key, 4)
    q = jax.random.randint(k1, shape, 2**mb, 2 ** (mb + 1)).astype(jnp.float32)
    j = jax.random.randint(k2, shape, 1, 3).astype(jnp.float32)
    small = q * jnp.exp2(top - mb - j)
    big = jax.random.bernoulli(k3, 0.5, shape)
    sign = jnp.where(jax.random.bernoulli(k4, 0.5, shape), -1.0, 1.0)
    return (sign * jnp.where(big, f.max * 2.0**e, small)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(128, 256, 128), (100, 200, 72)], ids=["aligned", "odd"])
@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_every_recipe_is_bit_identical_to_the_float64_reference(name, shape, dtype):
    """Forward, dgrad and wgrad of every recipe equal, bit for bit, the float64 product of the
    operands quantized by the NumPy + ml_dtypes reference (``_reference_gemms``), on inputs
    where the f32 accumulation is exact (``_exact_operand``). Guards every rewrite of the
    quantize / GEMM core for speed: a change of element format, rounding, clipping,
    padding or transposition moves outputs. (A wrong scale that the dequantization undoes
    is invisible on these inputs: the tolerance tests on Gaussian data cover scales.)"""
    r = fp8.get_recipe(name)
    m, k, n = shape
    keys = jax.random.split(jax.random.key(11), 3)
    x = _exact_operand(keys[0], (m, k), r.x_format, -3, dtype)
    w = _exact_operand(keys[1], (k, n), r.w_format, -9, dtype)
    dy = _exact_operand(keys[2], (m, n), r.grad_format, -17, dtype)
    state = fp8.init_state(r) if r.delayed else None  # first step: bootstrapped = current
    y, gx, gw = jax.jit(lambda a, b, g: _fwd_bwd(name, a, b, g, state))(x, w, dy)
    for what, got, ref in zip(("y", "dx", "dw"), (y, gx, gw), _reference_gemms(name, x, w, dy)):
        assert got.dtype == dtype, what
        want = np.asarray(jnp.asarray(ref, jnp.float32).astype(dtype))  # one rounding
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{name} {what}")


@pytest.fixture
def set_fp8_switch(monkeypatch):
    """Sets a private switch of the FP8 GEMM on ``fmtkit.fp8._gemm``, the module that reads it
    (``_WIDEN_OFF_GPU``, ``_FOLD_POW2_SCALES``), or another attribute the FP8 dot reads while
    tracing (``set_fp8_switch(name, value, obj=scaling)``) for one test. JAX caches the
    custom VJP's traces across calls, so a trace made under one setting would be reused under
    the other: the caches are cleared when the switch is set and again after the test (a
    later test must not reuse this one's traces)."""
    def set_switch(name, value, obj=_gemm):
        monkeypatch.setattr(obj, name, value)
        jax.clear_caches()

    yield set_switch
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize("name", ["current", "rowwise"])
def test_weight_gradient_equals_scaled_matmul_of_the_quantized_operands(set_fp8_switch, name):
    """The weight gradient, computed in the kernel's [K, N] layout, equals bit for bit
    ``scaled_matmul`` of the two quantized operands (``fmtkit.quantize`` along the tokens)
    transposed, on Gaussian data: the scales are applied in ``scaled_matmul``'s order. With
    the FP8 dots of the GPU path (``_WIDEN_OFF_GPU`` off): XLA:CPU's bf16 GEMM may sum
    ``b · aᵀ`` in another order than ``a · bᵀ`` (the float64 reference tests cover the
    widened dots)."""
    set_fp8_switch("_WIDEN_OFF_GPU", False)
    r = fp8.get_recipe(name)
    x, w, dy = _data(128, 256, 96, seed=3)
    _, _, gw = jax.jit(lambda a, b, g: _fwd_bwd(name, a, b, g))(x, w, dy)
    tile = {"tensor": scaling.TensorScaling(), "row": scaling.AxisScaling(-1)}
    gq = scaling.quantize(dy.T, r.grad_format, tile[r.grad_tile])
    xq = scaling.quantize(x.T, r.x_format, tile[r.x_tile])
    want = jax.jit(lambda a, b: fp8.scaled_matmul(a, b).T)(gq, xq)
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(want))


# ---------------------------------------------------------------------------------------------
# Power-of-two scales: the fold (one f32 dot of dequantized operands) against the per-block
# form it replaces off GPUs (``_gemm._FOLD_POW2_SCALES`` switches it).


def _fold_vs_per_block(set_fp8_switch, recipe, x, w, dy):
    set_fp8_switch("_FOLD_POW2_SCALES", True)  # no trace of another test's setting reused
    folded = jax.jit(lambda a, b, g: _fwd_bwd(recipe, a, b, g))(x, w, dy)
    set_fp8_switch("_FOLD_POW2_SCALES", False)
    per_block = jax.jit(lambda a, b, g: _fwd_bwd(recipe, a, b, g))(x, w, dy)
    return folded, per_block


def _summation_bounds(recipe, x, w, dy):
    """Per output, the f32 summation error bound of either form: (C - 1) * 2^-24 times the
    sum of |products| of the recipe's quantized operands (float64 reference quantization;
    the products themselves are exact in f32 here). Two summation orders differ by at most
    twice that."""
    r = fp8.get_recipe(recipe)
    x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
    q = {"x": lambda t: np.abs(_np_tile_qdq(t, r.x_tile, r.x_format)),
         "w": lambda t: np.abs(_np_tile_qdq(t, r.w_tile, r.w_format)),
         "g": lambda t: np.abs(_np_tile_qdq(t, r.grad_tile, r.grad_format))}
    sums = (q["x"](x) @ q["w"](w.T).T, q["g"](dy) @ q["w"](w).T,
            (q["g"](dy.T) @ q["x"](x.T).T).T)
    terms = (x.shape[1], w.shape[1], x.shape[0])  # K, N, M
    return [2 * (c - 1) * 2.0**-24 * s for s, c in zip(sums, terms)]


@pytest.mark.parametrize("name", list(_POW2_RECIPES))
def test_power_of_two_fold_equals_per_block_form_up_to_summation_order(set_fp8_switch, name):
    """Gaussian data with 100x outlier channels (blocks of very different scales): the fold
    and the per-block partials sum the same exact products; their difference stays within
    the f32 summation bound of the two orders, for y, dx and dw."""
    recipe = _POW2_RECIPES[name]
    x, w, dy = _data(256, 512, 128, seed=5)
    x = x.at[:, ::37].multiply(100.0)
    folded, per_block = _fold_vs_per_block(set_fp8_switch, recipe, x, w, dy)
    for what, a, b, bound in zip(("y", "dx", "dw"), folded, per_block,
                                 _summation_bounds(recipe, x, w, dy)):
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        assert np.all(diff <= bound), (what, float((diff - bound).max()))


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**100], ids=["tiny", "huge"])
def test_power_of_two_fold_at_extreme_block_scales(set_fp8_switch, scale):
    """Blocks of x scaled by 2^-100 (E8M0 scales near 2^-108: dequantized elements near
    2^-117, still f32 normals) or 2^100 (scales near 2^92), next to ordinary blocks: the fold
    gives the per-block form's values (within the summation bound) and flushes nothing the
    per-block form keeps (the exactness bounds in ``_gemm._folds_scales``)."""
    x, w, dy = _data(128, 256, 64, seed=9)
    x = x.at[:, :64].multiply(scale)  # two MX blocks of every row, one 128-block half
    if scale > 1:
        w, dy = w * 2.0**-20, dy * 2.0**-20  # keep the products inside f32's range
    folded, per_block = _fold_vs_per_block(set_fp8_switch, "mxfp8", x, w, dy)
    for what, a, b, bound in zip(("y", "dx", "dw"), folded, per_block,
                                 _summation_bounds("mxfp8", x, w, dy)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), what
        assert np.all((a == 0) == (b == 0)), what  # nothing flushed by one form only
        assert np.all(np.abs(a - b) <= bound), what
    # dw rows 0..63 come only from the scaled x columns: their magnitude is kept
    dw = np.asarray(folded[2], np.float64)
    assert 0 < np.abs(dw[:64]).max() < np.inf


# ---------------------------------------------------------------------------------------------
# Off GPUs every FP8 dot reads its operands widened exactly to bf16 (``_gemm._emulated_dot``): that
# relies on XLA:CPU accumulating a bf16 x bf16 -> f32 dot in f32, checked here directly.


@pytest.mark.parametrize("dims,a_shape,b_shape", [
    ((((1,), (1,)), ((), ())), (7, 1027), (13, 1027)),  # a · bᵀ, odd sizes
    ((((0,), (0,)), ((), ())), (1027, 7), (1027, 13)),  # both contraction-major
    # the per-block partials: [F1, nb, g] · [F2, nb, g], batch nb, contract g
    ((((2,), (2,)), ((1,), (1,))), (7, 5, 515), (13, 5, 515)),
    # ... and every mix of contraction-major ([nb, g, F]) and -minor operands, both orders
    ((((1,), (2,)), ((0,), (1,))), (5, 515, 7), (13, 5, 515)),
    ((((2,), (1,)), ((1,), (0,))), (7, 5, 515), (5, 515, 13)),
    ((((1,), (1,)), ((0,), (0,))), (5, 515, 7), (5, 515, 13)),
], ids=["nt", "tn", "batched", "batched-cmajor-a", "batched-cmajor-b", "batched-cmajor"])
def test_cpu_bf16_dot_accumulates_in_f32(dims, a_shape, b_shape):
    """An adversarial sum: along the contraction, one product of 1 (2^7 * 2^-7) at a random
    position and all others 2^-14 (2^-7 * 2^-7; bf16 and E4M3 values); every partial sum of
    them is exact in f32 (below 2, on the 2^-14 grid: 15 bits), so any order of f32
    accumulation gives the float64 sum exactly, while a bf16 accumulator (8 bits: 1 + 2^-14
    rounds to 1) or a TF32-like one (11 bits) would lose the small terms. The dot is the one
    ``_gemm._emulated_dot`` emits off GPUs (``_wide_dot``: bf16 operands, f32 output; its
    layouts are every one the per-block partials take, a plain ``lax.dot_general`` of
    some of which XLA:CPU rejects)."""
    ca = dims[0][0]
    rng = np.random.default_rng(0)
    a = np.full(a_shape, 2.0**-7, np.float32)
    b = np.full(b_shape, 2.0**-7, np.float32)
    # one product of 1 per output, at a random position of the contraction
    k = a_shape[ca[0]]
    a = np.moveaxis(a, ca[0], -1)
    pos = rng.integers(0, k, size=a.shape[:-1])
    np.put_along_axis(a, pos[..., None], 2.0**7, axis=-1)
    a = np.moveaxis(a, -1, ca[0])
    a *= rng.choice([1.0, -1.0], size=(*a.shape[:ca[0]], 1, *a.shape[ca[0] + 1:])).astype(
        np.float32)  # signs per output row of a: sums of equal-sign terms
    dot = jax.jit(lambda p, q: _gemm._wide_dot(p, q, dims))
    got = np.asarray(dot(jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)))
    assert got.dtype == np.float32
    want = _np_dot_general(a.astype(np.float64), b.astype(np.float64), dims)
    # the sums hold more than a bf16 accumulator could: a real test of f32 accumulation
    assert np.all(np.abs(want) > 1.0 + 2.0**-7)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    np.testing.assert_array_equal(want.astype(np.float32).astype(np.float64), want)  # exact


def _np_dot_general(a, b, dims):
    """NumPy ``lax.dot_general`` (one contracting, at most one batch axis): [batch, a free,
    b free], by einsum."""
    (ca, cb), (ba, bb) = dims
    la, lb = list("abcd"[:a.ndim]), list("efgh"[:b.ndim])
    lb[cb[0]] = la[ca[0]]
    batch = []
    if ba:
        lb[bb[0]] = la[ba[0]]
        batch = [la[ba[0]]]
    free = [c for c in la if c not in (la[ca[0]], *batch)] + [
        c for c in lb if c not in la]
    return np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(batch + free)}", a, b)


@pytest.mark.parametrize("name", [*fp8.RECIPES])
def test_widened_dots_equal_fp8_dots_up_to_summation_order(set_fp8_switch, name):
    """Off GPUs the dots read FP8 operands widened to bf16; against the FP8 dots they replace
    (``_gemm._WIDEN_OFF_GPU`` off) y, dx and dw differ at most by the f32 summation bound of
    the two orders (the values and products are the same), on data with outlier channels."""
    x, w, dy = _data(128, 384, 256, seed=11)
    x = x.at[:, ::37].multiply(100.0)
    state = fp8.init_state() if fp8.RECIPES[name].delayed else None  # bootstrap: current
    set_fp8_switch("_WIDEN_OFF_GPU", True)
    widened = jax.jit(lambda a, b, g: _fwd_bwd(name, a, b, g, state))(x, w, dy)
    set_fp8_switch("_WIDEN_OFF_GPU", False)
    fp8_dots = jax.jit(lambda a, b, g: _fwd_bwd(name, a, b, g, state))(x, w, dy)
    for what, a, b, bound in zip(("y", "dx", "dw"), widened, fp8_dots,
                                 _summation_bounds(name, x, w, dy)):
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        assert np.all(diff <= bound), (what, float((diff - bound).max()))


# ---------------------------------------------------------------------------------------------
# Off GPUs the blockwise per-block partials are one 2-D dot per 128-block in a lax.scan
# (``_gemm._block_dots``; ``_gemm._SCAN_BLOCK_DOTS`` switches it) instead of one batched dot.

_BLOCK_SHAPES = [(256, 1024, 384), (100, 200, 300), (128, 384, 256)]


def _blockwise_both_ways(set_fp8_switch, x, w, dy, budget=None):
    """blockwise y / dx / dw with the scanned 2-D dots and with the batched form (its one
    batched dot, or with ``budget`` its loop of one-block batched dots)."""
    if budget is not None:
        set_fp8_switch("PARTIALS_BUDGET_BYTES", budget)
    set_fp8_switch("_SCAN_BLOCK_DOTS", True)
    scanned = jax.jit(lambda a, b, g: _fwd_bwd("blockwise", a, b, g))(x, w, dy)
    set_fp8_switch("_SCAN_BLOCK_DOTS", False)
    batched = jax.jit(lambda a, b, g: _fwd_bwd("blockwise", a, b, g))(x, w, dy)
    return scanned, batched


@pytest.mark.parametrize("budget", [None, 0], ids=["one-batched-dot", "batched-loop"])
@pytest.mark.parametrize("shape", _BLOCK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_block_dots_equal_batched_partials_up_to_summation_order(set_fp8_switch, shape,
                                                                 budget):
    """Gaussian data with 100x outlier channels (blocks of very different scales): the
    scanned 2-D dots and the batched form they replace sum the same exact products, scale
    them by the same block scales and add the blocks in the same order; XLA:CPU rounds
    differently inside them (its bf16 GEMM sums a block's products in another order than
    the f32 GEMM it makes of a batched bf16 dot, and the scan's multiply-add is one FMA).
    Each is within the f32 summation bound of the float64 reference of the same block-scaled
    sum (independent NumPy quantization), so the two within twice that."""
    m, k, n = shape
    x, w, dy = _data(m, k, n, seed=13)
    x = x.at[:, ::37].multiply(100.0)
    scanned, batched = _blockwise_both_ways(set_fp8_switch, x, w, dy, budget)
    refs = _reference_gemms("blockwise", x, w, dy)
    bounds = _summation_bounds("blockwise", x, w, dy)  # two orders: twice one form's
    for what, a, b, ref, bound in zip(("y", "dx", "dw"), scanned, batched, refs, bounds):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.abs(a - ref) <= bound / 2), (what, float(np.abs(a - ref).max()))
        assert np.all(np.abs(b - ref) <= bound / 2), what
        assert np.all(np.abs(a - b) <= bound), what


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", _BLOCK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_block_dots_are_bit_identical_to_batched_partials_where_sums_are_exact(
        set_fp8_switch, shape, dtype):
    """On inputs whose f32 accumulation is exact in any order (``_exact_operand``), y, dx and
    dw of the scanned 2-D dots equal those of the batched form bit for bit (and both the
    float64 reference): the same values, products, scales and padding."""
    m, k, n = shape
    keys = jax.random.split(jax.random.key(17), 3)
    x = _exact_operand(keys[0], (m, k), "e4m3", -3, dtype)
    w = _exact_operand(keys[1], (k, n), "e4m3", -9, dtype)
    dy = _exact_operand(keys[2], (m, n), "e4m3", -17, dtype)
    scanned, batched = _blockwise_both_ways(set_fp8_switch, x, w, dy)
    refs = _reference_gemms("blockwise", x, w, dy)
    for what, a, b, ref in zip(("y", "dx", "dw"), scanned, batched, refs):
        want = np.asarray(jnp.asarray(ref, jnp.float32).astype(dtype))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)
        np.testing.assert_array_equal(np.asarray(a), want, err_msg=what)


def test_block_dots_are_one_scanned_dot_per_gemm_and_fp4_keeps_its_batched_dot():
    """A 4096-wide contraction (32 blocks) is still one dot equation per GEMM, in a scan of
    32 steps; NVFP4's 16-wide blocks keep the batched form (``_gemm._MIN_SCAN_BLOCK``)."""
    from fmtkit import fp4

    x, w, dy = (jax.ShapeDtypeStruct(s, jnp.float32) for s in
                ((128, 4096), (4096, 256), (128, 256)))
    jaxpr = jax.make_jaxpr(lambda a, b, g: _fwd_bwd("blockwise", a, b, g))(x, w, dy)
    dots = [(e, t) for e, t in iter_eqns_with_trips(jaxpr) if e.primitive.name == "dot_general"]
    assert sorted(t for _, t in dots) == [1, 2, 32]  # wgrad: 1 block of 128 tokens (no scan)
    assert all(e.params["dimension_numbers"][1] == ((), ()) for e, _ in dots)
    x, w, dy = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((128, 256), (256, 64), (128, 64)))
    dg = fp4.dot_general_fn("nvfp4")
    jaxpr = jax.make_jaxpr(lambda a, b, g: jax.vjp(lambda p, q: dg(p, q, DN), a, b)[1](g))(
        x, w, dy)
    dots = [(e, t) for e, t in iter_eqns_with_trips(jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(t == 1 and e.params["dimension_numbers"][1] != ((), ())
                        for e, t in dots)


# ---------------------------------------------------------------------------------------------
# Forward-mode AD: the tangent runs through the forward GEMM's quantized operands (f32);
# reverse mode keeps the recipe's backward GEMMs (the float64 reference tests above).


def _jvp_case(name, m=96, k=200, n=72, dtype=jnp.float32):
    r = fp8.get_recipe(name)
    x, w, _ = _data(m, k, n, seed=5)
    dx, dw, _ = _data(m, k, n, seed=6)
    kw = {"fp8_state": fp8.init_state(r)} if r.delayed else {}

    def f(a, b):
        return fp8.dot_general_fn(name)(a, b, DN, **kw)

    x, w, dx, dw = (a.astype(dtype) for a in (x, w, dx, dw))
    qx = _np_tile_qdq(x, r.x_tile, r.x_format)  # [M, K], tiles along K
    qw = _np_tile_qdq(np.asarray(w, np.float32).T, r.w_tile, r.w_format)  # [N, K]
    return f, (x, w, dx, dw), qx, qw


@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_forward_mode_tangent_is_the_product_through_the_quantized_operands(name):
    """``jax.jvp`` of the FP8 dot: ``ẏ = ẋ · Q(w) + Q(x) · ẇ`` with ``Q`` the forward GEMM's
    quantization (float64 reference ``_np_tile_qdq``), computed in f32: within the f32
    summation bound. The unquantized product (ẋ · w + x · ẇ) differs by ~2% (E4M3), far
    outside it; the primal is the FP8 forward, bit for bit."""
    f, (x, w, dx, dw), qx, qw = _jvp_case(name)
    y, t = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(x, w, dx, dw)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(f)(x, w)))
    dx64, dw64 = np.asarray(dx, np.float64), np.asarray(dw, np.float64)
    want = dx64 @ qw.T + qx @ dw64
    bound = 2 * 200 * 2.0**-24 * (np.abs(dx64) @ np.abs(qw).T + np.abs(qx) @ np.abs(dw64))
    assert t.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(t, np.float64) - want) <= bound + 1e-30)
    unquantized = dx64 @ np.asarray(w, np.float64) + np.asarray(x, np.float64) @ dw64
    assert np.max(np.abs(unquantized - want) - bound) > 0  # the check tells them apart


def test_forward_mode_tangent_of_bf16_operands_is_bf16_rounded_once():
    f, (x, w, dx, dw), qx, qw = _jvp_case("current", dtype=jnp.bfloat16)
    y, t = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(x, w, dx, dw)
    assert y.dtype == t.dtype == jnp.bfloat16
    dx64, dw64 = np.asarray(dx, np.float64), np.asarray(dw, np.float64)
    want = dx64 @ qw.T + qx @ dw64
    err = np.abs(np.asarray(t, np.float64) - want)
    assert np.all(err <= 2.0**-8 * np.abs(want) + 1e-3 * np.abs(want).max())


@pytest.mark.parametrize("name", ["current", "blockwise"])
def test_jacfwd_is_the_quantized_weight_exactly(name):
    """``jax.jacfwd`` (the tangent under ``vmap``) of y = x · w with respect to x:
    ∂y[i, j] / ∂x[a, b] = δ(i, a) Q(w)[b, j], Q(w) dequantized in f32 (one rounding of
    the exact float64 product of value and scale), exact after that (one nonzero product per
    output); batched dots too (one GEMM per batch element)."""
    f, (x, w, _, _), _, qw = _jvp_case(name, m=6, k=40, n=24)
    jac = jax.jacfwd(lambda a: f(a, w))(x)
    want = np.einsum("ia,jb->ijab", np.eye(6), qw.astype(np.float32).astype(np.float64))
    np.testing.assert_array_equal(np.asarray(jac, np.float64), want)
    xb = jnp.stack([x, 2 * x])
    wb = jnp.stack([w, w])
    dims = (((2,), (1,)), ((0,), (0,)))
    jac_b = jax.jacfwd(lambda a: fp8.dot_general(a, wb, dims, recipe=name))(xb)
    np.testing.assert_array_equal(np.asarray(jac_b[1, :, :, 1], np.float64), want)
    assert not np.any(np.asarray(jac_b[0, :, :, 1]))


@pytest.mark.parametrize("name", ["current", "delayed", "blockwise", "nvfp4"])
def test_hessian_vector_product_through_the_quantized_operands(name):
    """``jax.jvp`` of ``jax.grad`` (forward over reverse) of L(x, w) = Σ sin(x · w) in the
    direction (u, v). The gradient's GEMMs dx = g · wᵀ, dw = xᵀ · g (g = cos y) take their
    tangents through the forward GEMM's quantized operands, in f32:
    ḋx = ġ · Q(w)ᵀ + g · vᵀ, ḋw = Q(x)ᵀ · ġ + uᵀ · g, ġ = -sin(y) ⊙ (u · Q(w) + Q(x) · v),
    y = Q(x) · Q(w) (float64 reference). Dropping the g · vᵀ term (the residuals' tangent)
    moves ḋx by O(1)."""
    r = fp8.get_recipe(name)
    m, k, n = 48, 64, 32
    x, w, _ = _data(m, k, n, seed=7)
    u, v, _ = _data(m, k, n, seed=8)
    kw = {"fp8_state": fp8.init_state(r)} if getattr(r, "delayed", False) else {}

    def loss(a, b):
        return jnp.sum(jnp.sin(fp8.dot_general(a, b, DN, recipe=name, **kw)))

    (hx, hw) = jax.jit(lambda *a: jax.jvp(jax.grad(loss, argnums=(0, 1)), a[:2], a[2:])[1])(
        x, w, u, v)
    if name == "nvfp4":
        from fmtkit import fp4
        # The forward GEMM's operands: x [M, K] in 1x16 blocks and wᵀ [N, K] in 16x16 blocks,
        # round to nearest (NVFP4's forward; the quantizer is checked against ml_dtypes in
        # test_fp4.py), dequantized.
        qx = np.asarray(fp4.nvfp4_quantize(x, (1, 16)).dequantize(), np.float64)
        qw = np.asarray(fp4.nvfp4_quantize(w.T, (16, 16)).dequantize(), np.float64)
    else:
        qx = _np_tile_qdq(x, r.x_tile, r.x_format)
        qw = _np_tile_qdq(np.asarray(w).T, r.w_tile, r.w_format)
    u64, v64 = (np.asarray(a, np.float64) for a in (u, v))
    y = qx @ qw.T
    g, g_dot = np.cos(y), -np.sin(y) * (u64 @ qw.T + qx @ v64)
    want_x = g_dot @ qw + g @ v64.T
    want_w = qx.T @ g_dot + u64.T @ g
    for got, want in ((hx, want_x), (hw, want_w)):
        got = np.asarray(got, np.float64)
        assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want)
    dropped = g_dot @ qw
    assert np.linalg.norm(dropped - want_x) > 0.1 * np.linalg.norm(want_x)


@pytest.mark.parametrize("name", ["current", "blockwise"])
def test_second_derivatives_through_the_tangent(name):
    """Forward over forward (``jacfwd`` of ``jacfwd``) of L(x) = Σ sin(x · w): the Hessian
    through the quantized weight, H[i, b, i, d] = -Σ_j sin(y[i, j]) Q(w)[b, j] Q(w)[d, j]
    (float64 reference, y = Q(x) · Q(w)); the same as ``jax.hessian`` (forward over
    reverse). Reverse over forward (``grad`` of a ``jvp``): the tangent ẋ · Q(w) + Q(x) · ẇ
    differentiated in w with the quantization's derivative the identity:
    ∂/∂w Σ ((u · Q(w)) ⊙ c) = uᵀ · c."""
    f, (x, w, u, _), _, _ = _jvp_case(name, m=3, k=40, n=24)
    r = fp8.get_recipe(name)

    def loss(a):
        return jnp.sum(jnp.sin(f(a, w)))

    h = jax.jit(jax.jacfwd(jax.jacfwd(loss)))(x)
    qx = _np_tile_qdq(x, r.x_tile, r.x_format)
    qw = _np_tile_qdq(np.asarray(w, np.float32).T, r.w_tile, r.w_format)  # [N, K]
    s = -np.sin(qx @ qw.T)  # [M, N]
    inner = np.einsum("ij,jb,jd->ibd", s, qw, qw)
    want = np.einsum("ibd,ia->ibad", inner, np.eye(3))  # ∂²L / ∂x[i, b] ∂x[a, d]
    got = np.asarray(h, np.float64)
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    hr = np.asarray(jax.jit(jax.hessian(loss))(x), np.float64)
    assert np.linalg.norm(hr - want) <= 1e-5 * np.linalg.norm(want)
    c = jnp.asarray(np.random.default_rng(1).standard_normal((3, 24)), jnp.float32)
    gw = jax.jit(jax.grad(lambda b: jnp.sum(jax.jvp(f, (x, b), (u, jnp.zeros_like(b)))[1]
                                            * c)))(w)
    want_w = np.asarray(u, np.float64).T @ np.asarray(c, np.float64)
    bound = 2 * 3 * 2.0**-24 * (np.abs(np.asarray(u, np.float64)).T @ np.abs(np.asarray(c)))
    assert np.all(np.abs(np.asarray(gw, np.float64) - want_w) <= bound)
