"""Format registry: fields derived from bit layouts, checked three ways.

References: ``ml_dtypes.finfo`` / ``np.finfo``; the code table decoded from the bit fields in
``format_refs.decode``; constants derived by hand from the specs (comments give the derivation).
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from format_refs import ALL_NAMES, LAYOUTS, NARROW_NAMES, all_codes, decode, ml_decode

import fmtkit.formats as formats_mod
from fmtkit.formats import FORMATS, Format, get_format


def _finfo(dtype):
    return np.finfo(dtype) if dtype in (np.float32, np.float16) else ml_dtypes.finfo(dtype)


def test_registry_holds_exactly_the_fourteen_formats():
    assert set(FORMATS) == set(ALL_NAMES)
    for name, fmt in FORMATS.items():
        assert isinstance(fmt, Format)
        assert fmt.name == name
        assert fmt.dtype == LAYOUTS[name].dtype


@pytest.mark.parametrize("name", ALL_NAMES)
def test_fields_match_finfo(name):
    fmt = FORMATS[name]
    fi = _finfo(fmt.dtype)
    assert fmt.max == float(fi.max)
    assert fmt.min_normal == float(fi.smallest_normal)
    assert fmt.min_subnormal == float(fi.smallest_subnormal)
    assert fmt.eps == float(fi.eps)
    assert fmt.mantissa_bits == fi.nmant
    assert fmt.exponent_bits == fi.nexp
    assert fmt.bits == fi.bits
    # smallest normal = 2^minexp, and minexp = 1 - bias (E8M0: exponent code 0 is 2^-bias).
    assert fmt.min_normal == 2.0**fi.minexp
    assert fmt.bias == (-fi.minexp if name == "float8_e8m0fnu" else 1 - fi.minexp)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_fields_match_spec_layout(name):
    lay, fmt = LAYOUTS[name], FORMATS[name]
    assert (fmt.exponent_bits, fmt.mantissa_bits, fmt.bias, fmt.bits) == (
        lay.exponent_bits, lay.mantissa_bits, lay.bias, lay.bits)
    assert fmt.eps == 2.0**-lay.mantissa_bits
    assert fmt.signed is (lay.encoding != "e8m0")


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_fields_match_decoded_code_table(name):
    """max / min_normal / min_subnormal / eps / specials read off all codes of the format."""
    fmt, lay = FORMATS[name], LAYOUTS[name]
    codes = all_codes(name)
    v = decode(name, codes)
    np.testing.assert_array_equal(v, ml_decode(name, codes))  # NaN == NaN in this helper
    finite = v[np.isfinite(v)]
    pos = finite[finite > 0]
    assert fmt.max == finite.max()
    assert -fmt.max == finite.min() or not fmt.signed
    assert fmt.min_subnormal == pos.min()
    exp_field = (codes.astype(np.int64) >> lay.mantissa_bits) & (2**lay.exponent_bits - 1)
    normal = np.isfinite(v) & (v > 0) & ((exp_field != 0) | (lay.encoding == "e8m0"))
    assert fmt.min_normal == v[normal].min()
    assert fmt.eps == pos[pos > 1.0].min() - 1.0
    assert fmt.has_inf == bool(np.isinf(v).any())
    assert fmt.has_nan == bool(np.isnan(v).any())
    assert fmt.has_negative_zero == bool(((v == 0) & np.signbit(v)).any())
    assert fmt.signed == bool((finite < 0).any())


# Hand derivations: max = 2^(emax - bias) * (2 - 2^-m), one mantissa code less where the top
# code is NaN (FN), one binade less where the all-ones exponent is inf/NaN (IEEE).
HAND_MAX = {
    "float32": (2 - 2.0**-23) * 2.0**127,  # 3.4028234663852886e38
    "float16": 65504.0,  # (2 - 2^-10) * 2^15
    "bfloat16": 3.3895313892515355e38,  # (2 - 2^-7) * 2^127
    "float8_e4m3fn": 448.0,  # 1.75 * 2^(15 - 7): 0x7F is NaN, so 0x7E is max
    "float8_e5m2": 57344.0,  # 1.75 * 2^(30 - 15)
    "float8_e4m3fnuz": 240.0,  # 1.875 * 2^(15 - 8)
    "float8_e5m2fnuz": 57344.0,  # 1.75 * 2^(31 - 16)
    "float8_e4m3b11fnuz": 30.0,  # 1.875 * 2^(15 - 11)
    "float8_e3m4": 15.5,  # 1.9375 * 2^(6 - 3)
    "float8_e4m3": 240.0,  # 1.875 * 2^(14 - 7)
    "float6_e2m3fn": 7.5,  # 1.875 * 2^(3 - 1)
    "float6_e3m2fn": 28.0,  # 1.75 * 2^(7 - 3)
    "float4_e2m1fn": 6.0,  # 1.5 * 2^(3 - 1)
    "float8_e8m0fnu": 2.0**127,  # code 254 = 2^(254 - 127); 255 is NaN
}
HAND_SPECIALS = {  # (has_inf, has_nan, has_negative_zero)
    "float32": (True, True, True),
    "float16": (True, True, True),
    "bfloat16": (True, True, True),
    "float8_e4m3fn": (False, True, True),
    "float8_e5m2": (True, True, True),
    "float8_e4m3fnuz": (False, True, False),
    "float8_e5m2fnuz": (False, True, False),
    "float8_e4m3b11fnuz": (False, True, False),
    "float8_e3m4": (True, True, True),
    "float8_e4m3": (True, True, True),
    "float6_e2m3fn": (False, False, True),
    "float6_e3m2fn": (False, False, True),
    "float4_e2m1fn": (False, False, True),
    "float8_e8m0fnu": (False, True, False),
}


@pytest.mark.parametrize("name", ALL_NAMES)
def test_hand_derived_constants(name):
    fmt = FORMATS[name]
    assert fmt.max == HAND_MAX[name]
    assert (fmt.has_inf, fmt.has_nan, fmt.has_negative_zero) == HAND_SPECIALS[name]


def test_hand_derived_small_constants():
    e4m3 = get_format("e4m3")
    assert (e4m3.min_normal, e4m3.min_subnormal, e4m3.eps) == (2.0**-6, 2.0**-9, 0.125)
    e5m2 = get_format("e5m2")
    assert (e5m2.min_normal, e5m2.min_subnormal, e5m2.eps) == (2.0**-14, 2.0**-16, 0.25)
    fp16 = get_format("fp16")
    assert (fp16.min_normal, fp16.min_subnormal) == (2.0**-14, 2.0**-24)
    bf16 = get_format("bf16")
    assert (bf16.min_normal, bf16.min_subnormal, bf16.eps) == (2.0**-126, 2.0**-133, 2.0**-7)
    fp4 = get_format("fp4")
    assert (fp4.min_normal, fp4.min_subnormal) == (1.0, 0.5)
    e8m0 = get_format("e8m0")
    assert (e8m0.min_normal, e8m0.min_subnormal) == (2.0**-127, 2.0**-127)


@pytest.mark.parametrize(("name", "storage", "bits"), [
    ("float32", 4, 32), ("float16", 2, 16), ("bfloat16", 2, 16), ("float8_e4m3fn", 1, 8),
    ("float8_e5m2", 1, 8), ("float6_e2m3fn", 1, 6), ("float6_e3m2fn", 1, 6),
    ("float4_e2m1fn", 1, 4), ("float8_e8m0fnu", 1, 8),
])
def test_storage_bytes_and_family(name, storage, bits):
    fmt = FORMATS[name]
    assert fmt.storage_bytes == storage
    assert fmt.bits == bits
    assert fmt.is_fp8_family == (bits <= 8)


@pytest.mark.parametrize(("alias", "name"), [
    ("fp32", "float32"), ("f32", "float32"), ("fp16", "float16"), ("f16", "float16"),
    ("half", "float16"), ("bf16", "bfloat16"), ("e4m3", "float8_e4m3fn"),
    ("e5m2", "float8_e5m2"), ("fp6_e2m3", "float6_e2m3fn"), ("fp6_e3m2", "float6_e3m2fn"),
    ("fp4", "float4_e2m1fn"), ("e8m0", "float8_e8m0fnu"), ("BF16", "bfloat16"),
    (" e4m3 ", "float8_e4m3fn"),
])
def test_aliases(alias, name):
    assert get_format(alias) is FORMATS[name]


def test_e4m3_alias_is_the_ocp_fn_variant_not_ieee_e4m3():
    # "e4m3" means OCP E4M3 (max 448), not the IEEE-like float8_e4m3 (max 240).
    assert get_format("e4m3").max == 448.0
    assert get_format("float8_e4m3").max == 240.0


@pytest.mark.parametrize("name", ALL_NAMES)
def test_get_format_by_name_dtype_and_format(name):
    fmt = FORMATS[name]
    assert get_format(name) is fmt
    assert get_format(fmt) is fmt
    assert get_format(LAYOUTS[name].dtype) is fmt  # np.dtype
    assert get_format(LAYOUTS[name].dtype.type) is fmt  # scalar type (np.float16, ml_dtypes)
    assert get_format(jnp.dtype(LAYOUTS[name].dtype)) is fmt


def test_get_format_on_jax_scalar_types():
    assert get_format(jnp.bfloat16) is FORMATS["bfloat16"]
    assert get_format(jnp.float8_e4m3fn) is FORMATS["float8_e4m3fn"]
    assert get_format(jnp.float32) is FORMATS["float32"]
    assert get_format(np.float16) is FORMATS["float16"]


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="Unknown format 'e9m9'") as info:
        get_format("e9m9")
    for name in ALL_NAMES:
        assert name in str(info.value)
    assert "bf16" in str(info.value)  # aliases are listed too


@pytest.mark.parametrize("dtype", [np.int32, np.float64, np.complex64, np.bool_])
def test_non_format_dtype_is_a_value_error(dtype):
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        get_format(dtype)


def test_non_dtype_object_is_a_type_error():
    with pytest.raises(TypeError, match="format name, Format or floating dtype"):
        get_format(3.5)


def test_format_is_hashable_and_a_valid_static_argument():
    fmts = {get_format("e4m3"), get_format("float8_e4m3fn"), get_format("e5m2")}
    assert len(fmts) == 2
    traces = []

    def f(x, fmt):
        traces.append(fmt.name)
        return x * jnp.float32(fmt.max)

    jf = jax.jit(f, static_argnums=1)
    assert float(jf(jnp.float32(1.0), get_format("e4m3"))) == 448.0
    assert float(jf(jnp.float32(1.0), get_format("float8_e4m3fn"))) == 448.0
    assert float(jf(jnp.float32(1.0), get_format("e5m2"))) == 57344.0
    assert traces == ["float8_e4m3fn", "float8_e5m2"]  # equal formats hit the cache


def test_format_is_frozen():
    fmt = get_format("e4m3")
    with pytest.raises(AttributeError):
        fmt.max = 1.0  # type: ignore[misc]


def test_jnp_dtype_round_trips():
    for name in ALL_NAMES:
        fmt = FORMATS[name]
        assert jnp.zeros((2,), fmt.jnp_dtype).dtype == fmt.dtype


def test_module_constants_are_read_only():
    with pytest.raises(TypeError):
        FORMATS["foo"] = FORMATS["float32"]  # type: ignore[index]
    assert set(formats_mod.ALIASES.values()) <= set(FORMATS)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_max_is_largest_value_below_next_binade(name):
    """max < 2^(floor(log2 max) + 1), and the top binade's exponent matches the layout."""
    fmt, lay = FORMATS[name], LAYOUTS[name]
    top_exp = math.floor(math.log2(fmt.max))
    assert fmt.max < 2.0 ** (top_exp + 1)
    all_ones = 2**lay.exponent_bits - 1
    # IEEE-like and E8M0 formats reserve the all-ones exponent; the others use it.
    expected_top = all_ones - 1 - lay.bias if lay.encoding in ("ieee", "e8m0") else (
        all_ones - lay.bias)
    assert top_exp == expected_top
