"""In-jit numerics statistics of a cast or a quantization, for one array or a whole pytree.

All statistics are computed in f32 with a handful of fused reductions, so they are cheap
enough to log every step inside a jitted train step. The statistics are
``fmtkit.stats.RECONSTRUCTION_STATS``, under the names and definitions of ``fmtkit.stats``
(x the input, d its reconstruction): ``underflow_share``, ``overflow_share`` (for a cast,
beyond ±fmt.max; for a quantization, |x / scale| beyond it), ``amax``, ``sqnr_db``,
``rel_error`` and ``nonfinite_share``.

Deprecated spellings: the fields ``underflow``, ``overflow`` and ``nonfinite`` of
``NumericsStats`` still read ``underflow_share``, ``overflow_share`` and
``nonfinite_share``, and warn once with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fmtkit.casting import Overflow, Rounding, cast, check_floating
from fmtkit.formats import Format, get_format
from fmtkit.scaling import Recipe, TensorScaling, dequantize, quantize
from fmtkit.stats import reconstruction_stats

__all__ = ["NumericsStats", "cast_stats", "compare", "quantize_stats", "tree_stats"]


# Earlier field names of NumericsStats: the fmtkit.stats name each one reads.
_RENAMED = {"underflow": "underflow_share", "overflow": "overflow_share",
            "nonfinite": "nonfinite_share"}
_WARNED: set[str] = set()


def _renamed(stats: NumericsStats, old: str) -> jax.Array:
    """The field an earlier name reads, with a ``DeprecationWarning`` the first time."""
    if old not in _WARNED:
        _WARNED.add(old)
        warnings.warn(f"NumericsStats.{old} is deprecated: use NumericsStats.{_RENAMED[old]} "
                      "(the same value, named as in fmtkit.stats).", DeprecationWarning,
                      stacklevel=3)
    return getattr(stats, _RENAMED[old])


class NumericsStats(NamedTuple):
    """Scalar f32 statistics of one cast or quantization (definitions: ``fmtkit.stats``).

    Example:
      >>> NumericsStats._fields
      ('underflow_share', 'overflow_share', 'amax', 'sqnr_db', 'rel_error', 'nonfinite_share')
    """

    underflow_share: jax.Array
    overflow_share: jax.Array
    amax: jax.Array
    sqnr_db: jax.Array
    rel_error: jax.Array
    nonfinite_share: jax.Array

    @property
    def underflow(self) -> jax.Array:
        """Deprecated: ``underflow_share``."""
        return _renamed(self, "underflow")

    @property
    def overflow(self) -> jax.Array:
        """Deprecated: ``overflow_share``."""
        return _renamed(self, "overflow")

    @property
    def nonfinite(self) -> jax.Array:
        """Deprecated: ``nonfinite_share``."""
        return _renamed(self, "nonfinite")


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
    return NumericsStats(**reconstruction_stats(x, y, overflowed))


def cast_stats(x: jax.typing.ArrayLike, fmt: str | Format, *, rounding: Rounding = "nearest",
               key: jax.Array | None = None, overflow: Overflow = "inf_or_nan"
               ) -> NumericsStats:
    """Statistics of ``cast(x, fmt, ...)`` against x.

    Example:
      >>> s = cast_stats(jnp.array([1e-8, 1.0, 7e4]), "fp16")  # 1e-8 flushes, 7e4 overflows
      >>> round(float(s.underflow_share), 3), round(float(s.overflow_share), 3)
      (0.333, 0.333)
    """
    fmt = get_format(fmt)
    x = check_floating(x)
    y = cast(x, fmt, rounding=rounding, key=key, overflow=overflow)
    beyond = jnp.abs(x.astype(jnp.float32)) > fmt.max
    return compare(x, y, beyond & jnp.isfinite(x))


def quantize_stats(x: jax.typing.ArrayLike, fmt: str | Format,
                   recipe: Recipe = TensorScaling(), *, state: Any = None) -> NumericsStats:
    """Statistics of ``qdq(x, fmt, recipe)``; ``overflow_share`` counts values clipped at
    ±fmt.max.

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
      >>> float(stats["w"].underflow_share)
      1.0
    """
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            out[jax.tree_util.keystr(path, simple=True, separator="/")] = fn(leaf)
    return out
