"""FP4 training matmuls: NVFP4 and MXFP4 quantization, the random Hadamard transform, and FP4
recipes for ``fmtkit.fp8.dot_general_fn``, emulated on any machine.

Formats. E2M1 (``float4_e2m1fn``): values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, no inf or NaN (OCP
MX v1.0, section 5.3.3). Casts go through ``fmtkit.cast`` (round-to-nearest-even, bit-identical
to ml_dtypes; or stochastic rounding), which saturates to ±6 as ml_dtypes does.

NVFP4 (NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149, appendix B;
Transformer Engine ``core_nvfp4.cuh``): E2M1 elements in blocks of 16 along the GEMM's
contraction (1x16; 16x16 for weights) with an E4M3 block scale and a per-tensor f32 scale, so
that ``x ≈ q * s_block * s_tensor``::

    amax_t  = max |x| over the tensor                (NaN counts as inf)
    s_enc   = 6 * 448 / amax_t                       (E2M1 max times E4M3 max: the largest
                                                      block then gets the block scale 448)
    s_enc   = 1 where amax_t == 0; min(s_enc, f32 max) (TE's guards)
    s_tensor = 1 / s_enc                             (stored, f32; NaN when amax_t is not finite)
    s_block = e4m3_rne(min(amax_b / 6 * s_enc, 448)) (amax_b: the block's amax; stored E4M3)
    enc_b   = min(1 / (f32(s_block) * s_tensor), f32 max)
    q       = round(x * enc_b) to E2M1, saturating at ±6  (RNE or stochastic)

A block whose scale rounds to 0 in E4M3 (amax_b < 2^-10 * amax_t * 6 / 448 roughly) stores
zeros: it underflows, as on the hardware. One deviation from TE, for NaN in, NaN out: TE sets
``s_enc = 1`` when ``amax_t`` is inf (``s_enc == 0``), which would quantize a tensor holding an
inf to finite values; here its ``s_tensor`` is NaN, so it dequantizes (and multiplies) to NaN.

MXFP4 (OCP MX v1.0 section 6.3, as ``fmtkit.MXScaling``): E2M1 elements in blocks of 32 with an
E8M0 power-of-two scale. Scale rules "floor" (the spec: ``2^(floor(log2 amax) - 2)``, 2 being
E2M1's largest exponent; values in (6, 8) saturate) and "rceil" (``2^ceil(log2(amax / 6))``,
the rounding up of the NVFP4 paper's MXFP4 runs, section 2, and of cuBLAS/TE: nothing
saturates), "ceil" and "even" (torchao).

Random Hadamard transform (arXiv 2509.25149 section 4.2, appendix C; TE ``hadamard.py``): the
16x16 Sylvester Hadamard matrix H times a random sign diagonal S, ``R = S H / 4`` (orthogonal),
applied to each 16-wide tile of the contraction dimension of both weight-gradient operands:
``(a R)(b R)ᵀ = a bᵀ`` in exact arithmetic, while outliers are spread over 16 elements before
FP4 quantization. One sign vector for every layer and the whole run (the paper's choice), drawn
from ``Fp4Recipe.rht_seed``: reproducible, and checkpointed with the recipe (a config field).

Recipe per GEMM (Y = X Wᵀ; arXiv 2509.25149 section 4, TE ``NVFP4BlockScaling``)::

    forward  y  = x · wᵀ    x 1x16 RNE, w 16x16 RNE
    dgrad    dx = dy · w    dy 1x16 SR, w the same 16x16 blocks (its transpose: forward and
                            backward see the same quantized weight)
    wgrad    dw = dyᵀ · x   both along the tokens, RHT-16 on both, dy 1x16 SR, x 1x16 RNE

Every ingredient is a field of ``Fp4Recipe``; the named variants are in ``RECIPES``.

Stochastic rounding keys. A GEMM has no step counter, so the key of each SR quantization is
derived from ``Fp4Recipe.sr_seed``, the operand's role, and a 32-bit hash of the operand's
bits: reproducible (same seed, same data: same rounding), different at every step and in every
layer (different gradients), and nothing to thread or checkpoint beyond the seed.

Emulation. XLA's CPU and pre-Blackwell GPU backends cannot take E2M1 operands into a dot, so the
emulated GEMM widens each FP4 array exactly to E4M3 (every E2M1 value is an E4M3 value) inside
the GEMM and runs ``fmtkit.fp8.scaled_matmul``: one FP8 dot per 16 (or 32) elements of the
contraction with f32 accumulation, block scales applied per block, the two tensor scales
applied to the f32 output (the Blackwell GEMM's ``alpha``). On a Blackwell GPU, NVFP4 GEMMs run
through ``jax.nn.scaled_matmul`` (cuDNN's block-scaled dot) instead.

This module and ``fmtkit.fp8`` are the two public faces of one private low-precision package,
``fmtkit._lowp``, whose recipes, operands, GEMM and autodiff the FP8 and FP4 cores share
(``fmtkit/_lowp/fp4_quant.py``, ``hadamard.py``, ``fp4_core.py``; the recipes in
``recipes.py``).

Deprecated spellings: the statistics of ``quantization_stats`` carry the names of
``fmtkit.stats`` (``BLOCK_STATS``); its earlier keys ``saturated_blocks``,
``underflow_blocks`` and ``zero_fraction`` still read ``saturation_block_share``,
``underflow_block_share`` and ``underflow_share``, and warn once with a
``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import jax

from fmtkit._lowp.dot import dot_general_fn as _dot_general_fn
from fmtkit._lowp.fp4_core import GEMM_SCOPE as GEMM_SCOPE
from fmtkit._lowp.fp4_core import quantization_stats as _block_stats_of
from fmtkit._lowp.fp4_quant import E2M1 as E2M1
from fmtkit._lowp.fp4_quant import E4M3 as E4M3
from fmtkit._lowp.fp4_quant import Fp4Array, dequantize, mxfp4_quantize, nvfp4_quantize
from fmtkit._lowp.hadamard import hadamard_matrix, random_hadamard_transform, rht_matrix
from fmtkit._lowp.recipes import FP4_RECIPES as RECIPES
from fmtkit._lowp.recipes import Fp4Recipe, get_recipe

__all__ = [
    "RECIPES",
    "Fp4Array",
    "Fp4Recipe",
    "dequantize",
    "dot_general_fn",
    "get_recipe",
    "hadamard_matrix",
    "mxfp4_quantize",
    "nvfp4_quantize",
    "quantization_stats",
    "random_hadamard_transform",
    "rht_matrix",
]


def dot_general_fn(recipe: str | Fp4Recipe = "nvfp4", *, name: str | None = None):
    """``fmtkit.fp8.dot_general_fn`` with an FP4 recipe as its default (a name from
    ``RECIPES`` or an ``Fp4Recipe``; FP8 names work too): a function with
    ``lax.dot_general``'s signature whose forward, dgrad and wgrad GEMMs take FP4 operands.

    Example:
      >>> dg = dot_general_fn("nvfp4")
      >>> dg(jnp.ones((32, 48)), jnp.ones((48, 16)), (((1,), (0,)), ((), ()))).shape
      (32, 16)
    """
    return _dot_general_fn(get_recipe(recipe), name=name)


# Earlier keys of quantization_stats: the fmtkit.stats name each one reads.
_RENAMED = {"saturated_blocks": "saturation_block_share",
            "underflow_blocks": "underflow_block_share", "zero_fraction": "underflow_share"}
_WARNED: set[str] = set()


class _QuantizationStats(dict):
    """The statistics of ``quantization_stats`` (a dict, a pytree node that keeps its type
    through ``jit``): the earlier keys read their renamed statistic, warning once."""

    def __getitem__(self, key: Any) -> Any:
        if key in _RENAMED:
            if key not in _WARNED:
                _WARNED.add(key)
                warnings.warn(f"quantization_stats(...)[{key!r}] is deprecated: use "
                              f"[{_RENAMED[key]!r}] (the same value, named as in "
                              "fmtkit.stats).", DeprecationWarning, stacklevel=2)
            key = _RENAMED[key]
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self or key in _RENAMED else default


jax.tree_util.register_pytree_with_keys(
    _QuantizationStats,
    lambda d: ([(jax.tree_util.DictKey(k), v) for k, v in dict.items(d)], tuple(d)),
    lambda keys, values: _QuantizationStats(zip(keys, values, strict=True)),
    lambda d: (list(dict.values(d)), tuple(d)))


def quantization_stats(t: jax.typing.ArrayLike, recipe: str | Fp4Recipe = "nvfp4",
                       operand: Literal["x", "w", "grad"] = "x") -> dict[str, jax.Array]:
    """What one GEMM operand loses to a recipe's FP4 quantization (telemetry, in-jit).

    ``t`` is laid out ``[free, contraction]`` (x: [tokens, K]; w: [N, K], a Flax kernel
    transposed; grad: [tokens, N]), zero-padded to its blocks, and quantized as the forward
    (x, w) or dgrad (grad) GEMM does (stochastic rounding with a fixed key).

    Returns:
      ``fmtkit.stats.BLOCK_STATS`` (f32 scalars, defined in ``fmtkit.stats``): ``sqnr_db``,
      ``saturation_block_share`` (blocks with an element beyond ±6 after scaling, clipped:
      an E4M3 block scale rounded down, or MX's "floor" rule), ``underflow_block_share``
      (nonzero blocks that dequantize to all zeros: an E4M3 scale of 0, or every element
      under half of E2M1's smallest step), ``underflow_share`` (nonzero elements quantized
      to 0). The earlier keys ``saturated_blocks``, ``underflow_blocks`` and
      ``zero_fraction`` still read them, with a ``DeprecationWarning``.

    Example:
      >>> s = quantization_stats(jnp.ones((16, 32)), "nvfp4", "w")
      >>> float(s["sqnr_db"]), float(s["underflow_share"])   # 1 is exact in E2M1
      (inf, 0.0)
    """
    return _QuantizationStats(_block_stats_of(t, recipe, operand))
