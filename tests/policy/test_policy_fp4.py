"""FP4 recipes through with_policy: every projection GEMM of a linen and an NNX transformer
takes FP4 operands (forward, dgrad, wgrad) and keep_blocks keeps exactly the blocks asked for."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jaxpr_utils import fp4_gemms
from zoo import NnxTransformerLM, TransformerConfig, TransformerLM, lm_loss

from fmtkit import fp4
from fmtkit.policy import (
    Policy,
    find_stack,
    get_preset,
    keep_blocks,
    list_presets,
    module_paths,
    with_policy,
)

CFG = TransformerConfig(d_model=32, num_heads=2, num_layers=3, d_ff=64, max_len=16)
TOKENS = jnp.zeros((2, 16), jnp.int32)
PROJECTIONS = 6  # per block: attention query, key, value, out; the MLP's two layers
BLOCK = {"nvfp4": 16, "nvfp4-no-rht": 16, "nvfp4-no-sr": 16, "nvfp4-no-2d": 16, "mxfp4": 32}


def test_presets_and_policy_names():
    assert set(fp4.RECIPES) <= set(list_presets())
    p = Policy.parse("p=f32,c=bf16,fp8=nvfp4")
    assert p.fp8 is fp4.RECIPES["nvfp4"] and Policy.parse(str(p)) == p
    rules = get_preset("mxfp4")
    assert rules.resolve("Block_0/MlpBlock_0/Dense_0", ("Dense",)).fp8.name == "mxfp4"
    assert rules.resolve("Block_0/ln_1", ("RMSNorm",)).fp8 is None
    assert rules.head.fp8 is None


def _linen_jaxpr(rules):
    model = with_policy(TransformerLM(CFG), rules)
    params = jax.eval_shape(model.init, jax.random.key(0), TOKENS)["params"]
    return jax.make_jaxpr(jax.value_and_grad(
        lambda p: lm_loss(model.apply({"params": p}, TOKENS).astype(jnp.float32), TOKENS)))(
        params)


def _nnx_jaxpr(rules):
    model = with_policy(NnxTransformerLM(CFG, rngs=nnx.Rngs(0)), rules)
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        m = nnx.merge(graph, p, rest)
        return lm_loss(m(TOKENS).astype(jnp.float32), TOKENS)

    return jax.make_jaxpr(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("name", list(fp4.RECIPES))
def test_linen_every_projection_gemm_takes_fp4(name):
    sizes = fp4_gemms(_linen_jaxpr(name))
    assert len(sizes) == 3 * PROJECTIONS * CFG.num_layers
    assert set(sizes) == {BLOCK[name]}


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_nnx_every_projection_gemm_takes_fp4(name):
    sizes = fp4_gemms(_nnx_jaxpr(name))
    assert len(sizes) == 3 * PROJECTIONS * CFG.num_layers
    assert set(sizes) == {BLOCK[name]}


def test_keep_blocks_keeps_exactly_the_blocks_asked_for():
    paths = module_paths(TransformerLM(CFG), TOKENS)
    assert find_stack(paths) == ("Block_", 3)
    rules = keep_blocks("nvfp4", paths, last=1)
    for path in paths:
        pol = rules.resolve(path, ())
        if path.startswith("Block_2/") and path.endswith(("Dense_0", "Dense_1", "query", "out")):
            assert pol.fp8 is None and pol.compute_dtype == "bfloat16", path
        elif path.startswith(("Block_0/", "Block_1/")) and path.endswith(("Dense_1", "key")):
            assert pol.fp8.name == "nvfp4", path
    assert rules.resolve("Block_2/ln_1", ("RMSNorm",)).compute_dtype == "float32"  # norms win
    assert len(fp4_gemms(_linen_jaxpr(rules))) == 3 * PROJECTIONS * 2
    first = keep_blocks("nvfp4", paths, first=1, last=1)
    assert len(fp4_gemms(_linen_jaxpr(first))) == 3 * PROJECTIONS * 1
    assert first.resolve("Block_0/attn/query").fp8 is None
    assert first.resolve("Block_1/attn/query").fp8.name == "nvfp4"


def test_keep_blocks_nnx_and_errors():
    model = NnxTransformerLM(CFG, rngs=nnx.Rngs(0))
    paths = module_paths(model)
    assert find_stack(paths) == ("blocks/", 3)
    rules = keep_blocks("nvfp4", paths, last=2)
    assert rules.resolve("blocks/0/mlp/linear1").fp8.name == "nvfp4"
    assert rules.resolve("blocks/1/mlp/linear1").fp8 is None
    assert rules.resolve("blocks/2/attn/query").fp8 is None
    assert len(fp4_gemms(_nnx_jaxpr(rules))) == 3 * PROJECTIONS * 1
    with pytest.raises(ValueError, match="exceeds the 3 blocks"):
        keep_blocks("nvfp4", paths, first=2, last=2)
    with pytest.raises(ValueError, match="last must be a non-negative int"):
        keep_blocks("nvfp4", paths, last=-1)
    with pytest.raises(ValueError, match="No layer stack"):
        keep_blocks("nvfp4", ["", "head"], last=1)
    with pytest.raises(ValueError, match=r"not 0\.\.L-1"):
        find_stack(["Block_0/Dense_0", "Block_2/Dense_0"])


def test_plain_dense_with_fp4_recipe_as_rule():
    model = with_policy(nn.Dense(16), [("", fp4.RECIPES["nvfp4"])])
    x = jnp.ones((4, 32))
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]  # only traced
    jaxpr = jax.make_jaxpr(jax.value_and_grad(
        lambda p: jnp.sum(model.apply({"params": p}, x).astype(jnp.float32))))(params)
    assert len(fp4_gemms(jaxpr)) == 3


# Operand block shapes over [free, contraction] of each FP4 GEMM (fmtkit.fp4's recipe table):
# NVFP4 forward x 1x16 with the 16x16 weight, dgrad dy 1x16 with the same 16x16 weight
# blocks, wgrad dy and x both 1x16 along the tokens; MXFP4 1x32 everywhere.
FP4_BLOCKS = {"nvfp4": {"forward": "1x16 x 16x16", "dgrad": "1x16 x 16x16",
                        "wgrad": "1x16 x 1x16"},
              "mxfp4": dict.fromkeys(("forward", "dgrad", "wgrad"), "1x32 x 1x32")}


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_inspect_policy_reports_fp4_gemms_as_e2m1(name):
    from fmtkit.policy import inspect_policy

    rules = keep_blocks(name, module_paths(TransformerLM(CFG), TOKENS), last=1)
    report = inspect_policy(with_policy(TransformerLM(CFG), rules), TOKENS,
                            loss_fn=lambda y: lm_loss(y.astype(jnp.float32), TOKENS))
    proj = [m for m in report.matmul_ops if m.projection and not m.head]
    fp4_ops = [m for m in proj if not m.path.startswith("Block_2/")]
    kept = [m for m in proj if m.path.startswith("Block_2/")]
    # Blocks 0 and 1: 6 projections x 3 GEMMs each, every one on E2M1 operands (the emulated
    # dot reads them as E4M3: the report must say what the GEMM computes in).
    assert len(fp4_ops) == 3 * PROJECTIONS * 2
    for m in fp4_ops:
        assert m.dtypes == "float4_e2m1fn x float4_e2m1fn -> float32", m
        assert m.blocks == FP4_BLOCKS[name][m.kind], m
        assert m.low_precision and m.policied
    assert {m.kind for m in fp4_ops} == {"forward", "dgrad", "wgrad"}
    # The kept block (by position) computes in bf16; nothing else reports E4M3 or blocks.
    assert len(kept) == 3 * PROJECTIONS
    assert all(m.dtypes.startswith("bfloat16 x bfloat16") and m.blocks == "" for m in kept)
    assert not any("float8" in m.dtypes for m in report.matmul_ops)
    fwd = dict(report.matmuls("forward"))
    assert fwd["Block_0/attn/query"].startswith("float4_e2m1fn x float4_e2m1fn")
    assert fwd["Block_2/attn/query"].startswith("bfloat16 x bfloat16")
