"""Casting to a format: rounding modes and the overflow policy.

``cast(x, fmt)`` with the defaults is bit-identical to ``x.astype(fmt.dtype)`` in ml_dtypes.
Stochastic rounding and round-toward-zero are computed exactly in f32 arithmetic:

    a = |x|;  ulp = 2^(max(floor(log2 a), e_min) - mantissa_bits)   (the format's spacing at a)
    q = a / ulp                 (exact: division by a power of two)
    lo = floor(q) * ulp         (toward zero)
    stochastic: lo + ulp with probability q - floor(q), else lo  (unbiased: E[result] = a)

The probability is compared against 24 random bits, so each draw is unbiased to within
2^-24 ulp. bfloat16 shares f32's exponent range, so it is rounded on the f32 bit pattern
(add 16 random bits, truncate), which is exact also for f32 subnormals. XLA on CPU flushes f32
subnormals in arithmetic; for the other formats that only affects inputs below 2^-126,
which are far under every format's smallest subnormal except E8M0's 2^-127 (those inputs fall
back to nearest rounding).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from fmtkit.formats import Format, get_format

__all__ = [
    "OVERFLOW_MODES",
    "ROUNDING_MODES",
    "cast",
    "check_decodable",
    "check_floating",
    "round_to_grid",
    "saturate",
]

ROUNDING_MODES = ("nearest", "stochastic", "toward_zero")
"""The ``rounding`` values ``cast`` accepts: nearest-even, stochastic, toward zero."""
OVERFLOW_MODES = ("inf_or_nan", "saturate")
"""The ``overflow`` values ``cast`` accepts: what the format defines, or saturation at ±max."""

Rounding = Literal["nearest", "stochastic", "toward_zero"]
Overflow = Literal["inf_or_nan", "saturate"]

_SR_BITS = 24  # random bits compared against the rounding probability (f32 has 24 significant)


def check_floating(x: jax.typing.ArrayLike, name: str = "x") -> jax.Array:
    """Returns ``x`` as a JAX array, raising ``TypeError`` unless it is floating point.

    Example:
      >>> check_floating([1.0, 2.0]).dtype
      dtype('float32')
    """
    arr = jnp.asarray(x)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise TypeError(
            f"{name} must be a floating-point array, got dtype {arr.dtype}. "
            f"Cast integers explicitly, e.g. {name}.astype(jnp.float32).")
    return arr


_FP6 = ("float6_e2m3fn", "float6_e3m2fn")


def check_decodable(x: jax.Array, name: str = "x") -> None:
    """Raises ``TypeError`` for FP6 arrays on CPU, which XLA can encode but not decode.

    XLA's CPU backend fails to compile any conversion *from* FP6 (an LLVM "invalid bitcast
    i6 to i8"), and JAX cannot even hand such an array to a host callback. Decode on the
    host instead: ``np.asarray(x).astype(np.float32)`` (ml_dtypes).
    """
    if jnp.dtype(x.dtype).name in _FP6 and jax.default_backend() == "cpu":
        raise TypeError(
            f"{name} has dtype {jnp.dtype(x.dtype).name}: XLA's CPU backend cannot convert from "
            "FP6. Decode on the host with np.asarray(x).astype(np.float32), or keep FP6 values "
            "in a wider container (quantize(..., fmt='fp6_...') stores them in E4M3, exactly).")


def saturate(x: jax.Array, fmt: Format, finite: jax.Array | None = None) -> jax.Array:
    """Replaces values beyond ``±fmt.max`` by ``±fmt.max``; NaN stays NaN.

    Infinities stay infinite where the format has inf, and are clipped to ±max where it has
    neither inf nor NaN (FP6/FP4, as ml_dtypes does). In formats with NaN but no inf, an inf
    input is left to become NaN in the cast: overflow of a finite value saturates, but a
    non-finite input is never made finite where the format can say otherwise.

    A select, not ``jnp.clip``: XLA CPU flushes f32 subnormals in arithmetic, and a select
    leaves them intact. ``finite`` is the mask of originally finite inputs when ``x`` has
    already been rounded (a rounding can carry a finite value to inf).

    Example:
      >>> from fmtkit.formats import get_format
      >>> saturate(jnp.array([500.0, -1e4, 3.0]), get_format("e4m3")).tolist()
      [448.0, -448.0, 3.0]
    """
    clipped = jnp.where(jnp.abs(x) > fmt.max, jnp.copysign(jnp.float32(fmt.max), x), x)
    if not fmt.has_nan:
        return clipped
    finite = jnp.isfinite(x) if finite is None else finite
    return jnp.where(finite, clipped, x)


def _to_format(x32: jax.Array, fmt: Format, overflow: Overflow,
               finite: jax.Array | None = None) -> jax.Array:
    """Round-to-nearest-even cast of f32 values with the overflow policy applied."""
    if overflow == "saturate" or not fmt.has_nan:
        x32 = saturate(x32, fmt, finite)
    if not fmt.has_nan:
        # ml_dtypes maps NaN to a zero of the opposite sign (+NaN -> -0) in formats that
        # cannot encode it (FP6/FP4); XLA's convert does not agree, so make it explicit.
        x32 = jnp.where(jnp.isnan(x32), jnp.copysign(jnp.float32(0.0), -x32), x32)
    return x32.astype(fmt.dtype)


def _uniform_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform f32 in [0, 1) on a 2^-24 grid."""
    bits = jax.random.bits(key, shape, jnp.uint32) >> (32 - _SR_BITS)
    return bits.astype(jnp.float32) * jnp.float32(2.0**-_SR_BITS)


def _bf16_bit_rounding(x32: jax.Array, rounding: Rounding, key: jax.Array | None) -> jax.Array:
    """Rounds f32 to bf16-representable f32 on the bit pattern (exact, subnormals included)."""
    bits = jax.lax.bitcast_convert_type(x32, jnp.uint32)
    if rounding == "stochastic":
        assert key is not None
        bits = bits + (jax.random.bits(key, x32.shape, jnp.uint32) >> 16)
    rounded = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)
    # The sign bit is never touched by a carry from finite magnitudes; NaN/inf pass through.
    return jnp.where(jnp.isfinite(x32), rounded, x32)


def round_to_grid(x32: jax.Array, fmt: Format) -> jax.Array:
    """Rounds f32 to the nearest value on fmt's grid (ties to even), staying in f32.

    For values within ±fmt.max of formats whose spacing is at least 2^-126 (all but bf16,
    f32 and E8M0), this equals ``x.astype(fmt.dtype)`` decoded back to f32; used where a
    format cannot be decoded (FP6 on CPU).

    Example:
      >>> from fmtkit.formats import get_format
      >>> round_to_grid(jnp.array([0.1, 300.0]), get_format("e4m3")).tolist()   # still f32
      [0.1015625, 288.0]
    """
    a = jnp.abs(x32)
    _, e = jnp.frexp(a)
    e_min = -fmt.bias if not fmt.signed else 1 - fmt.bias
    ulp = jnp.ldexp(jnp.float32(1.0), jnp.maximum(e - 1, e_min) - fmt.mantissa_bits)
    r = jnp.copysign(jnp.round(a / ulp) * ulp, x32)  # jnp.round: half to even
    return jnp.where(jnp.isfinite(x32), r, x32)


def _grid_rounding(x32: jax.Array, fmt: Format, rounding: Rounding,
                   key: jax.Array | None) -> jax.Array:
    """Rounds f32 onto fmt's grid toward zero or stochastically; result is f32 (may exceed max)."""
    a = jnp.abs(x32)
    _, e = jnp.frexp(a)  # a = m * 2^e with m in [0.5, 1)
    e_min = -fmt.bias if not fmt.signed else 1 - fmt.bias  # exponent of the lowest binade
    exp = jnp.maximum(e - 1, e_min) - fmt.mantissa_bits
    ulp = jnp.ldexp(jnp.float32(1.0), exp)
    q = a / ulp
    lo = jnp.floor(q)
    if rounding == "stochastic":
        assert key is not None
        lo = lo + (_uniform_bits(key, x32.shape) < q - lo).astype(jnp.float32)
    r = jnp.copysign(lo * ulp, x32)
    if rounding == "toward_zero":
        r = jnp.clip(r, -fmt.max, fmt.max)  # truncation never overflows a finite value
    tiny = a < np.float32(2.0**-126)  # f32 subnormal: flushed in XLA CPU arithmetic
    r = jnp.where(tiny & (a > 0), x32, r) if fmt.min_subnormal < 2.0**-126 else r
    return jnp.where(jnp.isfinite(x32), r, x32)


def _cast_impl(x: jax.Array, key: jax.Array | None, fmt: Format, rounding: Rounding,
               overflow: Overflow) -> jax.Array:
    if x.dtype == fmt.dtype and rounding == "nearest":
        return x
    x32 = x.astype(jnp.float32) if x.dtype != jnp.float32 else x
    finite = None
    if rounding != "nearest" and fmt.name != "float32":
        finite = jnp.isfinite(x32)
        if fmt.name == "bfloat16":
            x32 = _bf16_bit_rounding(x32, rounding, key)
        else:
            x32 = _grid_rounding(x32, fmt, rounding, key)
    return _to_format(x32, fmt, overflow, finite)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _cast_st(x, key, fmt, rounding, overflow):
    return _cast_impl(x, key, fmt, rounding, overflow)


@_cast_st.defjvp
def _cast_st_jvp(fmt, rounding, overflow, primals, tangents):
    x, key = primals
    tx, _ = tangents
    return _cast_st(x, key, fmt, rounding, overflow), tx.astype(fmt.dtype)


def cast(x: jax.typing.ArrayLike, fmt: str | Format | jax.typing.DTypeLike, *,
         rounding: Rounding = "nearest", key: jax.Array | None = None,
         overflow: Overflow = "inf_or_nan") -> jax.Array:
    """Casts ``x`` to the format ``fmt`` with the given rounding and overflow policy.

    Args:
      x: a floating-point array (any float dtype; computed through f32, which holds every
        narrower format exactly).
      fmt: a format name, alias, dtype or ``Format``.
      rounding: ``"nearest"`` (round half to even; bit-identical to ml_dtypes' cast),
        ``"stochastic"`` (rounds to one of the two neighbours with probability proportional
        to proximity, so ``E[cast(x)] == x``; needs ``key``) or ``"toward_zero"``.
      key: a ``jax.random`` key, required for stochastic rounding; the same key gives the same
        result.
      overflow: ``"inf_or_nan"`` (what the format defines: inf in IEEE-like formats, NaN in
        the FN/FNUZ FP8 formats, ±max in FP6/FP4, which have neither) or ``"saturate"``
        (finite values beyond ±max become ±max; NaN stays NaN).

    Returns:
      An array of ``fmt.dtype``. Its gradient is straight-through (the identity, cast to the
      output dtype), so ``cast`` can sit inside a differentiated function.

    Raises:
      TypeError: ``x`` is not floating point.
      ValueError: unknown format, rounding or overflow mode, or stochastic without ``key``.

    Example:
      >>> float(cast(jnp.float32(0.1), "bf16"))
      0.10009765625
    """
    fmt = get_format(fmt)
    x = check_floating(x)
    check_decodable(x)
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}.")
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}.")
    if rounding == "stochastic":
        if key is None:
            raise ValueError("rounding='stochastic' needs a PRNG key: cast(x, fmt, "
                             "rounding='stochastic', key=jax.random.key(0)).")
    else:
        key = None
    if key is None:
        return _cast_st_nokey(x, fmt, rounding, overflow)
    return _cast_st(x, key, fmt, rounding, overflow)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _cast_st_nokey(x, fmt, rounding, overflow):
    return _cast_impl(x, None, fmt, rounding, overflow)


@_cast_st_nokey.defjvp
def _cast_st_nokey_jvp(fmt, rounding, overflow, primals, tangents):
    (x,), (tx,) = primals, tangents
    return _cast_st_nokey(x, fmt, rounding, overflow), tx.astype(fmt.dtype)
