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
from pallas_kernels.config import (
    SHIPPED_CONFIGS,
    SMEM_BYTES_H200,
    TuningConfig,
    fit_to_smem,
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


# The issue's production shapes: square and DeepSeek-V3's (M = 4096 tokens).
SHAPES = [(4096, 7168, 7168), (4096, 2112, 7168)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("key", list(SHIPPED_CONFIGS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_shipped_config_lowers_for_h200(key, shape):
    config = SHIPPED_CONFIGS[key]
    assert fit_to_smem(config, key[1]) == config  # shipped stage counts fit as they are
    text = _lower_for_h200(
        functools.partial(blockwise_fp8_matmul, out_dtype=jnp.dtype(key[1]), impl="kernel",
                          config=config), *_matmul_args(*shape))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("key", list(SHIPPED_CONFIGS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_shipped_config_with_row_scaled_b_lowers_for_h200(key):
    """The weight-gradient form (B scaled per 1x128 tile, [N, K/128]) with the stages that
    ``choose_config`` keeps for it; at the wgrad shape of DeepSeek-V3's (7168, 2048)
    projection: N=7168 outputs, K=2048 inputs, 4096 tokens."""
    config = fit_to_smem(SHIPPED_CONFIGS[key], key[1], b_rows=True)
    text = _lower_for_h200(
        functools.partial(blockwise_fp8_matmul, out_dtype=jnp.dtype(key[1]), impl="kernel",
                          config=config), *_matmul_args(7168, 2048, 4096, b_rows=True))
    assert "mosaic_gpu" in text


def test_auto_picks_the_kernel_on_an_h200():
    text = _lower_for_h200(blockwise_fp8_matmul, *_matmul_args(4096, 7168, 2048))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("b_rows", [False, True], ids=["b-blocks", "b-rows"])
@pytest.mark.parametrize("key", list(SHIPPED_CONFIGS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_one_more_stage_overflows_as_modelled(key, b_rows):
    """Controls for the checks above: one stage more than fits is rejected by Mosaic GPU,
    which reports exactly the bytes ``smem_bytes`` predicts (so the stage counts are the
    most that fit, and the model behind ``fit_to_smem`` is Mosaic's)."""
    config = fit_to_smem(SHIPPED_CONFIGS[key], key[1], b_rows=b_rows)
    bigger = TuningConfig(config.block_m, config.block_n, config.wg_split,
                          config.max_concurrent_steps + 1)
    want = smem_bytes(bigger, key[1], b_rows)
    assert want > SMEM_BYTES_H200
    with pytest.raises(ValueError, match=f"smem_bytes={want} > max_smem_bytes"):
        _lower_for_h200(functools.partial(blockwise_fp8_matmul, out_dtype=jnp.dtype(key[1]),
                                          impl="kernel", config=bigger),
                        *_matmul_args(4096, 2048, 4096, b_rows=b_rows))  # K blocks > stages


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", [quantize_1x128, quantize_128x128],
                         ids=["1x128", "128x128"])
def test_quantizers_lower_for_h200(fn, dtype, power_of_two):
    text = _lower_for_h200(functools.partial(fn, power_of_two=power_of_two, impl="kernel"),
                           jax.ShapeDtypeStruct((4096, 7168), dtype))
    assert "mosaic_gpu" in text
