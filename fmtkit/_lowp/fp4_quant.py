"""FP4 quantization: ``Fp4Array``, NVFP4 (E2M1 values, E4M3 block scales, an f32 tensor
scale) and MXFP4 (E2M1 values, E8M0 block scales); the formulas are in ``fmtkit.fp4``'s
module docstring, the public path of these names."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fmtkit.casting import cast, check_floating
from fmtkit.formats import get_format
from fmtkit.scaling import MXScaling
from fmtkit.scaling import quantize as scaled_quantize

E2M1 = get_format("float4_e2m1fn")
E4M3 = get_format("float8_e4m3fn")
E2M1_MAX = 6.0  # OCP MX v1.0 table 5: largest E2M1 value
_E4M3_MAX = 448.0  # OCP FP8 (OFP8) E4M3: largest finite value
_F32_MAX = float(np.finfo(np.float32).max)
ROUNDINGS = ("nearest", "stochastic")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp4Array:
    """E2M1 values with their block scales and tensor scale: ``x ≈ values * block_scale *
    tensor_scale`` (the block scale broadcast over its ``block`` of trailing dims).

    Attributes:
      values: ``float4_e2m1fn`` array, the shape of x.
      block_scale: E4M3 (NVFP4) or E8M0 (MXFP4) array of x's rank,
        ``shape[i] = x.shape[i] // block[i]``.
      tensor_scale: f32 scalar (NVFP4's second-level decode scale; 1 for MXFP4).
      block: the block shape (static).

    Example:
      >>> q = nvfp4_quantize(jnp.linspace(-1.0, 1.0, 32).reshape(2, 16))
      >>> q.values.dtype, q.values.shape
      (dtype(float4_e2m1fn), (2, 16))
    """

    values: jax.Array
    block_scale: jax.Array
    tensor_scale: jax.Array
    block: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def dequantize(self, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
        """``(values * f32(block_scale)) * tensor_scale`` in f32, cast to ``dtype``."""
        v = blocks(self.values.astype(jnp.float32), self.block)
        s = scale_view(self.block_scale.astype(jnp.float32), self.block)
        return ((v * s).reshape(self.values.shape) * self.tensor_scale).astype(dtype)


def dequantize(q: Fp4Array, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
    """``q.dequantize(dtype)``.

    Example:
      >>> x = jnp.linspace(-1.0, 1.0, 32).reshape(2, 16)
      >>> bool(jnp.max(jnp.abs(dequantize(nvfp4_quantize(x)) - x)) < 0.15)   # E2M1: 1 mantissa bit
      True
    """
    if not isinstance(q, Fp4Array):
        raise TypeError(f"dequantize expects an Fp4Array, got {type(q).__name__}.")
    return q.dequantize(dtype)


# ---------------------------------------------------------------------------------------------
# Blocks of the trailing dims: x [..., A, B] with block (ba, bb) -> [..., A/ba, ba, B/bb, bb].


def _check_block(x: jax.Array, block: tuple[int, ...], arg: str = "block") -> tuple[int, ...]:
    block = (block,) if isinstance(block, int) else tuple(block)
    if not block or len(block) > 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"{arg} must be one or two positive ints (e.g. (1, 16), (16, 16)), "
                         f"got {block!r}.")
    if x.ndim < len(block):
        raise ValueError(f"{arg}={block} has more dims than x (shape {x.shape}).")
    for i, b in enumerate(block):
        n = x.shape[x.ndim - len(block) + i]
        if n % b:
            raise ValueError(f"x.shape[{x.ndim - len(block) + i}]={n} is not divisible by "
                             f"{arg}={block}.")
    return (1,) * (x.ndim - len(block)) + block


def blocks(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """``x`` reshaped to [..., A/ba, ba, B/bb, bb] for its block (ba, bb) of every dim."""
    split = []
    for n, b in zip(x.shape, block):
        split += [n // b, b]
    return x.reshape(split)


def scale_view(s: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """Per-block scales [A/ba, B/bb] shaped to broadcast against ``blocks(x, block)``."""
    return s.reshape([d for n in s.shape for d in (n, 1)])


def _block_amax(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
    a = jnp.abs(x.astype(jnp.float32))
    a = jnp.where(jnp.isnan(a), jnp.float32(jnp.inf), a)  # XLA CPU's max drops NaN
    return jnp.max(blocks(a, block), axis=tuple(range(1, 2 * x.ndim, 2)))


def tensor_amax(x: jax.Array) -> jax.Array:
    """max |x| in f32, NaN counted as inf."""
    a = jnp.abs(x.astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isnan(a), jnp.float32(jnp.inf), a))


def _round(v: jax.Array, rounding: str, key: jax.Array | None) -> jax.Array:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}.")
    return cast(v, E2M1, rounding=rounding, key=key)


def nvfp4_quantize(x: jax.typing.ArrayLike, block: tuple[int, ...] = (1, 16), *,
                   rounding: Literal["nearest", "stochastic"] = "nearest",
                   key: jax.Array | None = None,
                   amax: jax.typing.ArrayLike | None = None) -> Fp4Array:
    """Quantizes ``x`` to NVFP4: E2M1 values, E4M3 block scales, an f32 tensor scale.

    The scale computation is the module docstring's (arXiv 2509.25149 appendix B, Transformer
    Engine's CUDA quantizer).

    Args:
      x: floating array; ``block`` tiles its trailing dims.
      block: (1, 16) for activations and gradients, (16, 16) for weights (the paper's 2D
        blocks, so that the transpose has the same blocks and scales).
      rounding: "nearest" (RNE) or "stochastic" (needs ``key``), applied after scaling.
      key: PRNG key for stochastic rounding.
      amax: the tensor amax to use instead of ``max |x|`` (e.g. reduced over a mesh).

    Returns:
      An ``Fp4Array``.

    Raises:
      TypeError: x not floating. ValueError: a block that does not tile x, bad rounding.

    Example:
      >>> q = nvfp4_quantize(jnp.array([[6.0 * 448, 1.0] + [0.0] * 14]))
      >>> q.tensor_scale.item(), q.block_scale.astype(jnp.float32).tolist()
      (1.0, [[448.0]])
    """
    x = check_floating(x)
    block = _check_block(x, block)
    t_amax = tensor_amax(x) if amax is None else jnp.asarray(amax, jnp.float32)
    s_enc = jnp.float32(E2M1_MAX * _E4M3_MAX) / t_amax
    s_enc = jnp.where((t_amax == 0) | (s_enc == 0), jnp.float32(1.0),
                      jnp.minimum(s_enc, jnp.float32(_F32_MAX)))
    s_tensor = jnp.where(jnp.isfinite(t_amax), jnp.float32(1.0) / s_enc, jnp.float32(jnp.nan))
    b_amax = _block_amax(x, block)
    s_block = jnp.minimum(b_amax * jnp.float32(1.0 / E2M1_MAX) * s_enc, jnp.float32(_E4M3_MAX))
    s_block = s_block.astype(jnp.float8_e4m3fn)
    enc = jnp.minimum(jnp.float32(1.0) / (s_block.astype(jnp.float32) * s_tensor),
                      jnp.float32(_F32_MAX))
    v = blocks(x.astype(jnp.float32), block) * scale_view(enc, block)
    q = _round(v.reshape(x.shape), rounding, key)
    return Fp4Array(q, s_block, s_tensor, block)


def mxfp4_quantize(x: jax.typing.ArrayLike, block: int = 32, *,
                   scale_rounding: Literal["floor", "ceil", "even", "rceil"] = "rceil",
                   rounding: Literal["nearest", "stochastic"] = "nearest",
                   key: jax.Array | None = None) -> Fp4Array:
    """Quantizes ``x`` to MXFP4: E2M1 values in ``block`` elements along the last axis with an
    E8M0 scale (``fmtkit.MXScaling``'s rules; "floor" is OCP MX v1.0's, "rceil" the default:
    the scale is rounded up, so no element saturates, as in the NVFP4 paper's MXFP4 runs).

    Args:
      x: floating array whose last dim ``block`` divides.
      block: elements per scale (32 in the spec).
      scale_rounding: the E8M0 scale rule.
      rounding: the element rounding, "nearest" or "stochastic" (which needs ``key``).
      key: the PRNG key of stochastic rounding.

    Returns:
      An ``Fp4Array`` (``tensor_scale`` 1).

    Example:
      >>> q = mxfp4_quantize(jnp.full((1, 32), 7.0), scale_rounding="floor")
      >>> q.values.astype(jnp.float32)[0, 0].item(), q.block_scale.astype(jnp.float32).item()
      (6.0, 1.0)
    """
    x = check_floating(x)
    blk = _check_block(x, (1, block) if x.ndim > 1 else (block,))
    # The E8M0 scale is fmtkit.MXScaling's; the reciprocal is formed from its exponent bits
    # (2^-127 is an f32 subnormal, which XLA CPU flushes).
    sa = scaled_quantize(x, E2M1, MXScaling(block, scale_rounding, axis=-1))
    code = lax.bitcast_convert_type(sa.scale, jnp.uint8).astype(jnp.int32)
    inv = jnp.where(code == 0xFF, jnp.float32(jnp.nan),
                    jnp.ldexp(jnp.float32(1.0), 127 - code))
    v = blocks(x.astype(jnp.float32), blk) * scale_view(inv, blk)
    q = _round(v.reshape(x.shape), rounding, key)
    return Fp4Array(q, sa.scale, jnp.float32(1.0), blk)

