"""ScaledArray <-> qwix.QArray: bit-exact round trips for every tiling, dequantization equal
to a float64 reference, the lossy cases refused, and qwix 0.1.8's MXFP8 rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

qwix = pytest.importorskip("qwix")
pytestmark = pytest.mark.slow  # each test compiles several quantizers (1-3 s on CPU)

import fmtkit  # noqa: E402
from fmtkit.qwix import from_qarray, to_qarray  # noqa: E402

X = np.asarray(jax.random.normal(jax.random.key(0), (256, 256), jnp.float32)) * np.exp2(
    np.arange(256) % 17 - 8)[:, None].astype(np.float32)  # rows of very different ranges

CASES = {
    "tensor": ("e4m3", fmtkit.TensorScaling()),
    "axis": ("e4m3", fmtkit.AxisScaling(-1)),
    "axis0": ("e5m2", fmtkit.AxisScaling(0)),
    "1x128": ("e4m3", fmtkit.BlockScaling((1, 128))),
    "128x128": ("e4m3", fmtkit.BlockScaling((128, 128))),
    "mx-e4m3": ("e4m3", fmtkit.MXScaling(32)),
    "mx-e2m1": ("fp4", fmtkit.MXScaling(32, "rceil")),
    "mx-axis0": ("e4m3", fmtkit.MXScaling(32, axis=0)),
    "1x16-e2m1": ("fp4", fmtkit.BlockScaling((1, 16))),
}


def _quantize(name):
    fmt, recipe = CASES[name]
    return fmtkit.quantize(X, fmt, recipe)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


@pytest.mark.parametrize("name", CASES)
def test_round_trip_is_bit_exact_and_dequantizes_like_float64(name):
    sa = _quantize(name)
    qa = to_qarray(sa)
    back = from_qarray(qa, recipe=sa.recipe)
    assert back.fmt == sa.fmt and back.recipe == sa.recipe
    assert back.scale.dtype == sa.scale.dtype
    np.testing.assert_array_equal(_bits(back.values), _bits(sa.values))
    np.testing.assert_array_equal(_bits(back.scale), _bits(sa.scale))
    # qwix's dequantization equals fmtkit's bit for bit, and both the float64 product
    # values * scale (exact: at most 4 + 24 significant bits) rounded once to f32.
    ours = np.asarray(fmtkit.dequantize(sa))
    np.testing.assert_array_equal(np.asarray(qwix.dequantize(qa)).view(np.uint32),
                                  ours.view(np.uint32))
    v = np.asarray(sa.values).astype(np.float64)
    s = np.asarray(sa.scale.astype(jnp.float32)).astype(np.float64)
    block = sa.block
    ref = v * np.repeat(np.repeat(s, block[0], 0), block[1], 1)
    np.testing.assert_array_equal(ours, ref.astype(np.float32))


@pytest.mark.parametrize("name", CASES)
def test_the_recipe_is_inferred_from_the_tiles(name):
    sa = _quantize(name)
    got = from_qarray(to_qarray(sa)).recipe
    if isinstance(sa.recipe, fmtkit.MXScaling):
        assert got == fmtkit.MXScaling(32, "rceil", axis=sa.recipe.axis % 2)
    elif isinstance(sa.recipe, fmtkit.AxisScaling):
        assert got == fmtkit.AxisScaling(sa.recipe.axis % 2)
    else:
        assert got == sa.recipe


def test_delayed_scaling_results_convert_and_keep_their_recipe():
    recipe = fmtkit.DelayedScaling(history=4)
    state = recipe.update(recipe.init(), jnp.asarray(X) * 4)  # a history larger than X
    sa = fmtkit.quantize(X, "e4m3", recipe, state=state)
    qa = to_qarray(sa)
    np.testing.assert_array_equal(np.asarray(qwix.dequantize(qa)),
                                  np.asarray(fmtkit.dequantize(sa)))
    back = from_qarray(qa, recipe=recipe)
    assert back.recipe == recipe
    np.testing.assert_array_equal(_bits(back.scale), _bits(sa.scale))
    assert from_qarray(qa).recipe == fmtkit.TensorScaling()


def test_mx_arrays_carry_qwix_mx_qtypes():
    assert to_qarray(_quantize("mx-e4m3")).qtype == "mxfp8"
    assert to_qarray(_quantize("mx-e2m1")).qtype == "mxfp4"
    assert to_qarray(_quantize("1x128")).qtype == jnp.float8_e4m3fn
    # MX scales come back as E8M0, exactly
    back = from_qarray(to_qarray(_quantize("mx-e4m3")))
    assert back.scale.dtype == jnp.float8_e8m0fnu


def test_lossy_conversions_are_refused():
    with pytest.raises(ValueError, match="FP6"):
        to_qarray(fmtkit.quantize(X, "fp6_e2m3", fmtkit.TensorScaling()))
    with pytest.raises(TypeError, match="ScaledArray"):
        to_qarray(X)
    with pytest.raises(TypeError, match="two-level"):
        to_qarray(fmtkit.fp4.nvfp4_quantize(jnp.asarray(X)))
    asym = qwix.quantize(jnp.asarray(X), jnp.int8, calibration_method="minmax")
    with pytest.raises(ValueError, match="zero_point"):
        from_qarray(asym)
    with pytest.raises(TypeError, match="qtype"):
        from_qarray(qwix.quantize(jnp.asarray(X), jnp.int8))
    bad = qwix.QArray(jnp.ones((4, 64), jnp.float8_e4m3fn), jnp.full((4, 2), 0.3, jnp.float32),
                      None, "mxfp8")
    with pytest.raises(ValueError, match="powers of two"):
        from_qarray(bad)
    with pytest.raises(ValueError, match="tiles"):
        from_qarray(to_qarray(_quantize("1x128")), recipe=fmtkit.BlockScaling((128, 128)))


def test_bf16_qwix_scales_widen_exactly():
    qa = qwix.quantize(jnp.asarray(X, jnp.bfloat16), jnp.float8_e4m3fn, tiled_axes={1: 128})
    assert qa.scale.dtype == jnp.bfloat16
    sa = from_qarray(qa)
    np.testing.assert_array_equal(np.asarray(fmtkit.dequantize(sa, jnp.bfloat16)),
                                  np.asarray(qwix.dequantize(qa)))


# ---------------------------------------------------------------------------------------
# qwix's own MXFP8 quantization (0.1.8: scale 2^ceil(log2(absmax / 448)), computed in f32)
# is fmtkit's MXScaling(32, "rceil") (the smallest power of two 2^k with absmax <= 448 * 2^k)
# except where f32 arithmetic decides: an absmax within an ulp of a boundary 448 * 2^k (the
# division rounds onto the boundary, or log2's approximation lands beside an exact integer)
# and blocks below 448 * 2^-63 (below).


def test_qwix_version_whose_mx_rule_is_pinned():
    assert qwix.__version__ == "0.1.8"


def _mx_blocks():
    """(x, boundary): blocks whose absmax sits on and beside every boundary 448 * 2^k (and
    on powers of two), then random blocks over a wide range; ``boundary`` marks the blocks
    whose absmax is within 1 ulp of a boundary."""
    rng = np.random.default_rng(0)
    amax, boundary = [], []
    for k in range(-40, 41, 3):
        edge = np.float32(448 * 2.0**k)
        amax += [edge, np.nextafter(edge, np.float32(0)), np.nextafter(edge, np.float32(np.inf)),
                 np.float32(2.0**k), np.float32(300 * 2.0**k)]
        boundary += [True, True, True, False, False]
    amax = np.array(amax, np.float32)
    x = rng.standard_normal((amax.size, 32)).astype(np.float32)
    x = x / np.abs(x).max(axis=1, keepdims=True) * amax[:, None]
    x[:, 0] = amax  # the block's absmax exactly
    wide = (rng.standard_normal((256, 32)) * np.exp2(rng.integers(-30, 30, (256, 1)))).astype(
        np.float32)
    return np.concatenate([x, wide]), np.array(boundary + [False] * 256)


def test_qwix_mxfp8_agrees_with_fmtkit_mx_rceil_in_scales_and_values():
    x, boundary = _mx_blocks()
    qa = qwix.quantize(jnp.asarray(x), "mxfp8", channelwise_axes=(0,), tiled_axes={1: 32})
    sa = fmtkit.quantize(x, "e4m3", fmtkit.MXScaling(32, "rceil"))
    qs, fs = np.asarray(qa.scale)[:, 0], np.asarray(sa.scale.astype(jnp.float32))[:, 0]
    # The reference rule in float64: the smallest k with amax <= 448 * 2^k.
    amax = np.abs(x).max(axis=1).astype(np.float64)
    k = np.ceil(np.log2(amax / 448.0))
    k = np.where(amax > 448.0 * np.exp2(k), k + 1, k)
    np.testing.assert_array_equal(fs, np.exp2(k))
    same = qs == fs
    assert same[~boundary].all(), x[~boundary & ~same].max(axis=1)
    assert not same.all()  # negative control: the boundary blocks do tell the rules apart
    assert np.all(np.abs(np.log2(qs[~same]) - np.log2(fs[~same])) == 1)  # one binade apart
    np.testing.assert_array_equal(_bits(qa.qvalue)[same], _bits(sa.values)[same])
    # OCP's "floor" rule differs on ordinary blocks (amax 300 * 2^k: floor gives 2^(k+1)...).
    floor = fmtkit.quantize(x, "e4m3", fmtkit.MXScaling(32, "floor"))
    assert not np.array_equal(np.asarray(floor.scale.astype(jnp.float32))[:, 0][same],
                              qs[same])


def test_tiny_blocks_are_where_the_two_rules_part():
    """qwix replaces a scale below sqrt(f32 tiny) = 2^-63 by 1 (qwix 0.1.8,
    compute_scale_zero_point); fmtkit keeps 2^k down to E8M0's 2^-127. A block with absmax
    448 * 2^-70 gets scale 1 from qwix (its values flush to zero) and 2^-70 from fmtkit."""
    x = np.full((1, 32), 448 * 2.0**-70, np.float32)
    qa = qwix.quantize(jnp.asarray(x), "mxfp8", channelwise_axes=(0,),
                       tiled_axes={1: 32})
    sa = fmtkit.quantize(x, "e4m3", fmtkit.MXScaling(32, "rceil"))
    assert float(qa.scale[0, 0]) == 1.0
    assert float(sa.scale.astype(jnp.float32)[0, 0]) == 2.0**-70
