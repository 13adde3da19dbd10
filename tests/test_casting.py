"""Casting: exhaustive code round trips, RNE bit-identity with ml_dtypes, overflow policy,
stochastic rounding and round-toward-zero against neighbours computed from the code table.

Every expected value comes from ml_dtypes' casts, the bit-field decoder in ``format_refs``
(float64 NumPy) or a hand derivation from the spec; nothing is computed by fmtkit itself.

XLA on CPU takes about a second to compile each stochastic cast (the PRNG), so the tests
share a few jitted functions that cast row i of a [formats, row] array to format i for
several (rounding, overflow) pairs at once, and index the cached results per format.
"""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from format_refs import (
    LAYOUTS,
    NARROW_NAMES,
    all_codes,
    decode,
    finite_grid,
    ml_cast,
    ml_decode,
    same_bits_or_both_nan,
    uint_type,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtkit.casting import cast as fm_cast
from fmtkit.casting import check_floating, saturate
from fmtkit.formats import FORMATS

# NumPy warns when a cast meets NaN or overflows (f64 NaN -> f32, f32 -> e4m3fn beyond 464, NaN
# codes -> f64); NaN codes and overflow are exactly what these tests feed in.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
]

F32_MAX = float(np.finfo(np.float32).max)
NO_NAN_NAMES = tuple(n for n in NARROW_NAMES if not FORMATS[n].has_nan)  # FP6, FP4
FP6_NAMES = ("float6_e2m3fn", "float6_e3m2fn")

NEAREST = (("nearest", "inf_or_nan"), ("nearest", "saturate"))
GRID = (("stochastic", "inf_or_nan"), ("stochastic", "saturate"), ("toward_zero", "inf_or_nan"))
SR, SR_SAT, TZ = GRID
RNE_ROW = 1 << 20  # >= 10^6 values per format
ROW = 1 << 17


def codes_of(arr, name):
    return np.asarray(arr).view(uint_type(LAYOUTS[name].dtype))


def _signed(name, x):
    return np.concatenate([x, -x]) if FORMATS[name].signed else x


@functools.cache
def _group_fn(combos):
    def f(xs, key):
        return tuple(
            tuple(fm_cast(xs[c, i], name, rounding=r, overflow=o,
                          key=key if r == "stochastic" else None)
                  for i, name in enumerate(NARROW_NAMES))
            for c, (r, o) in enumerate(combos))
    return jax.jit(f)


def run_group(combos, row, inputs, key=None):
    """inputs: {(rounding, overflow): {name: f32 array}} -> the same nesting of fmtkit casts
    (NumPy arrays of each format). Rows are zero-padded to ``row``; the stochastic draws of a
    row depend only on (key, row), as for a single cast of a [row] array."""
    xs = np.zeros((len(combos), len(NARROW_NAMES), row), np.float32)
    for c, combo in enumerate(combos):
        for i, name in enumerate(NARROW_NAMES):
            arr = inputs.get(combo, {}).get(name)
            if arr is not None:
                assert arr.size <= row
                xs[c, i, :arr.size] = arr
    key = jax.random.key(0) if key is None else key
    out = _group_fn(combos)(jnp.asarray(xs), key)
    return {combo: {name: np.asarray(out[combos.index(combo)][NARROW_NAMES.index(name)])[
        :arr.size] for name, arr in per_fmt.items()} for combo, per_fmt in inputs.items()}


@functools.partial(jax.jit, static_argnames=("fmt", "rounding", "overflow"))
def jcast(x, key=None, *, fmt, rounding="nearest", overflow="inf_or_nan"):
    return fm_cast(x, fmt, rounding=rounding, key=key, overflow=overflow)


# ----------------------------------------------------------------------------------------------
# Exhaustive decode / re-encode of every code.


@functools.cache
def _decoded():
    """fmtkit's decode of every code of every format: cast(codes as the format, "float32").
    XLA's CPU backend cannot compile any conversion from FP6 ("Invalid bitcast i6 to i8"),
    so fmtkit raises a clear TypeError there (test_fp6_decode_raises_clearly_on_cpu) and FP6
    codes are decoded on the host (ml_dtypes) for the remaining checks."""
    def run(names):
        arrays = tuple(jnp.asarray(all_codes(n).view(LAYOUTS[n].dtype)) for n in names)
        out = jax.jit(lambda xs: tuple(fm_cast(a, "float32") for a in xs))(arrays)
        return dict(zip(names, (np.asarray(o) for o in out)))
    return run, run(tuple(n for n in NARROW_NAMES if n not in FP6_NAMES))


def decoded(name):
    run, table = _decoded()
    if name in table:
        return table[name]
    if jax.default_backend() == "cpu" and name in FP6_NAMES:
        return all_codes(name).view(LAYOUTS[name].dtype).astype(np.float32)
    return run((name,))[name]


@pytest.mark.parametrize("name", FP6_NAMES)
def test_fp6_decode_raises_clearly_on_cpu(name):
    if jax.default_backend() != "cpu":
        pytest.skip("the FP6 decode limitation is XLA CPU's")
    x = jnp.asarray(all_codes(name).view(LAYOUTS[name].dtype))
    with pytest.raises(TypeError, match="cannot convert from FP6"):
        fm_cast(x, "float32")


@functools.cache
def _reencoded():
    """fmtkit's encode of every code's value (decoded independently, as f32)."""
    with np.errstate(invalid="ignore"):  # NaN f64 -> f32
        arrays = tuple(jnp.asarray(decode(n, all_codes(n)).astype(np.float32))
                       for n in NARROW_NAMES)
    out = jax.jit(lambda xs: tuple(fm_cast(a, n) for a, n in zip(xs, NARROW_NAMES)))(arrays)
    return dict(zip(NARROW_NAMES, (np.asarray(o) for o in out)))


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_decode_every_code(name):
    codes = all_codes(name)
    assert len(codes) == {16: 65536, 8: 256, 6: 64, 4: 16}[LAYOUTS[name].bits]
    got = decoded(name)
    assert got.dtype == np.float32
    # Against the bit-field decoder (NaN where the spec says NaN, else the exact value).
    np.testing.assert_array_equal(got.astype(np.float64), decode(name, codes))
    # Against ml_dtypes' own decode, bit for bit (signed zeros included).
    want = ml_decode(name, codes).astype(np.float32)
    assert same_bits_or_both_nan(got, want).all()


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_reencode_every_code(name):
    lay = LAYOUTS[name]
    codes = all_codes(name)
    values = decode(name, codes)
    is_nan = np.isnan(values)
    assert (values.astype(np.float32).astype(np.float64)[~is_nan] == values[~is_nan]).all()
    got = _reencoded()[name]
    assert got.dtype == lay.dtype
    np.testing.assert_array_equal(codes_of(got, name)[~is_nan], codes[~is_nan])
    assert np.isnan(got[is_nan].astype(np.float64)).all()
    if lay.encoding == "fnuz":
        assert is_nan[0x80] and is_nan.sum() == 1  # the -0 code is the only NaN


# Spot checks by code point, from the specs (hand-derived values).
SPOT = [
    ("float8_e4m3fn", 0x7E, 448.0), ("float8_e4m3fn", 0x7F, np.nan),
    ("float8_e4m3fn", 0xFF, np.nan),
    ("float8_e4m3fn", 0xFE, -448.0), ("float8_e4m3fn", 0x38, 1.0), ("float8_e4m3fn", 0x01, 2.0**-9),
    ("float8_e4m3fn", 0x08, 2.0**-6), ("float8_e4m3fn", 0x80, -0.0), ("float8_e4m3fn", 0x78, 256.0),
    ("float8_e5m2", 0x7B, 57344.0), ("float8_e5m2", 0x7C, np.inf), ("float8_e5m2", 0xFC, -np.inf),
    ("float8_e5m2", 0x7D, np.nan), ("float8_e5m2", 0x7F, np.nan), ("float8_e5m2", 0x3C, 1.0),
    ("float8_e5m2", 0x01, 2.0**-16), ("float8_e5m2", 0x04, 2.0**-14),
    ("float8_e4m3fnuz", 0x80, np.nan), ("float8_e4m3fnuz", 0x7F, 240.0),
    ("float8_e4m3fnuz", 0x40, 1.0), ("float8_e4m3fnuz", 0x01, 2.0**-10),
    ("float8_e4m3fnuz", 0xFF, -240.0),
    ("float8_e5m2fnuz", 0x80, np.nan), ("float8_e5m2fnuz", 0x7F, 57344.0),
    ("float8_e5m2fnuz", 0x40, 1.0), ("float8_e5m2fnuz", 0x01, 2.0**-17),
    ("float8_e4m3b11fnuz", 0x80, np.nan), ("float8_e4m3b11fnuz", 0x7F, 30.0),
    ("float8_e4m3b11fnuz", 0x58, 1.0), ("float8_e4m3b11fnuz", 0x01, 2.0**-13),
    ("float8_e3m4", 0x30, 1.0), ("float8_e3m4", 0x6F, 15.5), ("float8_e3m4", 0x70, np.inf),
    ("float8_e3m4", 0x71, np.nan), ("float8_e3m4", 0x01, 2.0**-6),
    ("float8_e4m3", 0x38, 1.0), ("float8_e4m3", 0x77, 240.0), ("float8_e4m3", 0x78, np.inf),
    ("float8_e4m3", 0x79, np.nan), ("float8_e4m3", 0x7E, np.nan), ("float8_e4m3", 0x01, 2.0**-9),
    ("float8_e8m0fnu", 0x7F, 1.0), ("float8_e8m0fnu", 0xFF, np.nan), ("float8_e8m0fnu", 0x80, 2.0),
    ("float8_e8m0fnu", 0x00, 2.0**-127), ("float8_e8m0fnu", 0xFE, 2.0**127),
    ("float4_e2m1fn", 0x7, 6.0), ("float4_e2m1fn", 0x1, 0.5), ("float4_e2m1fn", 0x2, 1.0),
    ("float4_e2m1fn", 0x5, 3.0), ("float4_e2m1fn", 0x8, -0.0), ("float4_e2m1fn", 0xF, -6.0),
    ("float6_e2m3fn", 0x1F, 7.5), ("float6_e2m3fn", 0x01, 0.125), ("float6_e2m3fn", 0x08, 1.0),
    ("float6_e2m3fn", 0x3F, -7.5), ("float6_e3m2fn", 0x1F, 28.0), ("float6_e3m2fn", 0x01, 0.0625),
    ("float6_e3m2fn", 0x0C, 1.0), ("float6_e3m2fn", 0x20, -0.0),
    ("float16", 0x7BFF, 65504.0), ("float16", 0x7C00, np.inf), ("float16", 0x3C00, 1.0),
    ("float16", 0x0001, 2.0**-24), ("float16", 0x0400, 2.0**-14), ("float16", 0x7E00, np.nan),
    ("float16", 0x8000, -0.0),
    ("bfloat16", 0x7F7F, 3.3895313892515355e38), ("bfloat16", 0x7F80, np.inf),
    ("bfloat16", 0x3F80, 1.0), ("bfloat16", 0x0001, 2.0**-133), ("bfloat16", 0x7FC0, np.nan),
]


@pytest.mark.parametrize(("name", "code", "value"), SPOT)
def test_spot_code_points(name, code, value):
    code_arr = np.array([code], uint_type(LAYOUTS[name].dtype))
    assert np.isnan(decode(name, code_arr)[0]) if np.isnan(value) else (
        decode(name, code_arr)[0] == value)
    got = np.float64(decoded(name)[code])
    ref = ml_decode(name, code_arr)[0]
    if np.isnan(value):
        assert np.isnan(got) and np.isnan(ref)
        return
    assert got == value and ref == value
    assert np.signbit(got) == np.signbit(value)
    # Encoding direction: the value maps back to exactly this code.
    assert codes_of(_reencoded()[name], name)[code] == code


# ----------------------------------------------------------------------------------------------
# Round to nearest even (bit-identical to ml_dtypes) and the overflow policy, on one set of
# RNE_ROW inputs per format, cast under both overflow policies at once.


def _ties(name):
    """Midpoints between adjacent finite values (float64), all exactly representable in f32."""
    grid = finite_grid(name)
    mids = (grid[:-1] + grid[1:]) / 2
    assert (mids.astype(np.float32).astype(np.float64) == mids).all()  # exact ties in f32
    return mids, grid


def _overflowing(name):
    """Positive finite f32 values beyond max + half an ulp of the top binade (RNE overflow)."""
    fmt, lay = FORMATS[name], LAYOUTS[name]
    top_exp = np.floor(np.log2(fmt.max))
    half_ulp = 2.0 ** (top_exp - lay.mantissa_bits - 1)
    cand = np.array([2 * fmt.max, 1.5 * fmt.max, 1e4 * fmt.max, fmt.max + 3 * half_ulp, F32_MAX])
    with np.errstate(over="ignore"):
        c32 = cand.astype(np.float32)
    c32 = c32[np.isfinite(c32)]
    return c32[c32.astype(np.float64) > fmt.max + half_ulp]


def _overflow_case(name):
    """(overflowing finite values, in-range values incl. the extremes, [±NaN, ±inf])."""
    fmt = FORMATS[name]
    over = _signed(name, _overflowing(name))
    inside = _signed(name, np.array([fmt.max, fmt.min_subnormal, fmt.min_normal, 1.0],
                                    np.float32))
    return over, inside, np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32)


def _rne_inputs(name, seed=0):
    """RNE_ROW f32 values: every exact tie (first) and its f32 neighbours, values around max,
    specials, the overflow case (last), and the rest random: half log-uniform over the range
    (subnormals to beyond max), half random bit patterns (all of f32)."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    mids, _ = _ties(name)
    mids32 = np.concatenate([mids, -mids]).astype(np.float32)
    near = np.concatenate([mids32, np.nextafter(mids32, np.float32(np.inf)),
                           np.nextafter(mids32, np.float32(-np.inf))])
    top = np.float32(fmt.max)
    around_max = top + np.arange(-64, 65, dtype=np.float32) * np.spacing(top)
    specials = np.array([0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-126, -(2.0**-126),
                         F32_MAX, -F32_MAX], np.float32)
    tail = np.concatenate(_overflow_case(name))
    n_rest = RNE_ROW - near.size - 2 * around_max.size - specials.size - tail.size
    lo, hi = np.log2(fmt.min_subnormal) - 3, min(np.log2(fmt.max) + 3, 127.9)
    mag = np.exp2(rng.uniform(lo, hi, n_rest // 2))
    logu = (mag * rng.choice([-1.0, 1.0], mag.size)).astype(np.float32)
    bits = rng.integers(0, 2**32, n_rest - n_rest // 2, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([near, logu, bits.view(np.float32), around_max, -around_max,
                           specials, tail])


@functools.cache
def _nearest():
    inputs = {n: _rne_inputs(n) for n in NARROW_NAMES}
    out = run_group(NEAREST, RNE_ROW, {combo: inputs for combo in NEAREST})
    return inputs, out


def _overflow_split(name, policy):
    _, out = _nearest()
    over, inside, special = _overflow_case(name)
    got = out[("nearest", policy)][name][-(over.size + inside.size + special.size):]
    return (over, got[:over.size]), (inside, got[over.size:-4]), got[-4:]


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_nearest_is_bit_identical_to_ml_dtypes(name):
    inputs, out = _nearest()
    x, got = inputs[name], out[NEAREST[0]][name]
    assert x.size >= 1_000_000
    want = ml_cast(x, name)
    assert got.dtype == want.dtype
    if FORMATS[name].has_nan:
        ok = same_bits_or_both_nan(got, want)
    else:  # no NaN encoding: bit-identical on non-NaN inputs (NaN inputs: separate test)
        keep = ~np.isnan(x)
        x, got, want = x[keep], got[keep], want[keep]
        ok = codes_of(got, name) == codes_of(want, name)
    bad = np.flatnonzero(~ok)
    assert bad.size == 0, (
        f"{bad.size} mismatches, e.g. x={x[bad[:5]]!r} got={codes_of(got, name)[bad[:5]]} "
        f"want={codes_of(want, name)[bad[:5]]}")


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_saturate_equals_rne_of_the_clipped_value(name):
    """overflow="saturate" on the same 10^6 inputs: for finite x it is RNE(clip(x, ±max))."""
    fmt = FORMATS[name]
    inputs, out = _nearest()
    x, got = inputs[name], out[NEAREST[1]][name]
    finite = np.isfinite(x)
    want = ml_cast(np.clip(x[finite], -fmt.max, fmt.max), name)
    ok = same_bits_or_both_nan(got[finite], want)
    bad = np.flatnonzero(~ok)
    assert bad.size == 0, (
        f"{bad.size} mismatches, e.g. x={x[finite][bad[:5]]!r} "
        f"got={codes_of(got[finite], name)[bad[:5]]} want={codes_of(want, name)[bad[:5]]}")


@pytest.mark.parametrize("name", [n for n in NARROW_NAMES if n != "float8_e8m0fnu"])
def test_exact_ties_round_to_even_code(name):
    """Hand rule: a tie goes to the neighbour whose mantissa LSB is 0 (E8M0 excluded: it has
    no mantissa)."""
    mids, grid = _ties(name)
    x = np.concatenate([mids, -mids]).astype(np.float32)
    inputs, out = _nearest()
    np.testing.assert_array_equal(inputs[name][:x.size], x)
    got = out[NEAREST[0]][name][:x.size]
    g64 = got.astype(np.float64)
    lo = np.concatenate([grid[:-1], -grid[1:]])
    hi = np.concatenate([grid[1:], -grid[:-1]])
    assert ((g64 == lo) | (g64 == hi)).all()
    assert (codes_of(got, name)[g64 != 0] & 1 == 0).all()
    assert (g64[np.abs(x) < grid[grid > 0].min()] == 0).all()


def test_e8m0_ties_round_up():
    """ml_dtypes rounds E8M0's midpoints 1.5 * 2^k up to 2^(k+1) (whatever the code parity);
    fmtkit must agree (bit-identity with ml_dtypes)."""
    mids, grid = _ties("float8_e8m0fnu")
    _, out = _nearest()
    got = out[NEAREST[0]]["float8_e8m0fnu"][:mids.size].astype(np.float64)
    np.testing.assert_array_equal(got, grid[1:])


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_saturate_gives_max_for_finite_overflow(name):
    fmt = FORMATS[name]
    (over, got), (inside, got_in), _ = _overflow_split(name, "saturate")
    assert over.size >= 1
    np.testing.assert_array_equal(got.astype(np.float64), np.sign(over) * fmt.max)
    # In-range values (max, smallest subnormal, smallest normal, 1) are untouched.
    np.testing.assert_array_equal(codes_of(got_in, name), codes_of(ml_cast(inside, name), name))


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_inf_or_nan_overflow(name):
    fmt, lay = FORMATS[name], LAYOUTS[name]
    (over, got), (inside, got_in), _ = _overflow_split(name, "inf_or_nan")
    g = got.astype(np.float64)
    if lay.encoding == "ieee":
        np.testing.assert_array_equal(g, np.sign(over) * np.inf)
    elif lay.encoding in ("fn", "fnuz", "e8m0"):
        assert np.isnan(g).all()
    else:  # FP6/FP4 have neither: ml_dtypes saturates
        np.testing.assert_array_equal(g, np.sign(over) * fmt.max)
    np.testing.assert_array_equal(codes_of(got_in, name), codes_of(ml_cast(inside, name), name))


@pytest.mark.parametrize("policy", ["saturate", "inf_or_nan"])
@pytest.mark.parametrize("name", NARROW_NAMES)
def test_non_finite_inputs_stay_non_finite(name, policy):
    """NaN of either sign stays NaN; inf stays inf where the format has inf, becomes NaN where
    it has only NaN, and ±max in FP6/FP4 (which have neither; as ml_dtypes does)."""
    fmt, lay = FORMATS[name], LAYOUTS[name]
    *_, got = _overflow_split(name, policy)
    g = got.astype(np.float64)
    if fmt.has_nan:
        assert np.isnan(g[:2]).all()
    if lay.encoding == "ieee":
        np.testing.assert_array_equal(g[2:], [np.inf, -np.inf])
    elif fmt.has_nan:
        assert np.isnan(g[2:]).all()
    else:
        np.testing.assert_array_equal(g[2:], [fmt.max, -fmt.max])


def test_saturate_helper_in_float32_terms():
    fmt = FORMATS["float8_e4m3fn"]
    x = jnp.asarray(np.array([1e6, -1e6, 300.0, np.nan, np.inf], np.float32))
    got = np.asarray(saturate(x, fmt))
    np.testing.assert_array_equal(got[:3], [448.0, -448.0, 300.0])
    assert np.isnan(got[3]) and got[4] == np.inf  # non-finite left for the cast to decide
    got = np.asarray(saturate(x, FORMATS["float4_e2m1fn"]))
    np.testing.assert_array_equal(got[[0, 1, 2, 4]], [6.0, -6.0, 6.0, 6.0])


# Small inputs: every format in one jitted function of a [64] array.
@functools.cache
def _all_formats_64():
    return jax.jit(lambda x: tuple(fm_cast(x, n) for n in NARROW_NAMES))


def cast64(x):
    x = np.asarray(x, np.float32)
    assert x.size <= 64
    out = _all_formats_64()(jnp.asarray(np.pad(x, (0, 64 - x.size))))
    return {n: np.asarray(o)[:x.size] for n, o in zip(NARROW_NAMES, out)}


@pytest.mark.parametrize("name", NO_NAN_NAMES)
@pytest.mark.parametrize("sign_bit", [0, 1])
def test_nan_in_formats_without_nan_matches_ml_dtypes(name, sign_bit):
    """ml_dtypes maps NaN to a zero in FP6/FP4 (the sign is flipped: +NaN -> -0, -NaN -> +0)."""
    payload = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF], np.uint32) | np.uint32(
        sign_bit << 31)
    x = payload.view(np.float32)
    want = ml_cast(x, name)
    assert (want.astype(np.float64) == 0).all()
    np.testing.assert_array_equal(codes_of(cast64(x)[name], name), codes_of(want, name))


@settings(max_examples=30, deadline=None)
@given(x=hnp.arrays(np.float32, 64, elements=st.floats(width=32, allow_subnormal=True)))
def test_property_nearest_matches_ml_dtypes(x):
    out = cast64(x)
    for name in NARROW_NAMES:
        got, want = out[name], ml_cast(x, name)
        if not FORMATS[name].has_nan:
            keep = ~np.isnan(x)
            got, want = got[keep], want[keep]
        assert same_bits_or_both_nan(got, want).all(), name


@settings(max_examples=20, deadline=None)
@given(x=hnp.arrays(np.float32, 64, elements=st.floats(width=32, allow_nan=False)))
def test_property_nearest_is_monotone(x):
    out = cast64(np.sort(x))
    for name in NARROW_NAMES:
        got = out[name].astype(np.float64)
        got = got[~np.isnan(got)]  # overflow to NaN (FN/FNUZ/E8M0) is at the ends only
        assert (got[1:] >= got[:-1]).all(), name


NARROW_SOURCES = (np.float16, ml_dtypes.bfloat16)
NARROW_TARGETS = ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "bfloat16", "float16")


@functools.cache
def _from_narrow_sources():
    x = np.random.default_rng(1).standard_normal(4096).astype(np.float32) * 8
    pairs = [(s, n) for s in NARROW_SOURCES for n in NARROW_TARGETS]
    srcs = {s: jnp.asarray(x.astype(s)) for s in NARROW_SOURCES}
    out = jax.jit(lambda d: tuple(fm_cast(d[np.dtype(s).name], n) for s, n in pairs))(
        {np.dtype(s).name: a for s, a in srcs.items()})
    return x, dict(zip(pairs, (np.asarray(o) for o in out)))


@pytest.mark.parametrize("src", NARROW_SOURCES)
@pytest.mark.parametrize("name", NARROW_TARGETS)
def test_narrow_inputs_cast_like_ml_dtypes(src, name):
    x, out = _from_narrow_sources()
    want = ml_cast(x.astype(src).astype(np.float32), name)  # src -> f32 is exact
    np.testing.assert_array_equal(codes_of(out[(src, name)], name), codes_of(want, name))


def test_float32_target_is_identity():
    bits = np.random.default_rng(2).integers(0, 2**32, 100_000, dtype=np.uint64)
    x = bits.astype(np.uint32).view(np.float32)
    got = np.asarray(jcast(jnp.asarray(x), fmt="float32"))
    finite = np.isfinite(x)
    np.testing.assert_array_equal(got.view(np.uint32)[finite], x.view(np.uint32)[finite])
    assert np.isnan(got[np.isnan(x)]).all()
    np.testing.assert_array_equal(got[np.isinf(x)], x[np.isinf(x)])


# ----------------------------------------------------------------------------------------------
# Stochastic rounding and round-toward-zero against neighbours from the code table.

SR_KEY = jax.random.key(7)
DRAWS = 8192


def _sr_range(name):
    """log2 bounds of magnitudes to test: [smallest subnormal, max]. E8M0 starts at 2^-126
    (fmtkit documents that f32-subnormal inputs fall back to nearest there)."""
    fmt = FORMATS[name]
    lo = -126.0 if name == "float8_e8m0fnu" else np.log2(fmt.min_subnormal)
    return lo, np.log2(fmt.max)


def _sr_inputs(name, n, seed):
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    lo, hi = _sr_range(name)
    mag = np.exp2(rng.uniform(lo, hi, n))
    x = mag * (rng.choice([-1.0, 1.0], n) if fmt.signed else 1.0)
    return np.clip(x.astype(np.float32), -fmt.max, fmt.max)


def _neighbours(name, x):
    """(lower, upper) grid values around x (float64); equal when x is representable."""
    grid = finite_grid(name)
    x64 = x.astype(np.float64)
    i = np.searchsorted(grid, x64, side="right") - 1
    assert (i >= 0).all()
    lower = grid[i]
    upper = np.where(lower == x64, lower, grid[np.minimum(i + 1, grid.size - 1)])
    assert ((lower <= x64) & (x64 <= upper)).all()
    return lower, upper


def _fixed_points(name):
    """A few f32 inputs between adjacent grid values at chosen fractions p, spread over the
    range (smallest subnormals, middle, near max; negated where signed)."""
    grid = finite_grid(name)
    pos = grid[grid > 0]
    if name == "float8_e8m0fnu":
        pos = pos[pos >= 2.0**-126]
    picks = [pos[0], pos[len(pos) // 2], pos[-2]]
    out = []
    for lo, p in zip(picks + picks, (0.5, 0.25, 0.125, 0.75, 0.9, 0.02)):
        hi = pos[np.searchsorted(pos, lo) + 1]
        out.append(np.float32(lo + p * (hi - lo)))
    x = np.array(out, np.float32)
    return np.concatenate([x, -x[:3]]) if FORMATS[name].signed else x


def _fixed_repeated(name):
    return np.repeat(_fixed_points(name)[None, :], DRAWS, axis=0).ravel()


def _representable(name):
    values = decode(name, all_codes(name))
    keep = np.isfinite(values)
    if name == "float8_e8m0fnu":
        keep &= values >= 2.0**-126  # see _sr_range
    return values[keep]


def _specials():
    return np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan], np.float32)


def _near_max(name):
    """Just above max, where the upper "neighbour" is not representable."""
    fmt, lay = FORMATS[name], LAYOUTS[name]
    top_ulp = 2.0 ** (np.floor(np.log2(fmt.max)) - lay.mantissa_bits)
    return _signed(name, np.full(4096, fmt.max + 0.75 * top_ulp, np.float32))


def _tz_inputs(name):
    return np.concatenate([_sr_inputs(name, 1 << 16, seed=4), _fixed_points(name),
                           _signed(name, _overflowing(name)), _specials()])


@functools.cache
def _grid_main():
    """Call A: random inputs (stochastic), above-max + specials (stochastic, saturate), the
    toward-zero inputs; all with SR_KEY."""
    inputs = {
        SR: {n: np.concatenate([_sr_inputs(n, ROW - 6, seed=3), _specials()])
             for n in NARROW_NAMES},
        SR_SAT: {n: np.concatenate([_near_max(n), _specials()]) for n in NARROW_NAMES},
        TZ: {n: _tz_inputs(n) for n in NARROW_NAMES},
    }
    return inputs, run_group(GRID, ROW, inputs, key=SR_KEY)


def _fixed_and_representable(seed):
    """Fixed points repeated DRAWS times (stochastic); representable values under stochastic
    + saturate and toward zero (both must leave them unchanged)."""
    inputs = {
        SR: {n: _fixed_repeated(n) for n in NARROW_NAMES},
        SR_SAT: {n: _representable(n).astype(np.float32) for n in NARROW_NAMES},
        TZ: {n: _representable(n).astype(np.float32) for n in NARROW_NAMES},
    }
    return run_group(GRID, ROW, inputs, key=jax.random.key(seed))


_grid_fixed = functools.cache(_fixed_and_representable)


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_stochastic_draws_are_neighbours_and_unbiased(name):
    inputs, out = _grid_main()
    x, got = inputs[SR][name][:-6], out[SR][name][:-6]
    assert got.dtype == LAYOUTS[name].dtype
    lower, upper = _neighbours(name, x)
    r = got.astype(np.float64)
    assert ((r == lower) | (r == upper)).all()
    # Unbiased: the up-rounding indicators are Bernoulli(p_i), p_i = (x - lo) / (hi - lo).
    inexact = lower != upper
    assert inexact.mean() > 0.5
    p = (x.astype(np.float64) - lower)[inexact] / (upper - lower)[inexact]
    up = (r == upper)[inexact]
    dev = np.sum(up - p)
    sigma = np.sqrt(np.sum(p * (1 - p)))
    assert abs(dev) <= 5 * sigma, (dev, sigma)  # 5 sigma of a sum of Bernoullis


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_stochastic_mean_of_many_draws_equals_input(name):
    x = _fixed_points(name)
    r = _grid_fixed(11)[SR][name].astype(np.float64).reshape(DRAWS, x.size)
    lower, upper = _neighbours(name, x)
    assert (lower < upper).all()  # every chosen point is strictly between two values
    assert ((r == lower) | (r == upper)).all()
    p = (x.astype(np.float64) - lower) / (upper - lower)
    sigma = (upper - lower) * np.sqrt(p * (1 - p) / DRAWS)  # std of the mean of DRAWS draws
    err = np.abs(r.mean(axis=0) - x.astype(np.float64))
    assert (err <= 5 * sigma).all(), (x, err / sigma)


def test_stochastic_same_key_same_result():
    again = _fixed_and_representable(11)  # not cached: a fresh run with the same key
    first = _grid_fixed(11)
    for name in NARROW_NAMES:
        np.testing.assert_array_equal(codes_of(again[SR][name], name),
                                      codes_of(first[SR][name], name))


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_stochastic_different_keys_different_draws(name):
    a = codes_of(_grid_fixed(11)[SR][name], name)
    c = codes_of(_grid_fixed(12)[SR][name], name)
    # Independent draws disagree where 0 < p < 1: expected fraction >= 2 p (1 - p) >= 0.04.
    assert (a != c).mean() > 0.1


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_representable_values_unchanged_by_stochastic_and_toward_zero(name):
    values = _representable(name)
    want = codes_of(ml_cast(values.astype(np.float32), name), name)
    for seed in (11, 12):
        for combo in (SR_SAT, TZ):
            got = _grid_fixed(seed)[combo][name]
            np.testing.assert_array_equal(got.astype(np.float64), values)
            np.testing.assert_array_equal(codes_of(got, name), want)


def test_stochastic_jit_and_eager_agree():
    name = "bfloat16"  # eager dispatch compiles every op: one format (the bit path) suffices
    inputs, out = _grid_main()
    x = inputs[SR][name]
    assert x.size == ROW  # the same [ROW] shape as the group's row, hence the same draws
    eager = fm_cast(jnp.asarray(x), name, rounding="stochastic", key=SR_KEY)
    np.testing.assert_array_equal(codes_of(eager, name), codes_of(out[SR][name], name))


def test_stochastic_under_vmap_over_keys():
    name = "float8_e4m3fn"  # the grid path; the PRNG batching is shared by all formats
    x = np.zeros(ROW, np.float32)
    x[:DRAWS * 9] = _fixed_repeated(name)[:DRAWS * 9]
    keys = jax.random.split(jax.random.key(3), 3)
    batched = jax.jit(jax.vmap(
        lambda k: fm_cast(jnp.asarray(x), name, rounding="stochastic", key=k)))(keys)
    for i in range(3):
        single = run_group(GRID, ROW, {SR: {name: x}}, key=keys[i])[SR][name]
        np.testing.assert_array_equal(codes_of(batched[i], name), codes_of(single, name))
    assert not np.array_equal(codes_of(batched[0], name), codes_of(batched[1], name))


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_stochastic_with_saturate_never_exceeds_max(name):
    inputs, out = _grid_main()
    x, got = inputs[SR_SAT][name][:-6], out[SR_SAT][name][:-6]
    np.testing.assert_array_equal(got.astype(np.float64), np.sign(x) * FORMATS[name].max)


@pytest.mark.parametrize("name", NARROW_NAMES)
def test_toward_zero_is_the_smaller_magnitude_neighbour(name):
    fmt = FORMATS[name]
    inputs, out = _grid_main()
    n_over = _signed(name, _overflowing(name)).size
    x, got = inputs[TZ][name][:-6 - n_over], out[TZ][name][:-6 - n_over]
    lower, upper = _neighbours(name, x)
    np.testing.assert_array_equal(got.astype(np.float64), np.where(x >= 0, lower, upper))
    # Beyond max: truncation gives ±max, never inf/NaN.
    over, got_over = inputs[TZ][name][-6 - n_over:-6], out[TZ][name][-6 - n_over:-6]
    np.testing.assert_array_equal(got_over.astype(np.float64), np.sign(over) * fmt.max)


@pytest.mark.parametrize("combo", GRID, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("name", NARROW_NAMES)
def test_zeros_infinities_nan_under_stochastic_and_toward_zero(name, combo):
    """Zeros stay zeros (signed as ml_dtypes casts them), inf as the format defines it (NaN
    where it has NaN but no inf, ±max in FP6/FP4), NaN stays NaN."""
    fmt, lay = FORMATS[name], LAYOUTS[name]
    got = _grid_main()[1][combo][name][-6:]
    g = got.astype(np.float64)
    want_zero = codes_of(ml_cast(_specials()[:2], name), name)
    np.testing.assert_array_equal(codes_of(got[:2], name), want_zero)
    if not fmt.signed:  # E8M0: no zero, no sign, no inf: all of these are NaN (as ml_dtypes)
        assert np.isnan(g).all()
        return
    assert (g[:2] == 0).all()
    if lay.encoding == "ieee":
        np.testing.assert_array_equal(g[2:4], [np.inf, -np.inf])
    elif fmt.has_nan:
        assert np.isnan(g[2:4]).all()
    else:
        np.testing.assert_array_equal(g[2:4], [fmt.max, -fmt.max])
    if fmt.has_nan:
        assert np.isnan(g[4:]).all()


# ----------------------------------------------------------------------------------------------
# Gradients: straight-through for every rounding mode.

GRAD_ROUNDINGS = ("nearest", "stochastic", "toward_zero")


@functools.cache
def _grads(names):
    """d/dx of sum_r sum_i sum(cast(x[r, i], fmt_i, rounding_r)): one compile for all."""
    pts = [_fixed_points(n) for n in names]
    width = max(p.size for p in pts)
    xs = np.zeros((len(GRAD_ROUNDINGS), len(names), width), np.float32)
    for i, p in enumerate(pts):
        xs[:, i, :p.size] = p

    def loss(v):
        total = jnp.float32(0)
        for r, rounding in enumerate(GRAD_ROUNDINGS):
            key = jax.random.key(0) if rounding == "stochastic" else None
            for i, name in enumerate(names):
                y = fm_cast(v[r, i], name, rounding=rounding, key=key)
                total = total + jnp.sum(y.astype(jnp.float32))
        return total

    g = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(xs)))
    return {(rounding, n): g[r, i] for r, rounding in enumerate(GRAD_ROUNDINGS)
            for i, n in enumerate(names)}


@pytest.mark.parametrize("rounding", GRAD_ROUNDINGS)
@pytest.mark.parametrize("name", NARROW_NAMES)
def test_gradient_is_straight_through(name, rounding):
    # FP6 runs on its own, so that a failure to compile its f32 convert stays contained.
    names = FP6_NAMES if name in FP6_NAMES else tuple(
        n for n in NARROW_NAMES if n not in FP6_NAMES)
    g = _grads(names)[(rounding, name)]
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g, np.ones(g.shape, np.float32))


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e5m2"])
def test_vjp_passes_the_cotangent_through(name):
    """A cotangent the format can hold comes back unchanged (as f32)."""
    x = jnp.asarray(np.linspace(-3, 3, 64, dtype=np.float32))
    ct_np = ml_cast(np.random.default_rng(0).standard_normal(64).astype(np.float32), name)
    _, vjp = jax.vjp(lambda v: fm_cast(v, name), x)
    (g,) = vjp(jnp.asarray(ct_np))
    np.testing.assert_array_equal(np.asarray(g), ct_np.astype(np.float32))


# ----------------------------------------------------------------------------------------------
# Bad input.


def test_integer_input_is_a_type_error_naming_x():
    with pytest.raises(TypeError, match=r"x must be a floating-point array, got dtype int32"):
        fm_cast(jnp.arange(4, dtype=jnp.int32), "e4m3")
    with pytest.raises(TypeError, match=r"x must be a floating-point array, got dtype bool"):
        fm_cast(np.array([True, False]), "bf16")


def test_check_floating_names_the_argument():
    with pytest.raises(TypeError, match=r"weights must be a floating-point array"):
        check_floating(np.arange(3), "weights")
    assert check_floating(np.ones(3, np.float16)).dtype == jnp.float16


def test_unknown_format_lists_valid_names():
    with pytest.raises(ValueError, match=r"Unknown format 'fp7'.*float8_e4m3fn.*float4_e2m1fn"):
        fm_cast(jnp.ones(3), "fp7")


def test_unknown_rounding_and_overflow():
    x = jnp.ones(3)
    with pytest.raises(ValueError, match=r"rounding must be one of .*'nearest'.*'stochastic'.*"
                       r"'toward_zero'.*got 'up'"):
        fm_cast(x, "e4m3", rounding="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"overflow must be one of .*'inf_or_nan'.*'saturate'"
                       r".*got 'clip'"):
        fm_cast(x, "e4m3", overflow="clip")  # type: ignore[arg-type]


def test_stochastic_without_key():
    with pytest.raises(ValueError, match=r"rounding='stochastic' needs a PRNG key"):
        fm_cast(jnp.ones(3), "bf16", rounding="stochastic")


def test_output_dtype_and_shape():
    x = jnp.ones((2, 3), jnp.float32)
    for name in NARROW_NAMES:
        for rounding in GRAD_ROUNDINGS:
            key = jax.random.key(0) if rounding == "stochastic" else None
            out = jax.eval_shape(
                lambda v, n=name, r=rounding, k=key: fm_cast(v, n, rounding=r, key=k), x)
            assert out.dtype == LAYOUTS[name].dtype and out.shape == (2, 3)
