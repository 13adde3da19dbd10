"""Floating-point format registry: every format ml_dtypes / JAX provide, derived from bit layouts.

Each ``Format`` is computed from its bit layout (exponent bits, mantissa bits, bias and the
encoding of special values), not copied from ``ml_dtypes.finfo``; the tests cross-check the two.

Encodings of special values (``_Encoding``):

* ``IEEE``: the all-ones exponent holds inf (mantissa 0) and NaN (mantissa != 0), as in
  IEEE 754 binary16/32, bfloat16, E5M2 (OCP FP8 v1.0), E4M3 and E3M4 (IEEE-like FP8 variants).
* ``FN`` ("finite, NaN"): no inf; only the all-ones exponent *and* all-ones mantissa is NaN,
  so the top binade minus one code is usable (OCP E4M3: max 0x7E = 448).
* ``FNUZ`` ("finite, NaN, unsigned zero"): no inf, no -0; the code of -0 (0x80) is the only NaN
  (Graphcore / AMD FP8 formats).
* ``FINITE``: no inf, no NaN, every code a number (OCP MX FP6 and FP4 element formats).
* ``E8M0``: unsigned exponent-only scale format of OCP MX v1.0 section 5.4: 2^(e-127),
  0xFF is NaN, no zero, no sign.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = ["ALIASES", "FORMATS", "Decomposition", "Format", "decompose", "get_format"]


class _Encoding(enum.Enum):
    IEEE = "ieee"
    FN = "fn"
    FNUZ = "fnuz"
    FINITE = "finite"
    E8M0 = "e8m0"


@dataclasses.dataclass(frozen=True)
class Format:
    """A floating-point format and its range/precision constants.

    Attributes:
      name: canonical name (the ml_dtypes / JAX dtype name).
      dtype: the NumPy dtype (ml_dtypes extension types for the sub-16-bit formats).
      bits: number of significant storage bits (6 for FP6, 4 for FP4, though stored in a byte).
      exponent_bits: number of exponent bits.
      mantissa_bits: number of mantissa bits (without the implicit bit).
      bias: exponent bias; a normal number is (-1)^s * 2^(e - bias) * (1 + m / 2^mantissa_bits).
      max: largest finite value.
      min_normal: smallest positive normal value, 2^(1 - bias) (2^-127 for E8M0, which has no
        subnormals and uses exponent code 0 as a normal number).
      min_subnormal: smallest positive value (equal to min_normal when there are no subnormals).
      eps: 2^-mantissa_bits, the spacing just above 1.0.
      has_inf: whether the encoding has infinities.
      has_nan: whether it has NaN.
      has_negative_zero: whether it has -0.
      signed: False only for E8M0.

    Example:
      >>> f = get_format("e4m3")
      >>> f.max, f.eps, f.min_subnormal, f.bits
      (448.0, 0.125, 0.001953125, 8)
    """

    name: str
    dtype: np.dtype = dataclasses.field(repr=False)
    bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    min_normal: float
    min_subnormal: float
    eps: float
    has_inf: bool
    has_nan: bool
    has_negative_zero: bool
    signed: bool = True

    @property
    def storage_bytes(self) -> int:
        """Bytes one element occupies in memory (FP6 and FP4 are stored one per byte)."""
        return self.dtype.itemsize

    @property
    def is_fp8_family(self) -> bool:
        """True for the sub-16-bit formats (FP8, FP6, FP4, E8M0) that XLA cannot compute in."""
        return self.bits <= 8

    @property
    def jnp_dtype(self) -> Any:
        """The scalar type to pass to ``jnp.asarray(..., dtype=)`` / ``astype``."""
        return jnp.dtype(self.dtype).type


def _make(name: str, dtype: Any, exponent_bits: int, mantissa_bits: int, bias: int,
          encoding: _Encoding) -> Format:
    e, m = exponent_bits, mantissa_bits
    top = 2**e - 1  # all-ones exponent code
    if encoding is _Encoding.IEEE:
        max_exp, max_mant = top - 1 - bias, 2.0 - 2.0**-m
    elif encoding is _Encoding.FN:
        max_exp, max_mant = top - bias, 2.0 - 2.0 ** (1 - m)  # all-ones mantissa is NaN
    elif encoding in (_Encoding.FNUZ, _Encoding.FINITE):
        max_exp, max_mant = top - bias, 2.0 - 2.0**-m
    else:  # E8M0: codes 0..254 are 2^(code - bias); 255 is NaN
        max_exp, max_mant = top - 1 - bias, 1.0
    if encoding is _Encoding.E8M0:
        min_normal = min_subnormal = 2.0**-bias
    else:
        min_normal = 2.0 ** (1 - bias)
        min_subnormal = 2.0 ** (1 - bias - m)
    return Format(
        name=name,
        dtype=np.dtype(dtype),
        bits=(0 if encoding is _Encoding.E8M0 else 1) + e + m,
        exponent_bits=e,
        mantissa_bits=m,
        bias=bias,
        max=float(max_mant * 2.0**max_exp),
        min_normal=float(min_normal),
        min_subnormal=float(min_subnormal),
        eps=float(2.0**-m),
        has_inf=encoding is _Encoding.IEEE,
        has_nan=encoding is not _Encoding.FINITE,
        has_negative_zero=encoding in (_Encoding.IEEE, _Encoding.FN, _Encoding.FINITE),
        signed=encoding is not _Encoding.E8M0,
    )


_E = _Encoding
_FORMATS_LIST = (
    # name, dtype, exponent bits, mantissa bits, bias, encoding   (source of the layout)
    _make("float32", np.float32, 8, 23, 127, _E.IEEE),  # IEEE 754 binary32
    _make("float16", np.float16, 5, 10, 15, _E.IEEE),  # IEEE 754 binary16
    _make("bfloat16", ml_dtypes.bfloat16, 8, 7, 127, _E.IEEE),  # Google Brain float
    _make("float8_e4m3fn", ml_dtypes.float8_e4m3fn, 4, 3, 7, _E.FN),  # OCP FP8 v1.0 E4M3
    _make("float8_e5m2", ml_dtypes.float8_e5m2, 5, 2, 15, _E.IEEE),  # OCP FP8 v1.0 E5M2
    _make("float8_e4m3fnuz", ml_dtypes.float8_e4m3fnuz, 4, 3, 8, _E.FNUZ),  # Graphcore/AMD
    _make("float8_e5m2fnuz", ml_dtypes.float8_e5m2fnuz, 5, 2, 16, _E.FNUZ),  # Graphcore/AMD
    _make("float8_e4m3b11fnuz", ml_dtypes.float8_e4m3b11fnuz, 4, 3, 11, _E.FNUZ),  # TPU bias 11
    _make("float8_e3m4", ml_dtypes.float8_e3m4, 3, 4, 3, _E.IEEE),  # IEEE P3109-style
    _make("float8_e4m3", ml_dtypes.float8_e4m3, 4, 3, 7, _E.IEEE),  # IEEE P3109-style
    _make("float6_e2m3fn", ml_dtypes.float6_e2m3fn, 2, 3, 1, _E.FINITE),  # OCP MX v1.0 FP6
    _make("float6_e3m2fn", ml_dtypes.float6_e3m2fn, 3, 2, 3, _E.FINITE),  # OCP MX v1.0 FP6
    _make("float4_e2m1fn", ml_dtypes.float4_e2m1fn, 2, 1, 1, _E.FINITE),  # OCP MX v1.0 FP4
    _make("float8_e8m0fnu", ml_dtypes.float8_e8m0fnu, 8, 0, 127, _E.E8M0),  # OCP MX scale
)

FORMATS: Mapping[str, Format] = MappingProxyType({f.name: f for f in _FORMATS_LIST})
"""Canonical name -> Format, for every floating format ml_dtypes and JAX provide."""

ALIASES: Mapping[str, str] = MappingProxyType({
    "fp32": "float32", "f32": "float32",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "bf16": "bfloat16",
    "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
    "fp6_e2m3": "float6_e2m3fn", "fp6_e3m2": "float6_e3m2fn",
    "fp4": "float4_e2m1fn", "fp4_e2m1": "float4_e2m1fn",
    "e8m0": "float8_e8m0fnu",
})
"""Short names accepted by ``get_format`` (fp32, bf16, e4m3, ... plus jmp's f32/f16/half)."""


def get_format(name_or_dtype: str | Format | Any) -> Format:
    """Looks up a format by canonical name, alias, dtype or Format.

    Args:
      name_or_dtype: e.g. ``"bf16"``, ``"float8_e4m3fn"``, ``jnp.bfloat16``, ``np.float16``.

    Returns:
      The ``Format``.

    Raises:
      ValueError: an unknown name or a non-floating dtype; the message lists the valid names.

    Example:
      >>> get_format("e4m3").max
      448.0
    """
    if isinstance(name_or_dtype, Format):
        return name_or_dtype
    if isinstance(name_or_dtype, str):
        key = name_or_dtype.strip().lower()
        key = ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
        raise ValueError(
            f"Unknown format {name_or_dtype!r}. Valid names: {', '.join(FORMATS)}; "
            f"aliases: {', '.join(ALIASES)}.")
    try:
        dtype = np.dtype(name_or_dtype)
    except TypeError:
        raise TypeError(
            f"Expected a format name, Format or floating dtype, got {name_or_dtype!r} "
            f"of type {type(name_or_dtype).__name__}.") from None
    if dtype.name in FORMATS:
        return FORMATS[dtype.name]
    raise ValueError(
        f"dtype {dtype.name!r} is not a floating format fmtkit knows. "
        f"Valid formats: {', '.join(FORMATS)}.")


@dataclasses.dataclass(frozen=True)
class Decomposition:
    """How one value is stored in a format (the result of ``decompose``).

    Attributes:
      value: the input, as a Python float (float64).
      format: the format's canonical name.
      stored: the value the format stores (round to nearest even), as a float.
      code: the bit pattern as an int.
      sign: the sign bit as a string of '0'/'1' ('' for E8M0, which has none).
      exponent: the exponent bits as a string of '0'/'1'.
      mantissa: the mantissa bits as a string of '0'/'1'.
      kind: "zero", "subnormal", "normal", "inf", "nan", plus " (overflow)" or " (underflow)"
        when a finite nonzero input became inf/NaN/±max or zero.
      abs_error: |stored - value| (inf/NaN when the stored value is not finite).
      rel_error: abs_error / |value| (NaN for a zero input).

    Example:
      >>> d = decompose(1.0, "bf16")
      >>> d.sign, d.exponent, d.mantissa, d.kind
      ('0', '01111111', '0000000', 'normal')
    """

    value: float
    format: str
    stored: float
    code: int
    sign: str
    exponent: str
    mantissa: str
    kind: str
    abs_error: float
    rel_error: float

    @property
    def bits(self) -> str:
        """Sign, exponent and mantissa separated by spaces, e.g. '0 01111 1001100110'."""
        return " ".join(p for p in (self.sign, self.exponent, self.mantissa) if p)


def decompose(value: float, fmt: str | Format | Any) -> Decomposition:
    """Shows how ``value`` is stored in ``fmt``: bit fields, stored value and error.

    Host-side (NumPy + ml_dtypes, float64 input rounded once to the format); the "type a
    number, see its bits in each format" tool behind ``fmtkit inspect``.

    Args:
      value: a real number (Python float or NumPy scalar).
      fmt: format name, alias, dtype or Format.

    Returns:
      A ``Decomposition``.

    Example:
      >>> d = decompose(0.1, "fp16")
      >>> d.bits, d.stored
      ('0 01011 1001100110', 0.0999755859375)
    """
    fmt = get_format(fmt)
    v = float(value)
    with np.errstate(over="ignore", invalid="ignore"):
        stored_arr = np.asarray(v, np.float64).astype(fmt.dtype)
    stored = float(stored_arr.astype(np.float64))
    code = int(stored_arr.reshape(1).view(f"u{fmt.storage_bytes}")[0])
    m, e = fmt.mantissa_bits, fmt.exponent_bits
    mant_bits = code & ((1 << m) - 1)
    exp_bits = (code >> m) & ((1 << e) - 1)
    sign = str((code >> (m + e)) & 1) if fmt.signed else ""
    mantissa = format(mant_bits, f"0{m}b") if m else ""
    exponent = format(exp_bits, f"0{e}b")
    if np.isnan(stored):
        kind = "nan"
    elif np.isinf(stored):
        kind = "inf"
    elif stored == 0:
        kind = "zero"
    elif abs(stored) < fmt.min_normal:
        kind = "subnormal"
    else:
        kind = "normal"
    if np.isnan(v) and not np.isnan(stored):
        kind += " (NaN not representable)"
    elif np.isfinite(v) and v != 0:
        if not np.isfinite(stored) or (abs(v) > fmt.max and abs(stored) == fmt.max):
            kind += " (overflow)"
        elif stored == 0:
            kind += " (underflow)"
    abs_err = abs(stored - v) if np.isfinite(stored) or not np.isfinite(v) else float("inf")
    if np.isnan(v) or np.isnan(stored):
        abs_err = float("nan")
    elif np.isinf(v) and stored == v:
        abs_err = 0.0
    rel_err = abs_err / abs(v) if v != 0 and np.isfinite(v) else float("nan")
    return Decomposition(v, fmt.name, stored, code, sign, exponent, mantissa, kind,
                         abs_err, rel_err)
