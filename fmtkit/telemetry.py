"""In-jit numerics statistics of a cast or a quantization, for one array or a whole pytree.

All statistics are computed in f32 with a handful of fused reductions, so they are cheap
enough to log every step inside a jitted train step.

Definitions (x is the input, y its reconstruction, both in f32; "finite" excludes inf/NaN):
  underflow = #(x != 0 and y == 0) / #(x != 0)                 (flushed to zero)
  overflow  = #(x finite and (|x| > limit or y not finite)) / #(x finite)
              limit is fmt.max in the cast domain (|x / scale| for a quantization)
  amax      = max |x| over finite x
  sqnr_db   = 10 log10(sum x^2 / sum (x - y)^2)   (inf for an exact reconstruction)
  rel_error = ||x - y||_2 / ||x||_2
  nonfinite = #(y not finite) / size
sqnr_db and rel_error are taken over the entries whose input and reconstruction are finite;
overflow to inf/NaN is reported by ``overflow`` and ``nonfinite`` instead of swamping them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fmtkit.casting import Overflow, Rounding, cast, check_floating
from fmtkit.formats import Format, get_format
from fmtkit.scaling import Recipe, TensorScaling, dequantize, quantize

__all__ = ["NumericsStats", "cast_stats", "compare", "quantize_stats", "tree_stats"]


class NumericsStats(NamedTuple):
    """Scalar f32 statistics of one cast or quantization (see the module docstring).

    Example:
      >>> NumericsStats._fields
      ('underflow', 'overflow', 'amax', 'sqnr_db', 'rel_error', 'nonfinite')
    """

    underflow: jax.Array
    overflow: jax.Array
    amax: jax.Array
    sqnr_db: jax.Array
    rel_error: jax.Array
    nonfinite: jax.Array


def _frac(mask: jax.Array, of: jax.Array) -> jax.Array:
    n = jnp.sum(of, dtype=jnp.float32)
    return jnp.where(n > 0, jnp.sum(mask & of, dtype=jnp.float32) / jnp.maximum(n, 1.0), 0.0)


def compare(x: jax.typing.ArrayLike, y: jax.typing.ArrayLike,
            overflowed: jax.Array | None = None) -> NumericsStats:
    """Statistics of a reconstruction ``y`` of ``x`` (same shape; any float dtypes).

    Args:
      x: the original values.
      y: the reconstruction (e.g. ``cast(x, fmt)`` or ``qdq(x, fmt, recipe)``).
      overflowed: optional boolean mask of inputs that exceeded the format's range (counted as
        overflow in addition to inputs whose reconstruction is not finite).

    Example:
      >>> # 10 log10((1 + 4) / 0.25) = 13.01 dB
      >>> round(float(compare(jnp.array([1.0, 2.0]), jnp.array([1.0, 2.5])).sqnr_db), 2)
      13.01
    """
    x = check_floating(x).astype(jnp.float32)
    y = check_floating(y, "y").astype(jnp.float32)
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same shape, got {x.shape} and {y.shape}.")
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
    return NumericsStats(
        underflow=_frac((y == 0), (x != 0) & finite),
        overflow=_frac(over, finite),
        amax=jnp.max(jnp.abs(xf)) if x.size else jnp.float32(0.0),
        sqnr_db=sqnr.astype(jnp.float32),
        rel_error=rel.astype(jnp.float32),
        nonfinite=jnp.mean(y_bad, dtype=jnp.float32) if x.size else jnp.float32(0.0),
    )


def cast_stats(x: jax.typing.ArrayLike, fmt: str | Format, *, rounding: Rounding = "nearest",
               key: jax.Array | None = None, overflow: Overflow = "inf_or_nan"
               ) -> NumericsStats:
    """Statistics of ``cast(x, fmt, ...)`` against x.

    Example:
      >>> s = cast_stats(jnp.array([1e-8, 1.0, 7e4]), "fp16")
      >>> round(float(s.underflow), 3), round(float(s.overflow), 3)  # 1e-8 flushes, 7e4 overflows
      (0.333, 0.333)
    """
    fmt = get_format(fmt)
    x = check_floating(x)
    y = cast(x, fmt, rounding=rounding, key=key, overflow=overflow)
    beyond = jnp.abs(x.astype(jnp.float32)) > fmt.max
    return compare(x, y, beyond & jnp.isfinite(x))


def quantize_stats(x: jax.typing.ArrayLike, fmt: str | Format,
                   recipe: Recipe = TensorScaling(), *, state: Any = None) -> NumericsStats:
    """Statistics of ``qdq(x, fmt, recipe)``; overflow counts values clipped at ±fmt.max.

    Example:
      >>> x = jnp.array([1.0, 0.3, -2.0, 1e-4])
      >>> s = quantize_stats(x, "e4m3")        # one scale: amax 2.0 maps to 448
      >>> float(s.amax), round(float(s.sqnr_db), 1)
      (2.0, 44.0)
    """
    fmt = get_format(fmt)
    x = check_floating(x)
    sa = quantize(x, fmt, recipe, state=state)
    y = dequantize(sa, jnp.float32)
    scaled = jnp.abs(x.astype(jnp.float32) / sa.expanded_scale())
    return compare(x, y, (scaled > fmt.max) & jnp.isfinite(x))


def tree_stats(tree: Any, fn: Callable[[jax.Array], NumericsStats]) -> dict[str, NumericsStats]:
    """Applies a statistics function to every floating leaf of a pytree, keyed by path.

    Example:
      >>> grads = {"w": jnp.full((3,), 1e-8), "b": jnp.ones((2,))}
      >>> stats = tree_stats(grads, lambda g: cast_stats(g, "fp16"))
      >>> float(stats["w"].underflow)
      1.0
    """
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            out[jax.tree_util.keystr(path, simple=True, separator="/")] = fn(leaf)
    return out
