"""linen-specific behaviour: lifted transforms, bare jit, user modules, the hand-written twin."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import zoo
from policy_testlib import TOKENS, build, dot_dtypes, init_params, loss_and_grads
from tolerances import rtol

from fmtkit.policy import Policy, Rules, inspect_policy, module_paths, with_policy

BF16, F32 = "bfloat16", "float32"


def _all_dots(report, head=False):
    return [pd for kind in ("forward", "dgrad", "wgrad") for pd in report.matmuls(kind, head=head)]


def test_scan_and_remat_bodies_get_the_policy():
    case = build("linen", "lm", scan_layers=True, remat=True, num_layers=2, num_experts=2)
    paths = module_paths(case.model, *case.inputs)
    assert {"blocks/ln_1", "blocks/attn/query", "blocks/MoeBlock_0/router"} <= set(paths)
    report = inspect_policy(with_policy(case.model, "bf16-mixed"), *case.inputs,
                            loss_fn=case.loss_fn)
    for path, d in _all_dots(report):
        want = f"{F32} x {F32}" if path.endswith("router") else f"{BF16} x {BF16}"
        assert d.startswith(want), (path, d)
    assert report.modules["blocks/ln_1"].norm_dtypes == (F32,)
    assert report.modules["blocks/attn"].softmax_dtypes == (F32,)
    kernel = report.params["blocks/MoeBlock_0/router/kernel"]
    assert kernel == (F32, F32)
    assert all(v == (F32, F32) for v in report.params.values())
    # Under "fp32" the scanned, rematerialized model gives the unwrapped model's numbers.
    params = init_params(case)
    assert params["blocks"]["ln_1"]["scale"].shape == (2, 32)
    ref = loss_and_grads(case, case.model, params)
    got = loss_and_grads(case, with_policy(case.model, "fp32"), params)
    assert np.asarray(got[0]) == np.asarray(ref[0])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 got[1], ref[1])


class Ensemble(nn.Module):
    """Three Dense heads stacked with nn.vmap."""

    @nn.compact
    def __call__(self, x):
        dense = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=None, out_axes=0, axis_size=3)
        return dense(4, name="heads")(x)


def test_nn_vmap_body_gets_the_policy():
    x = jnp.ones((2, 5), jnp.float32)
    report = inspect_policy(with_policy(Ensemble(), "bf16-mixed"), x)
    # The vmapped Dense produces the model's output: the head, found by its role.
    assert report.modules["heads"].head["forward"] == (f"{BF16} x {BF16} -> {F32}",)
    assert report.params["heads/kernel"] == (F32, F32)
    assert report.output_dtypes == (F32,)


def test_bare_jit_of_apply_keeps_the_policy():
    case = build("linen", "mlp")
    wrapped = with_policy(case.model, "bf16-mixed")
    params = init_params(case)
    jitted = jax.jit(wrapped.apply)  # traced with no context manager around it
    dots = dot_dtypes(jax.make_jaxpr(jitted)({"params": params}, *case.inputs))
    # The hidden layer in bf16; the last layer is the head: bf16 operands, f32 logits.
    assert dots == {f"{BF16} x {BF16} -> {BF16}", f"{BF16} x {BF16} -> {F32}"}
    out = jitted({"params": params}, *case.inputs)
    assert out.dtype == jnp.float32
    # The unwrapped model, traced afterwards, is untouched: f32 matmuls only.
    plain = inspect_policy(case.model, *case.inputs)
    assert {d for _, d in _all_dots(plain) + _all_dots(plain, head=True)} == {
        f"{F32} x {F32} -> {F32}"}


class RawParams(nn.Module):
    """A user module without a dtype field: raw self.param in setup and in __call__."""

    def setup(self):
        self.bias = self.param("bias", nn.initializers.normal(1.0), (4,))

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (x.shape[-1], 4))
        return x @ w + self.bias[None, :]


def test_user_modules_using_self_param_are_cast_at_use():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 6)), jnp.float32)
    model = RawParams()
    wrapped = with_policy(model, Policy.parse("p=f32,c=bf16,o=f32"))
    variables = model.init(jax.random.key(0), x)
    assert jax.tree.leaves(wrapped.init(jax.random.key(0), x)) and all(
        leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(wrapped.init(jax.random.key(0), x)))
    report = inspect_policy(wrapped, x, variables=variables)
    # A Policy alone has no head rule: the output matmul is an ordinary bf16 matmul.
    assert report.modules[""].matmuls["forward"] == (f"{BF16} x {BF16} -> {BF16}",)
    assert report.params == {"bias": (F32, F32), "w": (F32, F32)}
    got = wrapped.apply(variables, x)
    p = variables["params"]
    def bf(v):
        return np.asarray(v, np.float32).astype(jnp.bfloat16).astype(np.float64)

    # bf16 operands, a bf16 matmul result, the bias (a parameter) added in bf16, f32 out.
    ref = bf(bf(bf(x) @ bf(p["w"])) + bf(p["bias"]))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref, rtol=rtol(jnp.bfloat16))


def test_init_gives_the_unwrapped_parameter_tree():
    case = build("linen", "lm_moe_tied")
    wrapped = with_policy(case.model, "bf16-mixed")
    got = jax.eval_shape(wrapped.init, jax.random.key(0), *case.inputs)
    ref = jax.eval_shape(case.model.init, jax.random.key(0), *case.inputs)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    assert jax.tree.leaves(got) == jax.tree.leaves(ref)  # shapes and dtypes


def test_bf16_mixed_reproduces_the_hand_written_mixed_precision_model():
    """The policy on the f32 model ~ Flax's own dtype knobs set by hand."""
    case = build("linen", "lm")
    params = init_params(case)
    hand = zoo.TransformerLM(dataclasses.replace(
        case.model.cfg, dtype="bfloat16", norm_dtype="float32", router_dtype="float32",
        logits_dtype="float32", softmax_f32=True))
    wrapped = with_policy(case.model, "bf16-mixed")

    def loss(model):
        return jax.jit(lambda p: case.loss_fn(model.apply({"params": p}, *case.inputs)))(params)

    # The hand-written model mixes f32 and bf16 inside Flax's layers, which only standard
    # promotion allows: that is what the policy saves its users from.
    with jax.numpy_dtype_promotion("standard"):
        loss_hand = loss(hand)
    loss_pol = loss(wrapped)
    # Not bit-identical: the policy also keeps every sum in f32 and computes the head on
    # bf16 operands with f32 logits (the hand-written twin runs its head in f32); the two
    # agree to bf16 precision.
    np.testing.assert_allclose(float(loss_pol), float(loss_hand), rtol=rtol(jnp.bfloat16))

    # Gradients, on the MoE layer (router in f32 by hand, as the preset does).
    case = build("linen", "moe")
    params = init_params(case)
    hand = zoo.MoeBlock(num_experts=4, d_ff=32, dtype=jnp.bfloat16,
                           router_dtype=jnp.float32)
    # The policy casts the layer's input to bf16 at the boundary; by hand, the caller does.
    hand_case = dataclasses.replace(case, inputs=(case.inputs[0].astype(jnp.bfloat16),))
    with jax.numpy_dtype_promotion("standard"):
        loss_hand, g_hand = loss_and_grads(hand_case, hand, params)
    loss_pol, g_pol = loss_and_grads(case, with_policy(case.model, "bf16-mixed"), params)
    np.testing.assert_allclose(float(loss_pol), float(loss_hand), rtol=rtol(jnp.bfloat16))
    # The hand-written layer casts its f32 router input inside Dense (one convert per use)
    # and sums the input cotangents of the router and expert branches in bf16; the policy
    # casts once at each module boundary. So gradients agree to bf16 precision.
    for a, b in zip(jax.tree.leaves(g_pol), jax.tree.leaves(g_hand)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= rtol(jnp.bfloat16) * np.linalg.norm(b)


def test_strict_promotion_user_code_runs_under_the_policy():
    """User code is traced in its own dtypes (strict-clean there); the policy's dtype changes
    happen on the trace, so strict promotion never sees a bf16 + f32 mix."""

    class Mixes(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8)(x)
            return h + jnp.ones(h.shape, jnp.float32)  # a bf16 matmul result + an f32 array

    x = TOKENS.astype(jnp.float32)
    wrapped = with_policy(Mixes(), "p=f32,c=bf16")
    out = wrapped.apply(wrapped.init(jax.random.key(0), x), x)
    assert out.dtype == jnp.float32  # the f32 array is an activation: the widest wins

    class Mixes2(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + jnp.ones(x.shape, jnp.bfloat16)  # a real mix in the user's own code

    with pytest.raises(jax.dtypes.TypePromotionError):
        with_policy(Mixes2(), "p=f32,c=bf16").init(jax.random.key(0), x)


def test_a_sown_value_is_what_the_sowing_module_reads():
    """A module sows its child's output: it gets the value the module's own ops read (the
    child's result cast to the child's output dtype), not the child's internal value."""

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(4, use_bias=False, name="a")(x)
            self.sow("intermediates", "y", y)
            return nn.Dense(3, use_bias=False, name="b")(y)

    rules = Rules([("^a$", "p=f32,c=f32,o=bf16")], default="p=f32,c=bf16,o=bf16")
    model = with_policy(Outer(), rules)
    x = jax.random.normal(jax.random.key(0), (5, 8), jnp.float32)
    variables = model.init(jax.random.key(1), x)
    out, state = model.apply(variables, x, mutable=["intermediates"])
    (y,) = state["intermediates"]["y"]
    assert y.dtype == jnp.bfloat16
    # Independent: "a" in float64 (f32 operands, f32 compute), rounded to bf16 by ml_dtypes.
    ka = np.asarray(variables["params"]["a"]["kernel"], np.float64)
    want = (np.asarray(x, np.float64) @ ka).astype(np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(y), want)
    # "b" reads the same values (bf16 x bf16 under bf16-mixed).
    kb = np.asarray(variables["params"]["b"]["kernel"]).astype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               np.asarray(y, np.float64) @ kb.astype(np.float64), rtol=2e-2)
