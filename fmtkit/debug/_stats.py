"""The statistics of one tensor, computed in f32 inside the compiled step.

``tensor_stats`` gives ``BASE_STATS`` of any tensor; ``quant_stats`` the ``QUANT_STATS`` of
an operand against its quantization by a scaling recipe (``Quantization``: the format and the
``fmtkit.scaling`` recipe of the GEMM that quantizes it, laid out ``[free, contraction]``).
The definitions are in ``fmtkit.debug``'s module docstring.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fmtkit.casting import cast
from fmtkit.formats import get_format
from fmtkit.scaling import BlockScaling, MXScaling, dequantize, quantize

# The tile of max_blockwise_dynamic_range: 1x128, the activation tile of DeepSeek-V3's
# blockwise FP8 recipe (section 3.3.1) and of Transformer Engine's blockwise recipe.
TILE = 128


def _dynamic_range(a: jax.Array, axis: Any = None) -> jax.Array:
    """log2(max |x| / min nonzero |x|) of ``a = |x|`` (f32) over ``axis``; 0 without a
    nonzero element."""
    amax = jnp.max(a, axis=axis)
    nz = jnp.min(jnp.where(a > 0, a, jnp.inf), axis=axis)
    has = jnp.isfinite(nz)
    return jnp.where(has, jnp.log2(amax / jnp.where(has, nz, 1.0)), 0.0)


def tensor_stats(x: jax.Array, stats: Sequence[str]) -> dict[str, jax.Array]:
    """``BASE_STATS`` of ``x`` named in ``stats`` (f32 scalars)."""
    x = jnp.asarray(x).astype(jnp.float32)
    a = jnp.abs(x)
    out: dict[str, jax.Array] = {}
    mean = jnp.mean(x)
    fns = {
        "min": lambda: jnp.min(x),
        "max": lambda: jnp.max(x),
        "mean": lambda: mean,
        "std": lambda: jnp.sqrt(jnp.mean(jnp.square(x - mean))),
        "l1_norm": lambda: jnp.sum(a),
        "l2_norm": lambda: jnp.sqrt(jnp.sum(jnp.square(x))),
        "amax": lambda: jnp.max(a),
        "dynamic_range": lambda: _dynamic_range(a),
        "max_blockwise_dynamic_range": lambda: _blockwise_dr(a),
    }
    for s in stats:
        if s in fns:
            out[s] = fns[s]().astype(jnp.float32)
    return out


def _blockwise_dr(a: jax.Array) -> jax.Array:
    """The largest dynamic range of a 1xTILE tile along the last axis (zero-padded)."""
    rows = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
    pad = -rows.shape[1] % TILE
    rows = jnp.pad(rows, ((0, 0), (0, pad)))
    tiles = rows.reshape(rows.shape[0], -1, TILE)
    return jnp.max(_dynamic_range(tiles, axis=-1))


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How a GEMM quantizes an operand laid out ``[*batch, free, contraction]``: element
    format and ``fmtkit.scaling`` recipe (None: a plain saturating cast, scale 1), one
    quantization per batch element."""

    fmt: str
    recipe: Any


def _block(recipe: Any) -> tuple[int, int]:
    if isinstance(recipe, BlockScaling):
        return tuple(recipe.block)  # type: ignore[return-value]
    if isinstance(recipe, MXScaling):
        return (1, recipe.block)
    return (1, 1)


def quantized(x3: jax.Array, q: Quantization) -> tuple[jax.Array, jax.Array]:
    """(dequantized f32 ``[B, F, C]``, scales f32) of ``x3 [B, F, C]`` under ``q``; each
    dimension a block does not divide is zero-padded for the quantization, as the GEMMs do,
    and sliced back."""
    fmt = get_format(q.fmt)
    _, f, c = x3.shape
    if q.recipe is None:
        deq = cast(jnp.clip(x3.astype(jnp.float32), -fmt.max, fmt.max), fmt).astype(
            jnp.float32)
        return deq, jnp.ones((1,), jnp.float32)
    bf, bc = _block(q.recipe)
    padded = jnp.pad(x3, ((0, 0), (0, -f % bf), (0, -c % bc)))

    def one(t):
        sa = quantize(t, fmt, q.recipe)
        return dequantize(sa, jnp.float32), sa.scale.astype(jnp.float32)

    deq, scale = jax.vmap(one)(padded)
    return deq[:, :f, :c], scale


def quant_stats(x3: jax.Array, q: Quantization, stats: Sequence[str]) -> dict[str, jax.Array]:
    """``QUANT_STATS`` named in ``stats`` of the operand ``x3 [B, F, C]`` quantized by ``q``.

    With x the operand (f32), d its quantize-dequantize, s the scales: underflow_share =
    #(x != 0 and d == 0) / #(x != 0); saturation_share = #(|x| / s > clip_threshold(fmt)) /
    size (clipped at the format's largest value); nonfinite_count = #(not finite x);
    scale_min / scale_max over s; sqnr_db = 10 log10(sum x^2 / sum (x - d)^2); mse =
    mean((x - d)^2)."""
    want = [s for s in stats if s in ("underflow_share", "saturation_share",
                                       "nonfinite_count", "scale_min", "scale_max",
                                       "sqnr_db", "mse")]
    if not want:
        return {}
    x = x3.astype(jnp.float32)
    deq, scale = quantized(x3, q)
    fmt = get_format(q.fmt)
    err = jnp.square(x - deq)
    nz = x != 0
    n_nz = jnp.sum(nz)
    out = {
        "underflow_share": lambda: jnp.where(
            n_nz > 0, jnp.sum(nz & (deq == 0)) / jnp.maximum(n_nz, 1), 0.0),
        "saturation_share": lambda: jnp.mean(
            jnp.abs(x) / _element_scale(scale, x3.shape, q) > clip_threshold(fmt)),
        "nonfinite_count": lambda: jnp.sum(~jnp.isfinite(x)),
        "scale_min": lambda: jnp.min(scale),
        "scale_max": lambda: jnp.max(scale),
        "sqnr_db": lambda: _sqnr(jnp.sum(jnp.square(x)), jnp.sum(err)),
        "mse": lambda: jnp.mean(err),
    }
    return {s: out[s]().astype(jnp.float32) for s in want}


def clip_threshold(fmt) -> float:
    """The magnitude above which a scaled value is clipped: the format's largest value plus
    half its last step (values up to there round to the largest value anyway; 464 for
    E4M3, 61440 for E5M2)."""
    return float(fmt.max + 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits - 1))


def _element_scale(scale: jax.Array, shape: tuple[int, int, int], q: Quantization
                   ) -> jax.Array:
    """The scales ``[B, sf, sc]`` of ``quantized`` broadcast to each element of the operand
    ``[B, F, C]`` (``shape``)."""
    b, f, c = shape
    if q.recipe is None:
        return jnp.ones(shape, jnp.float32)
    bf, bc = _block(q.recipe)
    s = scale.reshape(b, scale.shape[-2], scale.shape[-1])
    s = jnp.repeat(s, (f + -f % bf) // s.shape[1], axis=1)
    s = jnp.repeat(s, (c + -c % bc) // s.shape[2], axis=2)
    return s[:, :f, :c]


def _sqnr(signal: jax.Array, noise: jax.Array) -> jax.Array:
    return jnp.where(noise > 0, 10.0 * jnp.log10(signal / jnp.where(noise > 0, noise, 1.0)),
                     jnp.inf)
