"""Recipes: ``Fp8Recipe``'s fields, validation, names and printing, the scaling each operand
reads, one namespace with the FP4 recipes, and the deprecated spellings.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fp8_testlib import DN, data, sqnr

from fmtkit import fp8, scaling
from fmtkit.scaling import DelayedScalingState


def test_margin_doubles_scale():
    base = fp8.get_recipe("current")
    x, w, _ = data(128, 256, 128)
    y0 = fp8.dot_general_fn(base)(x, w, DN)
    y1 = fp8.dot_general_fn(dataclasses.replace(base, margin=1))(x, w, DN)
    assert sqnr(np.asarray(y0), y1) > 10  # still accurate...
    assert not np.array_equal(np.asarray(y0), np.asarray(y1))  # ...but a different grid


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


def test_recipes_print_what_they_are():
    assert str(fp8.RECIPES["blockwise"]) == "blockwise"
    assert str(dataclasses.replace(fp8.RECIPES["blockwise"], margin=1)) == "blockwise(margin=1)"
    custom = fp8.Fp8Recipe(x_tile="row", power_of_two=True)
    assert str(custom) == "custom(x_tile='row', power_of_two=True)"
    assert str(fp8.Fp8Recipe()) == "custom"


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
