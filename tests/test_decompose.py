"""decompose(): bit fields, stored values and errors, against values derived by hand.

Derivations (normal numbers: value = 2^(E - bias) * (1 + M / 2^m)):
  0.1 = 1.6 * 2^-4      fp16: E = 11, M = round(0.6 * 1024) = round(614.4) = 614
                        bf16: E = 123, M = round(0.6 * 128) = round(76.8) = 77
  12.345 = 1.543125 * 2^3   fp16: M = round(556.16) = 556; bf16: M = round(69.52) = 70
  70000 = 1.068115234375 * 2^16   fp16: above 65504 + 16 -> inf; bf16: M = round(8.71875) = 9
  1e-30 = 1.2676506... * 2^-100   fp16: below half the smallest subnormal (2^-25) -> 0;
                        bf16: E = 27, M = round(34.26) = 34
  3e-6 in fp16 is subnormal: 3e-6 / 2^-24 = 50.33 -> M = 50
"""

import math

import pytest

from fmtkit import decompose


@pytest.mark.parametrize(
    "value, fmt, bits, stored, kind",
    [
        (0.1, "fp16", "0 01011 1001100110", (1 + 614 / 1024) * 2**-4, "normal"),
        (0.1, "bf16", "0 01111011 1001101", (1 + 77 / 128) * 2**-4, "normal"),
        (12.345, "fp16", "0 10010 1000101100", (1 + 556 / 1024) * 8, "normal"),
        (12.345, "bf16", "0 10000010 1000110", (1 + 70 / 128) * 8, "normal"),
        (70000.0, "fp16", "0 11111 0000000000", math.inf, "inf (overflow)"),
        (70000.0, "bf16", "0 10001111 0001001", (1 + 9 / 128) * 2**16, "normal"),
        (1e-30, "fp16", "0 00000 0000000000", 0.0, "zero (underflow)"),
        (1e-30, "bf16", "0 00011011 0100010", (1 + 34 / 128) * 2**-100, "normal"),
        (3e-6, "fp16", "0 00000 0000110010", 50 * 2**-24, "subnormal"),
        (-2.0, "e4m3", "1 1000 000", -2.0, "normal"),
        (448.0, "e4m3", "0 1111 110", 448.0, "normal"),
        (1000.0, "e4m3", "0 1111 111", math.nan, "nan (overflow)"),
        (0.0, "bf16", "0 00000000 0000000", 0.0, "zero"),
        (0.3, "e8m0", "01111101", 0.25, "normal"),  # 2^(125 - 127)
        (5.0, "fp4", "0 11 0", 4.0, "normal"),
        (100.0, "fp4", "0 11 1", 6.0, "normal (overflow)"),
    ],
)
def test_hand_derived(value, fmt, bits, stored, kind):
    d = decompose(value, fmt)
    assert d.bits == bits
    assert d.kind == kind
    if math.isnan(stored):
        assert math.isnan(d.stored)
    else:
        assert d.stored == stored
    if math.isfinite(stored):
        assert d.abs_error == abs(stored - value)
        if value != 0:
            assert d.rel_error == abs(stored - value) / abs(value)


def test_overflow_and_nan_errors():
    d = decompose(70000.0, "fp16")
    assert d.abs_error == math.inf and d.rel_error == math.inf
    d = decompose(math.nan, "bf16")
    assert d.kind == "nan" and math.isnan(d.abs_error)
    d = decompose(math.nan, "fp4")  # FP4 has no NaN: ml_dtypes stores -0
    assert d.kind == "zero (NaN not representable)"
    assert d.code == 0b1000


def test_code_matches_fields():
    d = decompose(-0.1, "fp16")
    assert d.code == int(d.sign + d.exponent + d.mantissa, 2)
    assert d.sign == "1"


def test_unknown_format():
    with pytest.raises(ValueError, match="Valid names: float32"):
        decompose(1.0, "fp9")
