"""Helpers shared by the optax transformations of ``fmtkit.optim`` (private)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmtkit._switches import SWITCHES

F32 = jnp.float32


def is_masked(x: Any) -> bool:
    """True for optax's placeholder of a leaf that a transformation does not track."""
    return isinstance(x, optax.MaskedNode)


def check_float_leaves(tree: Any, name: str) -> list[jax.Array]:
    """Returns the leaves of ``tree``, raising ``TypeError`` on a non-floating one."""
    leaves = jax.tree.leaves(tree)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(
                f"{name} must hold floating-point arrays only; the leaf at "
                f"{jax.tree_util.keystr(path)} has dtype {jnp.result_type(leaf)}.")
    return leaves


def is_low_precision(dtype: Any) -> bool:
    """Floating dtypes narrower than f32 (bf16, f16, FP8, ...): those that get a master copy."""
    dtype = np.dtype(dtype)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize < 4


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: every element of every leaf of ``tree`` is finite (True for no leaves).

    Exact (PyTorch's elementwise ``isfinite`` test, the same answer as
    ``all(isfinite(x))``), with a fast common path: one f32 sum per leaf, added up. IEEE
    addition propagates inf and NaN (inf + -inf is NaN), so a finite total proves every
    element finite; only a non-finite total (a non-finite element, or finite elements
    whose sum overflows f32's max, 3.4e38) runs the exact test, inside a ``lax.cond``: the
    sum of ``x - x``, which is 0 for every finite element and NaN for inf and NaN, so it is
    NaN exactly when an element is not finite, and cannot overflow. On CPU the f32 sum is
    ~4x faster than ``all(isfinite(x))`` for bf16 and f32 leaves (a bool array, then a
    reduce), and the ``x - x`` fallback fuses into its reductions: an ``all(isfinite(x))``
    fallback made XLA:CPU reserve a bool array per leaf in every step's temporary buffer,
    taken or not (10 MB for 10M parameters). A max-reduction would not do: XLA's
    vectorised max may drop a NaN.

    ``dynamic_loss_scale`` and ``static_loss_scale`` decide their skips with this function.

    Example:
      >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
      False
      >>> bool(all_finite(jnp.array([3e38, 3e38], jnp.float32)))  # the sum overflows
      True
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    total = jnp.zeros([], F32)
    for x in leaves:
        total = total + jnp.sum(jnp.asarray(x).astype(F32))

    def exact(xs):
        if not SWITCHES.fused_finite_fallback:
            return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))
        nan_if_not_finite = jnp.zeros([], F32)
        for x in xs:
            nan_if_not_finite = nan_if_not_finite + jnp.sum(x - x, dtype=F32)
        return jnp.isfinite(nan_if_not_finite)

    return jax.lax.cond(jnp.isfinite(total), lambda xs: jnp.array(True), exact,
                        [jnp.asarray(x) for x in leaves])


def increment(count: jax.Array) -> jax.Array:
    """int32 + 1, saturating at the int32 maximum (never wraps to a negative count)."""
    return optax.safe_increment(count)


def _scalar_array(value: Any, name: str) -> bool | None:
    """True for a scalar array, False for a Python number, None for anything else (the
    caller raises its own ``TypeError``); ``ValueError`` for an array that is not a scalar."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
        return None
    if isinstance(value, numbers.Real):
        return False
    if np.shape(value) != ():
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}.")
    return True


def _concrete(value: Any) -> Any:
    """``value`` as a NumPy scalar, or None when it is traced (``optax.inject_hyperparams``
    passes its hyperparameters as arrays, traced inside ``jit``)."""
    try:
        return np.asarray(value)[()]
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def positive_float(value: Any, name: str, *, allow_none: bool = False) -> Any:
    """Validates a finite, positive hyperparameter.

    A Python number (or a concrete scalar array) is validated and returned as a Python
    float, a closure constant. A traced scalar (``optax.inject_hyperparams`` keeps numeric
    hyperparameters as arrays in its state and traces them under ``jit``) cannot be
    validated; it is returned as a float32 array (it was validated when concrete, at
    ``init``).
    """
    if value is None and allow_none:
        return None
    is_array = _scalar_array(value, name)
    if is_array is None or (is_array and not (jnp.issubdtype(value.dtype, jnp.floating) or
                                              jnp.issubdtype(value.dtype, jnp.integer))):
        raise TypeError(f"{name} must be a positive finite number, got {value!r}.")
    v = _concrete(value) if is_array else value
    if v is None:
        return jnp.asarray(value, F32)
    v = float(v)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}.")
    return v


def positive_int(value: Any, name: str) -> Any:
    """Validates a positive integer hyperparameter: a Python int (or a concrete integer
    scalar array) comes back as an int; a traced integer scalar (``optax.inject_hyperparams``
    under ``jit``) as an int32 array."""
    is_array = _scalar_array(value, name)
    if is_array is None or (is_array and not jnp.issubdtype(value.dtype, jnp.integer)) or (
            not is_array and not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be a positive int, got {value!r}.")
    v = _concrete(value) if is_array else value
    if v is None:
        return jnp.asarray(value, jnp.int32)
    if v <= 0:
        raise ValueError(f"{name} must be a positive int (>= 1), got {value!r}.")
    return int(v)


def check_seed(seed: Any) -> Any:
    """Validates an int32 seed: a Python int (or a concrete integer scalar array) comes back
    as an int; a traced one (``optax.inject_hyperparams`` under ``jit``: the transformations
    read the seed from their state, not from this argument, after ``init``) as it is."""
    is_array = _scalar_array(seed, "seed")
    if is_array is None or (is_array and not jnp.issubdtype(seed.dtype, jnp.integer)) or (
            not is_array and not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed must be an int, got {seed!r}.")
    v = _concrete(seed) if is_array else seed
    if v is None:
        return seed
    if not -(2**31) <= v < 2**31:
        raise ValueError(f"seed must fit in int32, got {seed!r}.")
    return int(v)


def check_dtype_arg(value: Any, name: str) -> np.dtype:
    """``np.dtype(value)``, with a clear error for an array: ``optax.inject_hyperparams``
    treats every callable argument as a schedule, so a dtype given as ``jnp.float32`` (a
    callable) arrives as the array ``jnp.float32(step)``."""
    if isinstance(value, np.ndarray | jax.Array):
        raise TypeError(
            f"{name} must be a dtype, got an array ({value!r}). Under "
            f"optax.inject_hyperparams, pass it as a string ({name}='float32') or list it in "
            f"static_args: inject_hyperparams treats callables such as jnp.float32 as "
            "schedules.")
    try:
        return np.dtype(value)
    except TypeError as e:
        raise TypeError(f"{name} must be a dtype, got {value!r}.") from e


def step_key(seed: jax.Array, count: jax.Array) -> jax.Array:
    """The PRNG key of step ``count``: deterministic from two int32 state scalars."""
    return jax.random.fold_in(jax.random.key(seed), count)


def leaf_keys(key: jax.Array, n: int) -> list[jax.Array]:
    """``n`` independent keys, one per leaf (in tree-flatten order)."""
    if n == 0:
        return []
    return list(jax.random.split(key, n))
