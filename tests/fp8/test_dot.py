"""The differentiable FP8 dot with ``lax.dot_general``'s signature: dimension numbers, keywords,
the op and the factory, errors that name the module, empty operands.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fp8_testlib import DN, sqnr

from fmtkit import fp8
from fmtkit.scaling import DelayedScalingState


def test_general_dimension_numbers_match_lax():
    """DenseGeneral/Einsum-style dims: multiple contracting dims and a batch dim."""
    k1, k2 = jax.random.split(jax.random.key(3))
    lhs = jax.random.normal(k1, (2, 64, 4, 32), jnp.float32)  # B, T, heads, head_dim
    rhs = jax.random.normal(k2, (2, 4, 32, 128), jnp.float32)  # B, heads, head_dim, N
    dn = (((2, 3), (1, 2)), ((0,), (0,)))
    ref = jax.lax.dot_general(lhs, rhs, dn, precision="highest")
    got = fp8.dot_general_fn("blockwise")(lhs, rhs, dn)
    assert got.shape == ref.shape
    assert sqnr(ref, got) > 25


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
