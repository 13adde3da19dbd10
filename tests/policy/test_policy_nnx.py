"""NNX-specific behaviour: graph copy sharing Variables, split/merge, closures, sow."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import zoo
from flax import nnx
from policy_testlib import X_MOE, build, dot_dtypes

from fmtkit.policy import Rules, inspect_policy, with_policy

BF16, F32 = "bfloat16", "float32"


def test_original_model_is_left_alone_and_state_layout_is_unchanged():
    case = build("nnx", "lm_moe_tied")
    before = {k: type(m) for k, m in nnx.iter_modules(case.model)}
    wrapped = with_policy(case.model, "bf16-mixed")
    assert {k: type(m) for k, m in nnx.iter_modules(case.model)} == before
    assert isinstance(wrapped, zoo.NnxTransformerLM)
    # Same state paths, same Variable objects: checkpoints and optimizers see one model.
    ref, got = nnx.state(case.model, nnx.Param), nnx.state(wrapped, nnx.Param)
    assert jax.tree.structure(ref) == jax.tree.structure(got)
    assert wrapped.blocks[0].moe.router.kernel is case.model.blocks[0].moe.router.kernel
    plain = inspect_policy(case.model, *case.inputs, loss_fn=case.loss_fn)
    assert {d for kind in ("forward", "dgrad", "wgrad") for head in (False, True)
            for _, d in plain.matmuls(kind, head=head)} == {f"{F32} x {F32} -> {F32}"}


def test_split_merge_keeps_the_policy():
    case = build("nnx", "mlp")
    wrapped = with_policy(case.model, "bf16-mixed")
    graphdef, state = nnx.split(wrapped)
    merged = nnx.merge(graphdef, state)
    report = inspect_policy(merged, *case.inputs)
    assert {d for _, d in report.matmuls("forward")} == {f"{BF16} x {BF16} -> {BF16}"}
    assert {d for _, d in report.matmuls("forward", head=True)} == {f"{BF16} x {BF16} -> {F32}"}
    assert report.output_dtypes == (F32,)

    @jax.jit
    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    dots = dot_dtypes(jax.make_jaxpr(apply)(state, *case.inputs))
    assert dots == {f"{BF16} x {BF16} -> {BF16}", f"{BF16} x {BF16} -> {F32}"}


def test_closures_under_jax_transforms_do_not_mutate_variables():
    case = build("nnx", "moe")
    wrapped = with_policy(case.model, "bf16-mixed")
    before = np.asarray(case.model.w_in[...])
    out = jax.jit(lambda x: wrapped(x))(X_MOE)  # the model is closed over, not an argument
    assert out.dtype == jnp.float32
    grads = jax.jit(jax.grad(lambda m, x: case.loss_fn(m(x))))(wrapped, X_MOE)
    assert grads.w_in[...].dtype == jnp.float32
    assert float(jnp.abs(grads.w_in[...]).sum()) > 0
    np.testing.assert_array_equal(np.asarray(case.model.w_in[...]), before)
    assert case.model.w_in[...].dtype == jnp.float32


def test_sow_inside_a_policied_module_reaches_the_model():
    model = zoo.NnxMoeBlock(16, 32, 4, sow=True, rngs=nnx.Rngs(0))
    wrapped = with_policy(model, "bf16-mixed")
    out, sown = nnx.capture(wrapped, nnx.Intermediate)(X_MOE)
    assert out.dtype == jnp.float32
    sown = nnx.to_pure_dict(sown)
    logits = jax.tree.leaves(sown["router_logits"])[0]
    assert logits.dtype == jnp.float32  # router logits stay f32 under bf16-mixed
    assert logits.shape == (2, 4, 4)
    assert jax.tree.leaves(sown["aux_loss"])[0].dtype == jnp.float32


def test_a_sown_value_is_what_the_sowing_module_reads():
    """As in linen: a module sows its child's output and gets the value its own ops read
    (the child's result cast to the child's output dtype), not the child's internal value."""

    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 4, use_bias=False, rngs=rngs)
            self.b = nnx.Linear(4, 3, use_bias=False, rngs=rngs)

        def __call__(self, x):
            y = self.a(x)
            self.sow(nnx.Intermediate, "y", y)
            return self.b(y)

    model = Outer(nnx.Rngs(0))
    rules = Rules([("^a$", "p=f32,c=f32,o=bf16")], default="p=f32,c=bf16,o=bf16")
    wrapped = with_policy(model, rules)
    x = jax.random.normal(jax.random.key(0), (5, 8), jnp.float32)
    out, sown = nnx.capture(wrapped, nnx.Intermediate)(x)
    (y,) = jax.tree.leaves(nnx.to_pure_dict(sown)["y"])
    assert y.dtype == jnp.bfloat16
    # Independent: "a" in float64 (f32 operands, f32 compute), rounded to bf16 by ml_dtypes.
    ka = np.asarray(model.a.kernel[...], np.float64)
    want = (np.asarray(x, np.float64) @ ka).astype(np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(y), want)
    # "b" reads the same values (bf16 x bf16 under bf16-mixed).
    kb = np.asarray(model.b.kernel[...]).astype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               np.asarray(y, np.float64) @ kb.astype(np.float64), rtol=2e-2)


def test_pure_bf16_converts_a_copy_and_leaves_the_original_alone():
    case = build("nnx", "mlp")
    kernel = np.asarray(case.model.layers[0].kernel[...])
    wrapped = with_policy(case.model, "pure-bf16")
    assert wrapped.layers[0].kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(wrapped.layers[0].kernel[...]),
                                  kernel.astype(ml_dtypes.bfloat16))
    # The original keeps its f32 Variables, bit for bit; only the copy holds bf16 ones.
    assert case.model.layers[0].kernel is not wrapped.layers[0].kernel
    assert case.model.layers[0].kernel[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(case.model.layers[0].kernel[...]), kernel)


def test_graphdef_is_not_picklable_as_documented():
    import pickle

    case = build("nnx", "mlp")
    wrapped = with_policy(case.model, "bf16-mixed")
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(nnx.graphdef(wrapped))


def test_fp8state_is_a_deprecated_alias_of_delayed_scaling_variable():
    import fmtkit.policy
    from fmtkit.policy import DelayedScalingVariable

    assert issubclass(DelayedScalingVariable, nnx.Variable)
    assert not issubclass(DelayedScalingVariable, nnx.Param)  # never seen by the optimizer
    with pytest.warns(DeprecationWarning, match=r"fmtkit\.policy\.DelayedScalingVariable"):
        old = fmtkit.policy.Fp8State
    assert old is DelayedScalingVariable
    with pytest.warns(DeprecationWarning, match="DelayedScalingVariable"):
        from fmtkit.policy import Fp8State
    assert Fp8State is DelayedScalingVariable
    # The deprecated name is not part of the surface a star-import brings in.
    assert "Fp8State" not in fmtkit.policy.__all__
    assert "DelayedScalingVariable" in fmtkit.policy.__all__


def test_the_policy_surface_imports_from_fmtkit_policy():
    import fmtkit.policy

    assert set(fmtkit.policy.__all__) == {
        "DelayedScalingVariable", "GemmSite", "MatmulOp", "ModuleReport", "Policy",
        "PolicyReport", "Rules", "as_rules", "describe_presets", "find_stack", "get_preset",
        "inspect_policy", "intercept_gemms", "keep_blocks", "list_presets", "mark_head",
        "module_paths", "with_policy"}
    for name in fmtkit.policy.__all__:
        assert getattr(fmtkit.policy, name) is not None
