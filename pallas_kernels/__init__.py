"""Pallas GPU kernels for fmtkit, each with a pure-JAX reference that defines its semantics.

Blockwise FP8 training GEMMs (DeepSeek-V3's recipe) for Hopper, written for Mosaic GPU:

* ``blockwise_fp8_matmul`` / ``blockwise_fp8_matmul_reference``: FP8 e4m3 ``A · Bᵀ`` with
  1x128 scales on A, 128x128 on B, f32 promotion every 128 of K;
* ``blockwise_fp8_dgrad`` / ``blockwise_fp8_wgrad``: the two gradient GEMMs with the same
  kernel;
* ``grouped_fp8_matmul`` / ``grouped_fp8_dgrad`` / ``grouped_fp8_wgrad`` (and the
  ``*_reference`` and ``grouped_fp8_wgrad_matmul`` forms): the grouped GEMMs of an MoE
  layer's experts (``pallas_kernels.grouped_fp8_matmul``), with the same K loop, and
  ``grouped_fp8_matmul_masked`` for a fixed capacity per expert;
* ``quantize_1x128`` / ``quantize_128x128`` (and ``*_reference``): fused quantizers,
  bit-identical to ``fmtkit.quantize`` with ``BlockScaling((1, 128))`` / ``((128, 128))``.

Every function takes ``impl``: "auto" (kernel on a Hopper GPU, reference elsewhere),
"kernel", "interpret" (GPU-interpret mode on CPU) or "reference"; ``is_hopper()`` says
whether "auto" picks the kernel here, ``num_sms(impl)`` how many programs the persistent
kernels launch (the GPU's SM count). Tile configs live in ``pallas_kernels.config``.

Importing the package registers the blockwise kernel as a GEMM backend of ``fmtkit.fp8``
(``fmtkit.fp8.register_gemm_backend``), with the grouped kernels as its ``ragged`` and
``ragged_wgrad`` forms (``fmtkit.fp8.ragged_dot``), so FP8 recipes with
``use_kernel="auto"`` run them on a Hopper GPU and ``use_kernel="interpret"`` in
interpret mode. ``fmtkit`` never imports this
package by name; it also loads it through the ``fmtkit.gemm_backends`` entry point.
"""

import jax.numpy as jnp

from pallas_kernels import config
from pallas_kernels._backend import is_hopper, num_sms
from pallas_kernels.blockwise_fp8_matmul import (
    blockwise_fp8_dgrad,
    blockwise_fp8_matmul,
    blockwise_fp8_matmul_reference,
    blockwise_fp8_wgrad,
)
from pallas_kernels.config import TuningConfig
from pallas_kernels.grouped_fp8_matmul import (
    grouped_fp8_dgrad,
    grouped_fp8_matmul,
    grouped_fp8_matmul_masked,
    grouped_fp8_matmul_masked_reference,
    grouped_fp8_matmul_reference,
    grouped_fp8_wgrad,
    grouped_fp8_wgrad_matmul,
    grouped_fp8_wgrad_matmul_reference,
)
from pallas_kernels.quantize import (
    quantize_1x128,
    quantize_1x128_reference,
    quantize_128x128,
    quantize_128x128_reference,
)


def _fits_kernel(a, b) -> bool:
    """The kernel's operands: E4M3 ``a`` in 1x128 tiles, ``b`` in 128x128 blocks or 1x128
    tiles (all three GEMMs of fmtkit's "blockwise" recipe)."""
    return (a.block == (1, 128) and b.block in ((128, 128), (1, 128))
            and a.fmt.name == "float8_e4m3fn" and b.fmt.name == "float8_e4m3fn")


def _gemm(a_values, a_scale, b_values, b_scale, *, impl, out_dtype=jnp.float32):
    """``fmtkit.fp8``'s GEMM backend contract: the kernel writes ``out_dtype`` itself (bf16
    for the forward and data gradient of a bf16 model: half the output bytes, no XLA
    convert after it; f32 for the weight gradient)."""
    return blockwise_fp8_matmul(a_values, a_scale, b_values, b_scale, out_dtype=out_dtype,
                                impl=impl)


def _ragged(a_values, a_scale, b_values, b_scale, group_sizes, *, impl,
            out_dtype=jnp.float32):
    """The ``ragged`` form (``fmtkit.fp8.ragged_dot``'s forward and data gradient): the
    grouped kernel on ``b [G, F, C]`` with 128x128 block scales."""
    return grouped_fp8_matmul(a_values, a_scale, b_values, b_scale, group_sizes,
                              out_dtype=out_dtype, impl=impl)


def _ragged_wgrad(a_values, a_scale, b_values, b_scale, group_blocks, *, impl,
                  out_dtype=jnp.float32):
    """The ``ragged_wgrad`` form: per group, the contraction over its 128-token blocks."""
    return grouped_fp8_wgrad_matmul(a_values, a_scale, b_values, b_scale, group_blocks,
                                    out_dtype=out_dtype, impl=impl)


def _register() -> None:
    from fmtkit import fp8
    from pallas_kernels import _backend

    fp8.register_gemm_backend("pallas_blockwise_fp8", _gemm, applies=_fits_kernel,
                              available=_backend.is_hopper, ragged=_ragged,
                              ragged_wgrad=_ragged_wgrad)


_register()

__all__ = [
    "TuningConfig",
    "blockwise_fp8_dgrad",
    "blockwise_fp8_matmul",
    "blockwise_fp8_matmul_reference",
    "blockwise_fp8_wgrad",
    "config",
    "grouped_fp8_dgrad",
    "grouped_fp8_matmul",
    "grouped_fp8_matmul_masked",
    "grouped_fp8_matmul_masked_reference",
    "grouped_fp8_matmul_reference",
    "grouped_fp8_wgrad",
    "grouped_fp8_wgrad_matmul",
    "grouped_fp8_wgrad_matmul_reference",
    "is_hopper",
    "num_sms",
    "quantize_1x128",
    "quantize_1x128_reference",
    "quantize_128x128",
    "quantize_128x128_reference",
]
