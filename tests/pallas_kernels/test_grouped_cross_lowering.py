"""The grouped FP8 kernels cross-lowered for the H200 on CPU (Mosaic GPU's own passes):
DeepSeek-V3 expert shapes, shared memory as modelled and within the budget, the expert
stack read whole by the kernel (one TMA descriptor), one compiled kernel for any
``group_sizes``. 3-40 s a lowering (slow)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.config import (
    BLOCK_K,
    SHIPPED_CONFIGS,
    SMEM_BYTES_H200,
    TuningConfig,
    pipeline_stages,
    smem_bytes,
)
from pallas_kernels.grouped_fp8_matmul import grouped_fp8_matmul, grouped_fp8_wgrad_matmul

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
MESH = jax.sharding.AbstractMesh((), (), abstract_device=H200)
KERNEL_PRIMS = ("mpmd_map", "pallas_call")


def _args(m, n, k, g):
    return (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
            jax.ShapeDtypeStruct((g, n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((g, -(-n // 128), k // 128), jnp.float32),
            jax.ShapeDtypeStruct((g,), jnp.int32))


def _fn(config, out_dtype=jnp.bfloat16):
    return jax.jit(functools.partial(grouped_fp8_matmul, impl="kernel", config=config,
                                     out_dtype=out_dtype))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["128x128", "64x128"])
def test_grouped_lowers_for_h200_at_deepseek_expert_shapes(name):
    """G = 8 experts of 4096 rows at DeepSeek-V3's expert up-projection (N, K = 4096,
    7168): the shipped config's stages fit (the dense kernel's shared memory model; the
    grouped kernel's unswizzled staging slots have the same bytes)."""
    config = SHIPPED_CONFIGS[name]
    stages, _ = pipeline_stages(config, 7168 // BLOCK_K)
    assert smem_bytes(config, jnp.bfloat16, stages) <= SMEM_BYTES_H200
    with jax.sharding.use_abstract_mesh(MESH):
        text = _fn(config).trace(*_args(8 * 4096, 4096, 7168, 8)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1


@pytest.mark.slow
def test_one_more_stage_overflows_as_modelled():
    """Control: one stage more than fits is refused by Mosaic GPU, which counts exactly
    the bytes ``smem_bytes`` predicts for the dense kernel: the grouped kernel's shared
    memory is the dense model's."""
    config = SHIPPED_CONFIGS["64x128"]
    bigger = TuningConfig(config.block_m, config.block_n, config.wg_split,
                          config.max_concurrent_steps + 1)
    want = smem_bytes(bigger, jnp.bfloat16)
    assert want > SMEM_BYTES_H200
    k = bigger.max_concurrent_steps * BLOCK_K
    with jax.sharding.use_abstract_mesh(MESH), pytest.raises(
            ValueError, match=f"smem_bytes={want} > max_smem_bytes"):
        _fn(bigger).trace(*_args(512, 256, k, 4)).lower(lowering_platforms=("cuda",))


@pytest.mark.slow
def test_one_kernel_for_any_group_sizes_and_the_stack_through_one_descriptor():
    """group_sizes is data: traces for two layouts (separately jitted) are the same
    program, one kernel call whose parameters do not depend on the sizes (no per-expert
    recompilation), lowered once for both; and the [G, N, K] expert stack enters the
    kernel whole (no slice, gather or copy of it outside: the kernel indexes the expert
    in its TMA descriptor). (Two separately jitted lowerings of the same program carry
    different Mosaic GPU module hashes, so texts are compared from one jitted function.)"""
    config = SHIPPED_CONFIGS["64x128"]
    m, n, k, g = 1024, 256, 512, 4
    a, as_, b, bs, _ = _args(m, n, k, g)
    layouts = [jnp.array(s, jnp.int32) for s in ([256, 0, 700, 68], [1, 1, 1, 1000])]
    with jax.sharding.use_abstract_mesh(MESH):
        traces = [_fn(config).trace(a, as_, b, bs, gs) for gs in layouts]
        fn = _fn(config)
        texts = [fn.trace(a, as_, b, bs, gs).lower(lowering_platforms=("cuda",)).as_text()
                 for gs in layouts]
    assert str(traces[0].jaxpr) == str(traces[1].jaxpr)
    assert texts[0] == texts[1] and texts[0].count("@mosaic_gpu") == 1
    inner = traces[0].jaxpr.jaxpr.eqns[0].params["jaxpr"]  # the jitted wrapper's body
    kernel, b_var = _only_user(inner, inner.invars[2])
    if kernel.primitive.name == "custom_vmap_call":  # plgpu.kernel's batching wrapper
        call = kernel.params["call"].jaxpr
        kernel, b_var = _only_user(call, call.invars[kernel.invars.index(b_var)])
    assert kernel.primitive.name in KERNEL_PRIMS
    assert [tuple(v.aval.shape) for v in kernel.invars if v is b_var] == [(g, n, k)]


def _only_user(jaxpr, var):
    """The one equation that reads ``var`` (the test fails if there are others)."""
    users = [e for e in jaxpr.eqns if any(v is var for v in e.invars)]
    assert len(users) == 1, [e.primitive.name for e in users]
    return users[0], var


@pytest.mark.slow
def test_wgrad_lowers_for_h200():
    """The weight-gradient kernel at DeepSeek-V3's expert shape (dW [8, 4096, 7168] f32
    from 8 x 4096 tokens on the padded layout): a traced pipeline length per expert."""
    config = SHIPPED_CONFIGS["128x128"]
    t = 8 * 4096 + 8 * 128
    args = (jax.ShapeDtypeStruct((4096, t), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((4096, t // 128), jnp.float32),
            jax.ShapeDtypeStruct((7168, t), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((7168, t // 128), jnp.float32),
            jax.ShapeDtypeStruct((2, 8), jnp.int32))
    with jax.sharding.use_abstract_mesh(MESH):
        text = jax.jit(functools.partial(grouped_fp8_wgrad_matmul, impl="kernel",
                                         config=config)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert np.dtype(jnp.float32).name in text
