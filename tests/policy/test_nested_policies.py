"""Nested policies: a policied function called inside another policied model keeps its own
policy, FP8 included, as a nested autocast region does.

The programs are the ten lines a user writes: an FP8 block (``with_policy(fn,
"fp8-current")``) inside a bf16-mixed model. Expected values: the FP8 formats counted on the
matmul operands of the jaxpr, and the block's output against float64 NumPy on the operands
quantized with ml_dtypes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jaxpr_utils import dot_operand_dtypes

from fmtkit import with_policy
from fmtkit.policy import inspect_policy

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(jnp.bfloat16)

_RNG = np.random.default_rng(7)
PARAMS = {"w": jnp.asarray(_RNG.standard_normal((16, 8)), jnp.float32),
          "o": jnp.asarray(_RNG.standard_normal((8, 4)), jnp.float32)}
X = jnp.asarray(_RNG.standard_normal((4, 16)), jnp.float32)

# The user's program: one FP8 projection, policied on its own, inside a bf16-mixed model.
block = with_policy(lambda p, x: x @ p["w"], "fp8-current")


def model(p, x):
    return jnp.tanh(block(p, x)) @ p["o"]


def _loss(p, x):
    return jnp.sum(with_policy(model, "bf16-mixed")(p, x))


def _fp8_count(pairs) -> int:
    return sum(1 for pair in pairs if any(d in (E4M3, E5M2) for d in pair))


def test_fp8_block_inside_bf16_model_runs_fp8_forward_and_backward():
    """The block's matmul (not the model's output: no head) runs on E4M3 x E4M3 forward and
    with an E5M2 gradient operand backward (its custom VJP makes dgrad and wgrad); the
    model's own head on bf16."""
    pairs = dot_operand_dtypes(jax.make_jaxpr(jax.grad(_loss))(PARAMS, X))
    assert (E4M3, E4M3) in pairs, pairs
    assert (E5M2, E4M3) in pairs and (E4M3, E5M2) in pairs, pairs
    assert _fp8_count(pairs) == 3, pairs  # block forward, dgrad, wgrad
    assert pairs.count((BF16, BF16)) == 3, pairs  # the model's head: fwd, dgrad, wgrad


def _qdq(a) -> np.ndarray:
    """The block's operand as the policy quantizes it: rounded to the bf16 compute dtype, then
    per-tensor current scaling to E4M3 (scale = amax / 448), in float64 via ml_dtypes."""
    a = np.asarray(a).astype(BF16).astype(np.float32)
    scale = np.float32(np.max(np.abs(a))) / np.float32(448.0)
    return (a / scale).astype(E4M3).astype(np.float64) * np.float64(scale)


def test_fp8_block_value_matches_float64_reference():
    """The block's output inside the bf16 model equals float64 NumPy of the E4M3-quantized
    operands, rounded to the bf16 compute dtype."""
    out = with_policy(lambda p, x: jnp.tanh(block(p, x)), "bf16-mixed")(PARAMS, X)
    ref = np.tanh((_qdq(X) @ _qdq(PARAMS["w"]))
                  .astype(np.float32).astype(BF16).astype(np.float64))
    # bf16 rounding of an f32 accumulation vs of the float64 product: at most one bf16 ulp
    # apart where the two straddle a rounding boundary; tanh (|tanh'| <= 1) keeps the bound.
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=2.0**-7, atol=0)
    # Negative control: the same block on bf16 operands (no FP8) misses the reference.
    bf16 = np.tanh(np.asarray(X).astype(BF16).astype(np.float64)
                    @ np.asarray(PARAMS["w"]).astype(BF16).astype(np.float64))
    assert np.max(np.abs(bf16 - ref)) > 1e-2


def test_inspect_policy_reports_the_block_as_fp8():
    """inspect_policy of the outer model sees the block's GEMMs as FP8 projections run
    under a policy."""
    report = inspect_policy(with_policy(model, "bf16-mixed"), PARAMS, X, argnums=0)
    assert report.policied_fraction() == 1.0, str(report)
    assert report.fp8_fraction("forward") == 1.0, str(report)
    assert report.fp8_fraction("wgrad") == 1.0, str(report)


def test_mark_head_inside_the_block_keeps_its_head_out_of_fp8():
    """A block that calls mark_head on its output keeps that matmul its head (never FP8)."""
    from fmtkit.policy import mark_head

    head_block = with_policy(lambda p, x: mark_head(x @ p["w"]), "fp8-current")
    closed = jax.make_jaxpr(with_policy(lambda p, x: jnp.tanh(head_block(p, x)) @ p["o"],
                                        "bf16-mixed"))(PARAMS, X)
    assert _fp8_count(dot_operand_dtypes(closed)) == 0


@pytest.mark.slow
def test_inspect_policy_after_a_call_and_twice():
    """The outer model's kept trace (from a call, or an earlier inspect_policy) does not hide
    the block's ops from a later report."""
    outer = with_policy(model, "bf16-mixed")
    jax.block_until_ready(outer(PARAMS, X))
    for _ in range(2):
        assert inspect_policy(outer, PARAMS, X, argnums=0).fp8_fraction() == 1.0


@pytest.mark.slow
def test_inspect_policy_after_a_call_negative_control():
    """Mutation: the trace not told a policied function ran inside it: the kept trace from a
    call (no op scopes) is reused, and the report loses the block's FP8 GEMMs."""
    from fmtkit._switches import flipped

    with flipped(note_nested_calls=False):
        outer = with_policy(model, "bf16-mixed")
        jax.block_until_ready(outer(PARAMS, X))
        assert not inspect_policy(outer, PARAMS, X, argnums=0).fp8_fraction() == 1.0


@pytest.mark.slow
def test_policied_linen_model_applied_inside_a_bf16_model_keeps_fp8():
    """A policied linen block applied inside a policied function is a region too: its two
    Dense layers on E4M3 (no head by role), the model's own matmul on bf16."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(jax.nn.relu(nn.Dense(8)(x)))

    inner = with_policy(Block(), "fp8-current")
    variables = inner.init(jax.random.key(0), X)
    outer = with_policy(lambda v, x: jnp.tanh(inner.apply(v, x)) @ PARAMS["o"], "bf16-mixed")
    pairs = dot_operand_dtypes(jax.make_jaxpr(outer)(variables, X))
    assert pairs.count((E4M3, E4M3)) == 2, pairs
    assert pairs.count((BF16, BF16)) == 1, pairs


def _nnx_block():
    """The FP8 block as a policied NNX model: one bias-free ``nnx.Linear`` holding ``w``."""
    from flax import nnx

    linear = nnx.Linear(16, 8, use_bias=False, rngs=nnx.Rngs(0))
    linear.kernel.set_value(PARAMS["w"])
    return with_policy(linear, "fp8-current")


def test_policied_nnx_model_called_inside_a_bf16_function_keeps_fp8():
    """A policied NNX model called inside a policied function is a region: its matmul on
    E4M3 (no head by role), the model's own head on bf16; its output equals the float64
    reference of the FP8 block, and inspect_policy reports the block's GEMMs as FP8."""
    inner = _nnx_block()
    outer = with_policy(lambda p, x: jnp.tanh(inner(x)) @ p["o"], "bf16-mixed")
    pairs = dot_operand_dtypes(jax.make_jaxpr(outer)(PARAMS, X))
    assert pairs.count((E4M3, E4M3)) == 1, pairs
    assert pairs.count((BF16, BF16)) == 1, pairs

    out = with_policy(lambda p, x: jnp.tanh(inner(x)), "bf16-mixed")(PARAMS, X)
    ref = np.tanh((_qdq(X) @ _qdq(PARAMS["w"]))
                  .astype(np.float32).astype(BF16).astype(np.float64))
    # as in test_fp8_block_value_matches_float64_reference: one bf16 ulp at most
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=2.0**-7, atol=0)

    report = inspect_policy(outer, PARAMS, X, argnums=0)
    assert report.fp8_fraction("forward") == 1.0, str(report)


def test_policied_nnx_submodule_of_a_bf16_nnx_model_keeps_fp8():
    """A policied NNX model held and called by a bf16-mixed NNX model is a region too."""
    from flax import nnx

    class Outer(nnx.Module):
        def __init__(self, block):
            self.block = block
            self.head = nnx.Linear(8, 4, use_bias=False, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.head(jnp.tanh(self.block(x)))

    outer = with_policy(Outer(_nnx_block()), "bf16-mixed")
    pairs = dot_operand_dtypes(jax.make_jaxpr(lambda x: outer(x))(X))
    assert pairs.count((E4M3, E4M3)) == 1, pairs
    assert pairs.count((BF16, BF16)) == 1, pairs


@pytest.mark.slow
def test_delayed_nnx_region_without_its_state_raises():
    """A delayed-FP8 NNX model called inside another policied model before it has its amax
    histories cannot create them inside that trace: a ValueError naming the workaround."""
    from flax import nnx

    linear = nnx.Linear(16, 8, use_bias=False, rngs=nnx.Rngs(0))
    inner = with_policy(linear, "fp8-delayed")
    outer = with_policy(lambda p, x: jnp.tanh(inner(x)) @ p["o"], "bf16-mixed")
    with pytest.raises(ValueError, match=r"with_policy\(lambda m, x: m\(x\)"):
        outer(PARAMS, X)
