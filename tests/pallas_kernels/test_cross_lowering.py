"""Cross-lowering for the H200 on CPU: every shipped tile config at production shapes.

Lowering runs Mosaic GPU's own compiler passes, so it catches what interpret mode accepts
but the hardware would not: shared memory past 227 KiB, FP8 operands that are not K-major,
TMA copies narrower than 16 bytes, register layouts wgmma cannot take. About 0.5 s a case.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import blockwise_fp8_matmul, quantize_1x128, quantize_128x128
from pallas_kernels.bench import DEFAULT_SHAPES
from pallas_kernels.config import (
    BLOCK_K,
    SHIPPED_CONFIGS,
    SMEM_BYTES_H200,
    TuningConfig,
    max_stages,
    pipeline_stages,
    smem_bytes,
)

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


def _lower_for_h200(fn, *args) -> str:
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def _matmul_args(m, n, k, b_rows=False):
    return (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n if b_rows else -(-n // 128), k // 128), jnp.float32))


def _report(name, dtype, shape, config, b_rows=False):
    """The shared memory a lowering uses (shown with ``pytest -s``; the table is in
    docs/guides/kernels.md)."""
    stages, persistent = pipeline_stages(config, shape[2] // BLOCK_K)
    print(f"{name} {np.dtype(dtype).name} {'x'.join(map(str, shape))}"
          f"{' b-rows' if b_rows else ''}: {stages} stages "
          f"({'persistent' if persistent else 'drain per tile'}), smem "
          f"{smem_bytes(config, dtype, stages)} of {SMEM_BYTES_H200} bytes")


# Every shipped config at every production shape (the benchmark's: 4096^3, 8192^3 and
# DeepSeek-V3's four projections at M = 4096) in bf16, the training path's output; f32 at
# the two shapes whose K gives the most and fewest stages. About 3-5 s a case.
CASES = ([(name, jnp.bfloat16, shape) for name in SHIPPED_CONFIGS for shape in DEFAULT_SHAPES]
         + [(name, jnp.float32, shape) for name in SHIPPED_CONFIGS
            for shape in ((4096, 7168, 2048), (4096, 24576, 1536))])


@pytest.mark.parametrize("name,dtype,shape", CASES, ids=[
    f"{c[0]}-{np.dtype(c[1]).name}-{'x'.join(map(str, c[2]))}" for c in CASES])
def test_shipped_config_lowers_for_h200(name, dtype, shape):
    config = SHIPPED_CONFIGS[name]
    assert config.max_concurrent_steps == max_stages(config, dtype)  # the most that fit
    _report(name, dtype, shape, config)
    text = _lower_for_h200(
        functools.partial(blockwise_fp8_matmul, out_dtype=dtype, impl="kernel",
                          config=config), *_matmul_args(*shape))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("name", list(SHIPPED_CONFIGS))
def test_shipped_config_with_row_scaled_b_lowers_for_h200(name):
    """The weight-gradient form (B scaled per 1x128 tile, [N, K/128], f32 output) at the
    wgrad shape of DeepSeek-V3's (7168, 2048) projection: N=7168 outputs, K=2048 inputs,
    4096 tokens."""
    config = SHIPPED_CONFIGS[name]
    _report(name, jnp.float32, (7168, 2048, 4096), config, b_rows=True)
    text = _lower_for_h200(
        functools.partial(blockwise_fp8_matmul, out_dtype=jnp.float32, impl="kernel",
                          config=config), *_matmul_args(7168, 2048, 4096, b_rows=True))
    assert "mosaic_gpu" in text


def test_auto_picks_the_kernel_on_an_h200():
    text = _lower_for_h200(blockwise_fp8_matmul, *_matmul_args(4096, 7168, 2048))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", list(SHIPPED_CONFIGS))
def test_one_more_stage_overflows_as_modelled(name, dtype):
    """Controls for the checks above: one stage more than fits is rejected by Mosaic GPU,
    which reports exactly the bytes ``smem_bytes`` predicts (so the stage counts are the
    most that fit, and the model is Mosaic's)."""
    config = SHIPPED_CONFIGS[name]
    bigger = TuningConfig(config.block_m, config.block_n, config.wg_split,
                          config.max_concurrent_steps + 1)
    want = smem_bytes(bigger, dtype)
    assert want > SMEM_BYTES_H200
    k = bigger.max_concurrent_steps * BLOCK_K  # as many K blocks as stages: all are used
    assert pipeline_stages(bigger, k // BLOCK_K)[0] == bigger.max_concurrent_steps
    with pytest.raises(ValueError, match=f"smem_bytes={want} > max_smem_bytes"):
        _lower_for_h200(functools.partial(blockwise_fp8_matmul, out_dtype=dtype,
                                          impl="kernel", config=bigger),
                        *_matmul_args(4096, 2048, k))


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", [quantize_1x128, quantize_128x128],
                         ids=["1x128", "128x128"])
def test_quantizers_lower_for_h200(fn, dtype, power_of_two):
    text = _lower_for_h200(functools.partial(fn, power_of_two=power_of_two, impl="kernel"),
                           jax.ShapeDtypeStruct((4096, 7168), dtype))
    assert "mosaic_gpu" in text


def _sub_jaxprs(eqn):
    for val in eqn.params.values():
        for v in val if isinstance(val, (tuple, list)) else (val,):
            sub = getattr(v, "jaxpr", v)
            sub = getattr(sub, "jaxpr", sub) if not hasattr(sub, "eqns") else sub
            if hasattr(sub, "eqns"):
                yield sub


def _wgmma_windows(jaxpr):
    """The bodies of the ``run_scoped`` regions that issue a ``wgmma`` and read its
    accumulator (the read is the ``wgmma.wait_group``): issue to wait, in program order."""
    for eqn in jaxpr.eqns:
        for sub in _sub_jaxprs(eqn):
            names = [e.primitive.name for e in sub.eqns]
            if (eqn.primitive.name == "run_scoped" and "wgmma_ref" in names
                    and "wgmma_accumulator_deref_p" in names):
                yield sub
            else:
                yield from _wgmma_windows(sub)


@pytest.mark.parametrize("b_rows", [True, False], ids=["b-rows", "b-blocks"])
@pytest.mark.parametrize("name", list(SHIPPED_CONFIGS))
def test_scale_product_is_formed_after_the_wgmma_wait(name, b_rows):
    """Spill-safe ordering, checked in the kernel as Mosaic GPU lowers it (program order of
    the traced kernel): between a wgmma's issue and its wait only the next K block's scale
    *vectors* are loaded; no (64, pass_n) f32 value (the per-element scale product, 64
    registers a thread) is formed there, where it would be live beside the in-flight
    accumulator and the running sums (256x128's weight gradient: 128 + 64 + 64 > 232)."""
    config = SHIPPED_CONFIGS[name]
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(functools.partial(
            blockwise_fp8_matmul, out_dtype=jnp.float32, impl="kernel", config=config)
        ).trace(*_matmul_args(1024, 1024, 1024, b_rows=b_rows))
    windows = list(_wgmma_windows(traced.jaxpr.jaxpr))
    # one window per pass of a K step, in each of the persistent loop's four pipelines
    assert windows and len(windows) % len(config.passes) == 0
    # The next K block's scale vectors are loaded inside the last pass's window (one step
    # early, while the wgmmas run).
    loads = [sum(e.primitive.name == "load" for e in w.eqns) for w in windows]
    # one A row-scale vector per pass; with b_rows, one B column-scale vector per column
    # offset of the passes
    b_vectors = len({pc for _, pc in config.passes}) if b_rows else 0
    assert max(loads) == len(config.passes) + b_vectors
    full = (64, config.pass_n)
    for window in windows:
        formed = [e.primitive.name for e in window.eqns
                  if e.primitive.name in ("mul", "broadcast_in_dim")
                  and any(tuple(v.aval.shape) == full for v in e.outvars)]
        assert formed == []


@pytest.mark.parametrize("b_rows", [False, True], ids=["b-blocks", "b-rows"])
def test_n_tail_pads_only_the_scales(b_rows):
    """N = 2112 (DeepSeek-V3's, 16.5 tiles of 128): B and the output are neither padded
    nor sliced (TMA zero-fills loads and clips stores past N), only the f32 scale rows
    are padded; the kernel writes the [M, 2112] output directly."""
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(functools.partial(
            blockwise_fp8_matmul, out_dtype=jnp.bfloat16, impl="kernel",
            config=SHIPPED_CONFIGS["128x128"])).trace(*_matmul_args(4096, 2112, 7168, b_rows))
    eqns = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            eqns.append(e)
            for sub in _sub_jaxprs(e):
                if e.primitive.name not in ("mpmd_map", "pallas_call"):
                    walk(sub)

    walk(traced.jaxpr.jaxpr)
    padded = [str(e.outvars[0].aval) for e in eqns if e.primitive.name == "pad"]
    assert padded and all(p.startswith("float32[") for p in padded)
    assert not [e for e in eqns if e.primitive.name in ("slice", "dynamic_slice")]
    (kernel,) = [e for e in eqns if e.primitive.name in ("mpmd_map", "pallas_call")]
    assert kernel.outvars[0].aval.shape == (4096, 2112)
