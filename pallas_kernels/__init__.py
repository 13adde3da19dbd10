"""Pallas GPU kernels for fmtkit, each with a pure-JAX reference that defines its semantics.

Blockwise FP8 training GEMMs (DeepSeek-V3's recipe) for Hopper, written for Mosaic GPU:

* ``blockwise_fp8_matmul`` / ``blockwise_fp8_matmul_reference``: FP8 e4m3 ``A · Bᵀ`` with
  1x128 scales on A, 128x128 on B, f32 promotion every 128 of K;
* ``blockwise_fp8_dgrad`` / ``blockwise_fp8_wgrad``: the two gradient GEMMs with the same
  kernel;
* ``quantize_1x128`` / ``quantize_128x128`` (and ``*_reference``): fused quantizers,
  bit-identical to ``fmtkit.quantize`` with ``BlockScaling((1, 128))`` / ``((128, 128))``.

Every function takes ``impl``: "auto" (kernel on a Hopper GPU, reference elsewhere),
"kernel", "interpret" (GPU-interpret mode on CPU) or "reference"; ``is_hopper()`` says
whether "auto" picks the kernel here. Tile configs live in ``pallas_kernels.config``.
"""

from pallas_kernels import config
from pallas_kernels._backend import is_hopper
from pallas_kernels.blockwise_fp8_matmul import (
    blockwise_fp8_dgrad,
    blockwise_fp8_matmul,
    blockwise_fp8_matmul_reference,
    blockwise_fp8_wgrad,
)
from pallas_kernels.config import TuningConfig
from pallas_kernels.quantize import (
    quantize_1x128,
    quantize_1x128_reference,
    quantize_128x128,
    quantize_128x128_reference,
)

__all__ = [
    "TuningConfig",
    "blockwise_fp8_dgrad",
    "blockwise_fp8_matmul",
    "blockwise_fp8_matmul_reference",
    "blockwise_fp8_wgrad",
    "config",
    "is_hopper",
    "quantize_1x128",
    "quantize_1x128_reference",
    "quantize_128x128",
    "quantize_128x128_reference",
]
