"""Numerics statistics of a tensor and of its cast or quantization: every statistic fmtkit
reports, computed in f32 inside the compiled step, each named once.

``fmtkit.debug`` (per-GEMM statistics), ``fmtkit.telemetry`` (a cast or a quantization) and
``fmtkit.fp4.quantization_stats`` (an FP4 GEMM operand) report these names. A ``_share`` is a
fraction in [0, 1] (0 when its denominator is empty), a ``_count`` a number of elements.
With x the input, d its reconstruction (cast, or quantize-dequantize), s each element's
scale, all in f32, and "finite" excluding inf and NaN:

Of any tensor (``BASE_STATS``; ``tensor_stats``):

* ``min``, ``max``, ``mean``, ``std`` (population), ``l1_norm`` = sum |x|, ``l2_norm`` =
  sqrt(sum x^2), ``amax`` = max |x|;
* ``dynamic_range`` = log2(amax / smallest nonzero |x|) (0 without a nonzero element);
* ``max_blockwise_dynamic_range``: the largest dynamic range of a 1x128 tile (``TILE``)
  along the tensor's last axis (zero-padded; a tile without a nonzero element counts 0).

Of a quantization by a scaling recipe (``QUANT_STATS``; ``quant_stats``):

* ``underflow_share`` = #(x != 0 and d == 0) / #(x != 0): the values flushed to zero;
* ``saturation_share`` = #(|x| / s > ``clip_threshold(fmt)``) / size: the values clipped
  at the format's largest value;
* ``nonfinite_count`` = #(x not finite);
* ``scale_min``, ``scale_max``: the scale range, over the scales;
* ``sqnr_db`` = 10 log10(sum x^2 / sum (x - d)^2) (inf when d == x);
* ``mse`` = mean((x - d)^2).

Of a reconstruction (``RECONSTRUCTION_STATS``; ``reconstruction_stats``, what
``fmtkit.telemetry`` reports), over the finite inputs:

* ``underflow_share`` as above, over the finite nonzero x;
* ``overflow_share`` = #(x finite and (beyond the format's range or d not finite)) /
  #(x finite), the range being ±fmt.max in the cast domain (|x / s| for a quantization);
* ``nonfinite_share`` = #(d not finite) / size;
* ``amax`` over the finite x; ``sqnr_db`` as above and ``rel_error`` = ||x - d||_2 /
  ||x||_2, both over the entries whose x and d are finite (an overflow to inf or NaN is
  reported by ``overflow_share`` and ``nonfinite_share`` instead of swamping them).

Of a block-scaled quantization (``BLOCK_STATS``; ``block_stats``, what
``fmtkit.fp4.quantization_stats`` reports), with x zero-padded to whole blocks:

* ``sqnr_db`` and ``underflow_share`` as above (of the elements);
* ``saturation_block_share`` = #(blocks with an |x| > limit * s) / #blocks (limit: the
  element format's largest value);
* ``underflow_block_share`` = #(blocks with a nonzero x whose d is all zero) / #(blocks with
  a nonzero x).

Cost: each function reads its tensor in as few passes as the definitions allow, every
requested reduction of a pass being one operand of a single variadic ``lax.reduce`` (XLA
emits one loop for it, where separate ``jnp.sum``/``jnp.max`` calls are one loop each; on
CPU, computed on their own for every tensor of the study transformer's GEMMs, the separate
form took about three times as long). ``tensor_stats`` reduces each 1xTILE tile first and
then the tiles, so the blockwise dynamic range, the whole-tensor one and the sums come out
of the same pass (the standard deviation needs the mean, so it takes a second);
``quant_stats`` quantizes the operand once and shares it among its statistics.

Example:
  >>> x = jnp.array([1.0, 2.0, 1e-9, 0.0])
  >>> s = quant_stats(x.reshape(1, 1, 4), Quantization("e4m3", None), QUANT_STATS)
  >>> float(s["underflow_share"]), float(s["nonfinite_count"])   # 1e-9 flushes to 0
  (0.3333333432674408, 0.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit.casting import cast
from fmtkit.formats import get_format
from fmtkit.scaling import BlockScaling, MXScaling, delayed_amax_of, dequantize, quantize

__all__ = ["BASE_STATS", "BLOCK_STATS", "QUANT_STATS", "RECONSTRUCTION_STATS", "TILE",
           "Quantization", "block_stats", "clip_threshold", "quant_stats",
           "reconstruction_stats", "tensor_stats"]

BASE_STATS: tuple[str, ...] = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "amax",
                               "dynamic_range", "max_blockwise_dynamic_range")
"""Statistics of any tensor (``tensor_stats``; definitions in the module docstring)."""

QUANT_STATS: tuple[str, ...] = ("underflow_share", "saturation_share", "nonfinite_count",
                                "scale_min", "scale_max", "sqnr_db", "mse")
"""Statistics of a tensor against its quantization by a scaling recipe (``quant_stats``)."""

RECONSTRUCTION_STATS: tuple[str, ...] = ("underflow_share", "overflow_share", "amax",
                                         "sqnr_db", "rel_error", "nonfinite_share")
"""Statistics of a tensor against a reconstruction of it (``reconstruction_stats``)."""

BLOCK_STATS: tuple[str, ...] = ("sqnr_db", "saturation_block_share", "underflow_block_share",
                                "underflow_share")
"""Statistics of a block-scaled quantization, per block and per element (``block_stats``)."""

# The tile of max_blockwise_dynamic_range: 1x128, the activation tile of DeepSeek-V3's
# blockwise FP8 recipe (section 3.3.1) and of Transformer Engine's blockwise recipe.
TILE = 128
"""The tile of ``max_blockwise_dynamic_range``: 1x128 along the tensor's last axis."""

_ADD, _MIN, _MAX = "add", "min", "max"
_COMBINE: dict[str, Callable[[Any, Any], Any]] = {_ADD: lax.add, _MIN: lax.min,
                                                 _MAX: lax.max}


def _identity_of(kind: str, dtype: Any) -> jax.Array:
    if kind == _ADD:
        return jnp.zeros((), dtype)
    return jnp.asarray(jnp.inf if kind == _MIN else -jnp.inf, dtype)


def _reduce(parts: dict[str, tuple[jax.Array, str]], axes: Sequence[int]
            ) -> dict[str, jax.Array]:
    """``{name: (array, kind)}`` reduced over ``axes`` (kind: add, min or max), all in one
    variadic ``lax.reduce`` (the arrays share a shape)."""
    names = list(parts)
    kinds = [parts[k][1] for k in names]

    def combine(a, b):
        return tuple(_COMBINE[k](u, v) for k, u, v in zip(kinds, a, b, strict=True))

    out = lax.reduce(tuple(parts[k][0] for k in names),
                     tuple(_identity_of(k, parts[n][0].dtype) for k, n in zip(kinds, names)),
                     combine, tuple(axes))
    return dict(zip(names, out, strict=True))


def _log2_ratio(amax: jax.Array, nz: jax.Array) -> jax.Array:
    """log2(amax / nz) for ``nz`` the smallest nonzero magnitude (inf without one: 0)."""
    has = jnp.isfinite(nz)
    return jnp.where(has, jnp.log2(amax / jnp.where(has, nz, 1.0)), 0.0)


def _tiles(x: jax.Array) -> jax.Array:
    """``x`` as ``[rows, tiles, width]``: 1xTILE tiles along the last axis (zero-padded to a
    whole tile; a last axis up to TILE long is one tile of its own length, the zeros a pad
    would add changing no statistic of the absolute values)."""
    last = x.shape[-1] if x.ndim else 1
    rows = x.reshape(-1, last)
    if last > TILE and last % TILE:
        rows = jnp.pad(rows, ((0, 0), (0, -last % TILE)))
    return rows.reshape(rows.shape[0], -1, min(last, TILE))


_SEGMENT_OPS: dict[str, Callable[..., Any]] = {
    _ADD: jax.ops.segment_sum, _MIN: jax.ops.segment_min, _MAX: jax.ops.segment_max}


def _segment_reduce(parts: dict[str, tuple[jax.Array, str]], ids: jax.Array, n: int
                    ) -> dict[str, jax.Array]:
    """``{name: (array [rows, ...], kind)}`` reduced over all axes but the rows, then over
    the rows of each segment (``ids`` int32[rows]; a row with an id outside ``[0, n)``
    belongs to none): ``{name: [n]}``."""
    out = {}
    for k, (v, kind) in parts.items():
        if v.ndim > 1:
            v = _reduce({k: (v, kind)}, tuple(range(1, v.ndim)))[k]
        out[k] = _SEGMENT_OPS[kind](v, ids, num_segments=n)
    return out


def _no_data(values: dict[str, jax.Array], rows: jax.Array) -> dict[str, jax.Array]:
    """NaN (no data) for the segments without a row."""
    return {k: jnp.where(rows > 0, v, jnp.nan) for k, v in values.items()}


def tensor_stats(x: jax.Array, stats: Sequence[str], segments: Any = None
                 ) -> dict[str, jax.Array]:
    """``BASE_STATS`` of ``x`` named in ``stats`` (f32 scalars); with ``segments = (ids,
    n)``, of each of ``n`` segments of its rows (``ids`` int32[rows], the segment of each
    row of ``x`` as ``[rows, last axis]``; other ids: no segment): f32[n], NaN for a segment
    without a row."""
    x = jnp.asarray(x).astype(jnp.float32)
    want = set(stats)
    t = _tiles(x)
    a = jnp.abs(t)
    parts: dict[str, tuple[jax.Array, str]] = {}
    if want & {"amax", "dynamic_range", "max_blockwise_dynamic_range"}:
        parts["amax"] = (a, _MAX)
    if want & {"dynamic_range", "max_blockwise_dynamic_range"}:
        parts["nz"] = (jnp.where(a > 0, a, jnp.inf), _MIN)  # smallest nonzero |x|
    if "min" in want:
        parts["min"] = (t, _MIN)
    if "max" in want:
        parts["max"] = (t, _MAX)
    if want & {"mean", "std"}:
        parts["sum"] = (t, _ADD)
    if "l1_norm" in want:
        parts["l1"] = (a, _ADD)
    if "l2_norm" in want:
        parts["sq"] = (jnp.square(t), _ADD)
    if not parts:
        return {}
    tile = _reduce(parts, (2,))  # per tile, [rows, tiles]
    last = x.shape[-1] if x.ndim else 1
    if segments is None:
        tot = _reduce({k: (v, parts[k][1]) for k, v in tile.items()}, (0, 1))
        n = x.size
        rows = None
    else:
        ids, nseg = segments
        tot = _segment_reduce({k: (v, parts[k][1]) for k, v in tile.items()}, ids, nseg)
        rows = jax.ops.segment_sum(jnp.ones(ids.shape, jnp.float32), ids, num_segments=nseg)
        n = rows * last

    def std():
        mean = tot["sum"] / n
        if rows is None:
            return jnp.sqrt(jnp.sum(jnp.square(x - mean)) / n)
        dev = jnp.square(x.reshape(-1, last) - jnp.take(mean, ids, mode="clip")[:, None])
        return jnp.sqrt(jax.ops.segment_sum(jnp.sum(dev, axis=1), ids, num_segments=nseg)
                        / n)

    def blockwise():
        ratio = _log2_ratio(tile["amax"], tile["nz"])
        if rows is None:
            return jnp.max(ratio)
        return _segment_reduce({"r": (ratio, _MAX)}, ids, nseg)["r"]

    fns = {
        "min": lambda: tot["min"],
        "max": lambda: tot["max"],
        "mean": lambda: tot["sum"] / n,
        "std": std,
        "l1_norm": lambda: tot["l1"],
        "l2_norm": lambda: jnp.sqrt(tot["sq"]),
        "amax": lambda: tot["amax"],
        "dynamic_range": lambda: _log2_ratio(tot["amax"], tot["nz"]),
        "max_blockwise_dynamic_range": blockwise,
    }
    out = {s: fns[s]().astype(jnp.float32) for s in stats if s in fns}
    return out if rows is None else _no_data(out, rows)


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How a GEMM quantizes an operand laid out ``[*batch, free, contraction]``: element
    format and ``fmtkit.scaling`` recipe (None: a plain saturating cast, scale 1), one
    quantization per batch element."""

    fmt: str
    recipe: Any
    # A delayed recipe: the row of its amax history ([B, 3, history], rows x, w, grad; one
    # per batch element) this operand's per-tensor scale comes from, and its algorithm.
    row: int | None = None
    algo: str = "max"


def _block(recipe: Any) -> tuple[int, int]:
    if isinstance(recipe, BlockScaling):
        return tuple(recipe.block)  # type: ignore[return-value]
    if isinstance(recipe, MXScaling):
        return (1, recipe.block)
    return (1, 1)


def _quantized_padded(x3: jax.Array, q: Quantization, history: Any = None
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the f32 operand zero-padded to whole blocks, its quantize-dequantize, the scales
    ``[B, blocks along F, blocks along C]``) of ``x3 [B, F, C]`` under ``q``."""
    fmt = get_format(q.fmt)
    x = x3.astype(jnp.float32)
    if q.recipe is None:
        deq = cast(jnp.clip(x, -fmt.max, fmt.max), fmt).astype(jnp.float32)
        return x, deq, jnp.ones((x.shape[0], 1, 1), jnp.float32)
    _, f, c = x3.shape
    bf, bc = _block(q.recipe)
    padded = jnp.pad(x3, ((0, 0), (0, -f % bf), (0, -c % bc)))

    def one(t, hist):
        amax = None
        if hist is not None:
            amax = delayed_amax_of(hist, t, lambda u: jnp.max(jnp.abs(u)).astype(jnp.float32),
                                   q.algo)
        sa = quantize(t, fmt, q.recipe, amax=amax)
        return dequantize(sa, jnp.float32), sa.scale.astype(jnp.float32)

    if q.row is None:
        deq, scale = jax.vmap(lambda t: one(t, None))(padded)
    else:
        deq, scale = jax.vmap(one)(padded, history[:, q.row])
    b = x3.shape[0]
    return padded.astype(jnp.float32), deq, scale.reshape(b, scale.shape[-2], scale.shape[-1])


def quant_stats(x3: jax.Array, q: Quantization, stats: Sequence[str], history: Any = None,
                segments: Any = None) -> dict[str, jax.Array]:
    """``QUANT_STATS`` named in ``stats`` of the operand ``x3 [B, F, C]`` quantized by ``q``
    (``history``: a delayed recipe's amax histories, f32[B, 3, history]); with ``segments =
    (ids, n)``, of each of ``n`` segments of its rows (``ids`` int32[B, F]; other ids: no
    segment): f32[n], NaN for a segment without a row.

    The definitions are in the module docstring.

    The element statistics are reduced over the operand as quantized, zero-padded to whole
    blocks: a padding zero is finite, not counted as nonzero, quantizes to zero (no error)
    and stays below the clipping threshold, so it changes no count or sum."""
    want = [s for s in stats if s in QUANT_STATS]
    if not want:
        return {}
    x, deq, scale = _quantized_padded(x3, q, history)
    # The quantize-dequantize is materialized once (an elementwise loop XLA vectorizes):
    # fused into the reduction below, its rounding to the element format would run in that
    # loop's scalar code instead, which made these statistics twice as slow on CPU.
    deq = lax.optimization_barrier(deq)
    fmt = get_format(q.fmt)
    n = math.prod(x3.shape)
    parts: dict[str, tuple[jax.Array, str]] = {}
    nz = x != 0
    if "underflow_share" in want:
        parts["n_nz"] = (nz.astype(jnp.int32), _ADD)
        parts["under"] = ((nz & (deq == 0)).astype(jnp.int32), _ADD)
    if "saturation_share" in want:
        parts["sat"] = ((jnp.abs(x) / _element_scale(scale, x.shape) > clip_threshold(fmt)
                         ).astype(jnp.int32), _ADD)
    if "nonfinite_count" in want:
        parts["nonfinite"] = ((~jnp.isfinite(x)).astype(jnp.int32), _ADD)
    if "sqnr_db" in want:
        parts["signal"] = (jnp.square(x), _ADD)
    if {"sqnr_db", "mse"} & set(want):
        parts["err"] = (jnp.square(x - deq), _ADD)
    rows = None
    if segments is None:
        tot = _reduce(parts, (0, 1, 2)) if parts else {}
    else:
        ids, nseg = segments
        _, f, c = x3.shape
        # the padded rows (to whole blocks) belong to no segment
        ids = jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, x.shape[1] - f)),
                      constant_values=nseg).reshape(-1)
        parts = {k: (v.reshape(-1, v.shape[-1]), kind) for k, (v, kind) in parts.items()}
        if {"scale_min", "scale_max"} & set(want):
            es = _element_scale(scale, x.shape).reshape(-1, x.shape[-1])
            parts["smin"], parts["smax"] = (es, _MIN), (es, _MAX)
        tot = _segment_reduce(parts, ids, nseg)
        rows = jax.ops.segment_sum(jnp.ones(ids.shape, jnp.float32), ids, num_segments=nseg)
        n = rows * c
    out = {
        "underflow_share": lambda: _share(tot["under"], tot["n_nz"]),
        "saturation_share": lambda: tot["sat"].astype(jnp.float32) / n,
        "nonfinite_count": lambda: tot["nonfinite"],
        "scale_min": lambda: jnp.min(scale) if rows is None else tot["smin"],
        "scale_max": lambda: jnp.max(scale) if rows is None else tot["smax"],
        "sqnr_db": lambda: _sqnr(tot["signal"], tot["err"]),
        "mse": lambda: tot["err"] / n,
    }
    res = {s: out[s]().astype(jnp.float32) for s in want}
    return res if rows is None else _no_data(res, rows)


def clip_threshold(fmt) -> float:
    """The magnitude above which a scaled value is clipped: the format's largest value plus
    half its last step (values up to there round to the largest value anyway; 464 for
    E4M3, 61440 for E5M2)."""
    return float(fmt.max + 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits - 1))


def _element_scale(scale: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
    """The scales ``[B, sf, sc]`` of ``_quantized_padded`` broadcast to each element of the
    padded operand ``[B, F, C]`` (``shape``; sf divides F and sc divides C)."""
    b, f, c = shape
    sf, sc = scale.shape[1], scale.shape[2]
    s = jnp.broadcast_to(scale[:, :, None, :, None], (b, sf, f // sf, sc, c // sc))
    return s.reshape(shape)


def _sqnr(signal: jax.Array, noise: jax.Array) -> jax.Array:
    return jnp.where(noise > 0, 10.0 * jnp.log10(signal / jnp.where(noise > 0, noise, 1.0)),
                     jnp.inf)


def _share(count: jax.Array, of: jax.Array) -> jax.Array:
    """``count / of`` (0 when ``of`` is 0)."""
    return jnp.where(of > 0, count / jnp.maximum(of, 1), 0.0)


def reconstruction_stats(x: jax.Array, y: jax.Array, overflowed: jax.Array | None = None
                         ) -> dict[str, jax.Array]:
    """``RECONSTRUCTION_STATS`` (f32 scalars) of ``y``, a reconstruction of ``x`` (same shape,
    both f32); ``overflowed``: an optional boolean mask of the inputs beyond the format's
    range (counted in ``overflow_share`` besides the inputs whose ``y`` is not finite).

    Example:
      >>> s = reconstruction_stats(jnp.array([1.0, 2.0]), jnp.array([1.0, 2.5]))
      >>> round(float(s["sqnr_db"]), 2)   # 10 log10((1 + 4) / 0.25)
      13.01
    """
    finite = jnp.isfinite(x)
    y_bad = ~jnp.isfinite(y)
    over = y_bad if overflowed is None else (y_bad | overflowed)
    xf = jnp.where(finite, x, 0.0)
    err = jnp.where(finite & ~y_bad, x - y, 0.0)
    sig = jnp.sum(xf * xf)
    noise = jnp.sum(err * err)
    sqnr = 10.0 * (jnp.log10(sig) - jnp.log10(noise))
    sqnr = jnp.where(noise == 0, jnp.inf, sqnr)
    rel = jnp.where(sig > 0, jnp.sqrt(noise) / jnp.sqrt(jnp.maximum(sig, 1e-38)), 0.0)

    def frac(mask, of):
        return _share(jnp.sum(mask & of, dtype=jnp.float32), jnp.sum(of, dtype=jnp.float32))

    return {
        "underflow_share": frac((y == 0), (x != 0) & finite),
        "overflow_share": frac(over, finite),
        "amax": jnp.max(jnp.abs(xf)) if x.size else jnp.float32(0.0),
        "sqnr_db": sqnr.astype(jnp.float32),
        "rel_error": rel.astype(jnp.float32),
        "nonfinite_share": jnp.mean(y_bad, dtype=jnp.float32) if x.size else jnp.float32(0.0),
    }


def block_stats(x: jax.Array, d: jax.Array, scale: jax.Array, limit: float
                ) -> dict[str, jax.Array]:
    """``BLOCK_STATS`` (f32 scalars) of the 2-D ``x`` (f32, zero-padded to whole blocks)
    against ``d``, its block-scaled quantize-dequantize, given ``scale``: the decode scale of
    each block (f32 ``[F / bf, C / bc]``, the block shape following from the shapes) and
    ``limit``: the element format's largest value (6 for E2M1).

    Example:
      >>> x = jnp.array([[1.0, 9.0, 0.0, 1e-3]])     # two 1x2 blocks, scale 1
      >>> d = jnp.array([[1.0, 6.0, 0.0, 0.0]])
      >>> s = block_stats(x, d, jnp.ones((1, 2)), 6.0)
      >>> float(s["saturation_block_share"]), float(s["underflow_block_share"])
      (0.5, 0.5)
    """
    (f, c), (sf, sc) = x.shape, scale.shape
    split = (sf, f // sf, sc, c // sc)
    a = jnp.abs(x).reshape(split)
    sat = jnp.any(a > jnp.float32(limit) * scale[:, None, :, None], axis=(1, 3))
    nonzero = jnp.any(a > 0, axis=(1, 3))
    dead = nonzero & ~jnp.any(d.reshape(split) != 0, axis=(1, 3))
    return {
        "sqnr_db": _sqnr(jnp.sum(jnp.square(x)), jnp.sum(jnp.square(d - x))),
        "saturation_block_share": jnp.mean(sat.astype(jnp.float32)),
        "underflow_block_share": _share(jnp.sum(dead), jnp.sum(nonzero)),
        "underflow_share": _share(jnp.sum((x != 0) & (d == 0)), jnp.sum(x != 0)),
    }
