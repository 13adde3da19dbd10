"""FP8 recipes through with_policy rules: linen and NNX transformers train with FP8 matmuls."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jaxpr_utils import dot_operand_dtypes
from zoo import NnxTransformerLM, TransformerConfig, TransformerLM, lm_loss

from fmtkit import fp8
from fmtkit.policy import (
    DelayedScalingVariable,
    Policy,
    Rules,
    get_preset,
    list_presets,
    with_policy,
)

# Tokens per batch (4 x 64 = 256) and every matmul dim divide the 128 blocks of "blockwise".
CFG = TransformerConfig(d_model=128, num_heads=2, num_layers=1, d_ff=256, max_len=64)
STEPS = 12
RECIPES = list(fp8.RECIPES)


def _batches():
    rng = np.random.default_rng(0)
    # A learnable signal: a repeating pattern with noise, so loss falls within a few steps.
    base = np.tile(np.arange(64) % 8 + 97, (4, 1))
    return [jnp.asarray(np.where(rng.random((4, 64)) < 0.1, rng.integers(0, 256, (4, 64)),
                                 base), jnp.int32) for _ in range(STEPS)]


def test_policy_fp8_field_parse_and_rules():
    p = Policy.parse("p=f32,c=bf16,fp8=blockwise")
    assert p.fp8 is fp8.RECIPES["blockwise"]
    assert str(p) == "p=f32,c=bf16,o=bf16,g=bf16,fp8=blockwise"
    assert Policy.parse(str(p)) == p
    rule = Rules([("Dense", fp8.RECIPES["mxfp8"])]).resolve("Dense_0", ("Dense",))
    assert rule.compute_dtype == "bfloat16" and rule.fp8.name == "mxfp8"
    assert Policy.parse("p=f32,c=bf16,r=bf16").reduce_dtype == "bfloat16"
    assert Policy().reduce_dtype == "float32"  # follows params


def test_fp8_presets_keep_head_norms_router_out_of_fp8():
    assert {f"fp8-{r}" for r in RECIPES} <= set(list_presets())
    rules = get_preset("fp8-blockwise")
    assert rules.resolve("Block_0/MlpBlock_0/Dense_0", ("Dense",)).fp8.name == "blockwise"
    assert rules.resolve("blocks/0/attn/query", ("LinearGeneral",)).fp8.name == "blockwise"
    for path, types in (("Block_0/ln_1", ("RMSNorm",)), ("blocks/0/moe/router", ("Linear",))):
        assert rules.resolve(path, types).fp8 is None, path
    assert rules.head.fp8 is None  # the head (found by role) stays out of FP8


def _train_linen(preset):
    model = with_policy(TransformerLM(CFG), preset)
    batches = _batches()
    # Eager: after the first recipe, JAX's per-op cache makes this ~0.03 s; a jitted init
    # compiles a new program per recipe (~2 s each, measured on the 2-core CPU).
    variables = model.init(jax.random.key(0), batches[0])
    params, state = variables["params"], variables.get("fp8_state", {})
    opt = optax.sgd(0.3)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, state, opt_state, tokens):
        def loss(p, s):
            v = {"params": p, "fp8_state": s} if s else {"params": p}
            return lm_loss(model.apply(v, tokens).astype(jnp.float32), tokens)

        value, (g, obs) = jax.value_and_grad(loss, argnums=(0, 1))(params, state)
        updates, opt_state = opt.update(g, opt_state)
        return optax.apply_updates(params, updates), fp8.update_state(state, obs), opt_state, value

    losses = []
    for tokens in batches:
        params, state, opt_state, value = step(params, state, opt_state, tokens)
        losses.append(float(value))
    return losses, params, state, model, variables


def _train_nnx(preset):
    model = with_policy(NnxTransformerLM(CFG, rngs=nnx.Rngs(0)), preset)
    model(_batches()[0])  # one call outside the step creates the delayed-FP8 state
    opt = nnx.Optimizer(model, optax.sgd(0.3), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, tokens):
        def loss(m):
            return lm_loss(m(tokens).astype(jnp.float32), tokens)

        wrt = nnx.DiffState(0, (nnx.Param, DelayedScalingVariable))
        value, g = nnx.value_and_grad(loss, argnums=wrt)(model)
        g_params, g_state = nnx.split_state(g, nnx.Param, DelayedScalingVariable)
        opt.update(model, g_params)
        nnx.update(model, fp8.update_state(nnx.state(model, DelayedScalingVariable), g_state))
        return value

    return [float(step(model, opt, t)) for t in _batches()], model


@functools.cache
def _linen_bf16():
    return _train_linen("bf16-mixed")[0]


@functools.cache
def _nnx_bf16():
    return _train_nnx("bf16-mixed")[0]


# Relative gap of the final loss to bf16-mixed after STEPS steps of SGD on CPU: E4M3 operands
# (3 mantissa bits, ~2-3% relative error per GEMM) perturb every step; over 12 steps the
# trajectories stay within a few percent. The per-tensor recipes carry E5M2 gradients.
MAX_GAP = 0.05


def _some_slow(fast):
    """RECIPES, those not in ``fast`` under `make test-all` only (each recipe trains in the
    fast set on linen or NNX)."""
    return [pytest.param(r, marks=() if r in fast else pytest.mark.slow) for r in RECIPES]


@pytest.mark.parametrize("recipe", _some_slow({"current", "blockwise", "mxfp8", "rowwise"}))
def test_linen_trains_with_each_recipe(recipe):
    losses, params, state, _, variables = _train_linen(f"fp8-{recipe}")
    ref = _linen_bf16()
    assert losses[-1] < 0.8 * losses[0]  # it trains
    assert abs(losses[-1] - ref[-1]) / ref[-1] < MAX_GAP
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))  # masters untouched
    if recipe == "delayed":
        assert "fp8_state" not in variables["params"]
        hist = jax.tree.leaves(state)
        assert len(hist) == 6  # q, k, v, out, mlp in, mlp out of one block (not the head)
        assert all(float(h[0, STEPS - 1]) > 0 and float(h[0, STEPS]) == 0 for h in hist)
    else:
        assert state == {}


@pytest.mark.parametrize("recipe", _some_slow({"delayed", "blockwise"}))
def test_nnx_trains_with_each_recipe(recipe):
    losses, model = _train_nnx(f"fp8-{recipe}")
    ref = _nnx_bf16()
    assert losses[-1] < 0.8 * losses[0]
    assert abs(losses[-1] - ref[-1]) / ref[-1] < MAX_GAP
    hist = jax.tree.leaves(nnx.state(model, DelayedScalingVariable))
    assert len(hist) == (6 if recipe == "delayed" else 0)
    for h in hist:
        assert float(h[0, STEPS - 1]) > 0 and float(h[0, STEPS]) == 0  # one entry per step


def test_linen_fp8_matmuls_in_forward_and_backward():
    model = with_policy(TransformerLM(CFG), "fp8-blockwise")
    tokens = _batches()[0]
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]  # only traced

    def loss(p):
        return lm_loss(model.apply({"params": p}, tokens).astype(jnp.float32), tokens)

    dots = dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(params))
    n_fp8 = sum(all(jnp.dtype(d).itemsize == 1 for d in pair) for pair in dots)
    # 6 linear layers x 3 GEMMs each in FP8; attention scores/values and the head in bf16.
    assert n_fp8 == 18
    assert all(jnp.dtype(d).itemsize <= 2 for pair in dots for d in pair)  # nothing in f32


def test_fp8_errors_name_the_module(monkeypatch):
    def failing(recipe):
        def dot(*args, **kwargs):
            raise ValueError("cannot tile")

        return dot

    monkeypatch.setattr(fp8, "dot_general_fn", failing)
    model = with_policy(TransformerLM(CFG), "fp8-current")
    tokens = _batches()[0]
    variables = model.init(jax.random.key(0), tokens)
    with pytest.raises(ValueError, match=r"module 'Block_0/attn/query'"):
        model.apply(variables, tokens)


def test_blockwise_pads_sizes_that_are_not_multiples_of_128():
    """d_model 64 and 4 x 63 tokens for the weight gradient: zero-padded inside each GEMM
    (fmtkit.fp8), so the first gradient is finite instead of an error."""
    small = TransformerConfig(d_model=64, num_heads=2, num_layers=1, d_ff=128, max_len=64)
    model = with_policy(TransformerLM(small), "fp8-blockwise")
    tokens = jax.random.randint(jax.random.key(1), (4, 63), 0, 256, jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    grads = jax.jit(jax.grad(lambda p: lm_loss(
        model.apply({"params": p}, tokens).astype(jnp.float32), tokens)))(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert any(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))


def test_user_linen_model_with_fp8_rule():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(128, name="out")(nn.relu(nn.Dense(256, name="fc")(x)))

    model = with_policy(Net(), Rules([("^fc$", fp8.RECIPES["current"])], default="f32"))
    x = jax.random.normal(jax.random.key(1), (128, 128), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]  # only traced
    dots = dot_operand_dtypes(jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(params))
    assert [jnp.dtype(d).name for d in dots[0]] == ["float8_e4m3fn", "float8_e4m3fn"]
    assert [jnp.dtype(d).name for d in dots[1]] == ["float32", "float32"]


def test_inspect_policy_reports_one_fp8_gemm_per_blockwise_matmul():
    """Off GPUs a blockwise GEMM over several 128-blocks is one 2-D dot per block in a scan
    (``fmtkit._lowp.gemm._block_dots``): the report still lists each layer's three GEMMs once, in
    E4M3, with the FLOPs of the whole GEMM (2 x 256 tokens x in x out), dgrad and wgrad
    told apart; the first layer has no dgrad (the input is not differentiated: what the
    step runs)."""
    from fmtkit.policy import inspect_policy

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(512, name="fc0")(x))  # K = 640: 5 blocks
            x = nn.relu(nn.Dense(384, name="fc1")(x))  # K = 512: 4 blocks
            return nn.Dense(10, name="head")(x)

    x = jax.ShapeDtypeStruct((256, 640), jnp.float32)
    report = inspect_policy(with_policy(Net(), "fp8-blockwise"), x)
    e4m3 = "float8_e4m3fn x float8_e4m3fn -> float32"
    fp8_ops = sorted((m.path, m.kind, m.dtypes, m.flops) for m in report.matmul_ops
                     if not m.head)
    assert fp8_ops == sorted((path, kind, e4m3, 2 * 256 * k * n)
                             for path, k, n in (("fc0", 640, 512), ("fc1", 512, 384))
                             for kind in ("forward", "dgrad", "wgrad")
                             if (path, kind) != ("fc0", "dgrad"))
    assert report.policied_fraction() == 1.0
