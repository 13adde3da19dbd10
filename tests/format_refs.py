"""Independent references for the format tests: bit layouts from the specs, NumPy decoders.

Nothing here imports fmtkit. The layouts are written from the specs (IEEE 754, OCP FP8 v1.0,
OCP MX v1.0 section 5, the ml_dtypes README for the FNUZ / IEEE-like FP8 variants), and the
decoder turns a code into a float64 value from its sign / exponent / mantissa fields alone, so
the tests can check fmtkit and ml_dtypes against a third derivation.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    """A format's bit layout and special-value encoding, as the spec defines it.

    encoding: "ieee" (all-ones exponent: inf if mantissa 0 else NaN), "fn" (no inf; all-ones
    exponent and mantissa is NaN), "fnuz" (no inf, no -0; the -0 code is the only NaN),
    "finite" (every code a number), "e8m0" (unsigned 2^(code - 127), 0xFF NaN).
    """

    dtype: np.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    encoding: str

    @property
    def bits(self) -> int:
        return self.exponent_bits + self.mantissa_bits + (0 if self.encoding == "e8m0" else 1)


LAYOUTS: dict[str, Layout] = {
    "float32": Layout(np.dtype(np.float32), 8, 23, 127, "ieee"),  # IEEE 754 binary32
    "float16": Layout(np.dtype(np.float16), 5, 10, 15, "ieee"),  # IEEE 754 binary16
    "bfloat16": Layout(np.dtype(ml_dtypes.bfloat16), 8, 7, 127, "ieee"),  # bfloat16
    "float8_e4m3fn": Layout(np.dtype(ml_dtypes.float8_e4m3fn), 4, 3, 7, "fn"),  # OCP FP8 E4M3
    "float8_e5m2": Layout(np.dtype(ml_dtypes.float8_e5m2), 5, 2, 15, "ieee"),  # OCP FP8 E5M2
    "float8_e4m3fnuz": Layout(np.dtype(ml_dtypes.float8_e4m3fnuz), 4, 3, 8, "fnuz"),
    "float8_e5m2fnuz": Layout(np.dtype(ml_dtypes.float8_e5m2fnuz), 5, 2, 16, "fnuz"),
    "float8_e4m3b11fnuz": Layout(np.dtype(ml_dtypes.float8_e4m3b11fnuz), 4, 3, 11, "fnuz"),
    "float8_e3m4": Layout(np.dtype(ml_dtypes.float8_e3m4), 3, 4, 3, "ieee"),
    "float8_e4m3": Layout(np.dtype(ml_dtypes.float8_e4m3), 4, 3, 7, "ieee"),
    "float6_e2m3fn": Layout(np.dtype(ml_dtypes.float6_e2m3fn), 2, 3, 1, "finite"),  # OCP MX FP6
    "float6_e3m2fn": Layout(np.dtype(ml_dtypes.float6_e3m2fn), 3, 2, 3, "finite"),  # OCP MX FP6
    "float4_e2m1fn": Layout(np.dtype(ml_dtypes.float4_e2m1fn), 2, 1, 1, "finite"),  # OCP MX FP4
    "float8_e8m0fnu": Layout(np.dtype(ml_dtypes.float8_e8m0fnu), 8, 0, 127, "e8m0"),  # MX scale
}
ALL_NAMES = tuple(LAYOUTS)
# Every format except float32, whose 2^32 codes are not enumerated.
NARROW_NAMES = tuple(n for n in ALL_NAMES if n != "float32")
EIGHT_BIT_NAMES = tuple(n for n in NARROW_NAMES if LAYOUTS[n].bits == 8)


def uint_type(dtype: np.dtype) -> type:
    return {1: np.uint8, 2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]


def all_codes(name: str) -> np.ndarray:
    """Every valid code of a narrow format as unsigned integers (FP6: 64 codes, FP4: 16)."""
    lay = LAYOUTS[name]
    return np.arange(2**lay.bits, dtype=np.uint32).astype(uint_type(lay.dtype))


def decode(name: str, codes: np.ndarray) -> np.ndarray:
    """Float64 values of ``codes``, derived from the bit fields alone (no ml_dtypes casts)."""
    lay = LAYOUTS[name]
    c = codes.astype(np.int64)
    if lay.encoding == "e8m0":
        return np.where(c == 255, np.nan, np.ldexp(1.0, c - lay.bias))
    e, m = lay.exponent_bits, lay.mantissa_bits
    sign = (c >> (e + m)) & 1
    exp = (c >> m) & (2**e - 1)
    man = c & (2**m - 1)
    magnitude = np.where(
        exp == 0,
        np.ldexp(man.astype(np.float64), 1 - lay.bias - m),  # subnormal: 0.m * 2^(1 - bias)
        np.ldexp(1.0 + man / 2.0**m, exp - lay.bias),  # normal: 1.m * 2^(exp - bias)
    )
    top = exp == 2**e - 1
    if lay.encoding == "ieee":
        magnitude = np.where(top & (man == 0), np.inf, magnitude)
        magnitude = np.where(top & (man != 0), np.nan, magnitude)
    elif lay.encoding == "fn":
        magnitude = np.where(top & (man == 2**m - 1), np.nan, magnitude)
    value = np.where(sign == 1, -magnitude, magnitude)
    if lay.encoding == "fnuz":
        value = np.where((sign == 1) & (exp == 0) & (man == 0), np.nan, value)
    return value


def ml_decode(name: str, codes: np.ndarray) -> np.ndarray:
    """Float64 values of ``codes`` according to ml_dtypes' own cast."""
    with np.errstate(invalid="ignore"):  # NaN codes warn on some ml_dtypes casts
        return codes.view(LAYOUTS[name].dtype).astype(np.float64)


def finite_grid(name: str) -> np.ndarray:
    """Sorted distinct finite values of a narrow format (float64), from the bit decoder."""
    v = decode(name, all_codes(name))
    return np.unique(v[np.isfinite(v)])


def ml_cast(x: np.ndarray, name: str) -> np.ndarray:
    """ml_dtypes' round-to-nearest-even cast (the bit-exactness reference)."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf / NaN is the point
        return np.asarray(x).astype(LAYOUTS[name].dtype)


def same_bits_or_both_nan(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elementwise: identical bit patterns, or both NaN (NaN payloads are not specified)."""
    ut = uint_type(want.dtype)
    g64 = np.asarray(got).astype(np.float64)
    w64 = np.asarray(want).astype(np.float64)
    return (np.asarray(got).view(ut) == np.asarray(want).view(ut)) | (
        np.isnan(g64) & np.isnan(w64))
