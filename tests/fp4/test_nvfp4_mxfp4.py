"""fmtkit.fp4: NVFP4 / MXFP4 quantization against the format definitions and ml_dtypes, the
random Hadamard transform, and the FP4 recipes' three GEMMs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jaxpr_utils import fp4_gemms, iter_eqns

from fmtkit import fp4, fp8

DN = (((1,), (0,)), ((), ()))
E2M1_POS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # OCP MX v1.0 table 5


def _e2m1_inputs() -> np.ndarray:
    """Every E2M1 value, every midpoint between neighbours (ties: RNE), the f32 neighbours of
    each midpoint, and points inside each interval, both signs, all within [-6, 6]."""
    mids = (E2M1_POS[1:] + E2M1_POS[:-1]) / 2
    up = np.nextafter(mids.astype(np.float32), np.float32(np.inf))
    down = np.nextafter(mids.astype(np.float32), np.float32(0))
    quarter = E2M1_POS[:-1] + (E2M1_POS[1:] - E2M1_POS[:-1]) / 4
    pos = np.concatenate([E2M1_POS, mids, up, down, quarter, [1e-30, 2.0**-126, 0.1]])
    return np.concatenate([pos, -pos, [-0.0]]).astype(np.float32)


def _unit_scale_tensor(vals: np.ndarray) -> np.ndarray:
    """Rows of 16: a 6.0 then 15 test values; a first row led by 6 * 448. Then the tensor
    scale is exactly 1 (s_enc = 6 * 448 / amax = 1), every test block's E4M3 scale is exactly
    6 / 6 * 1 = 1, and the quantized value of each test element is its plain E2M1 cast."""
    n = -(-len(vals) // 15) * 15
    body = np.concatenate([vals, np.zeros(n - len(vals), np.float32)]).reshape(-1, 15)
    rows = np.concatenate([np.full((len(body), 1), 6.0, np.float32), body], axis=1)
    first = np.zeros((1, 16), np.float32)
    first[0, 0] = 6.0 * 448
    return np.concatenate([first, rows])


def test_nvfp4_rne_is_bit_identical_to_ml_dtypes():
    x = _unit_scale_tensor(_e2m1_inputs())
    q = fp4.nvfp4_quantize(jnp.asarray(x))
    assert float(q.tensor_scale) == 1.0
    np.testing.assert_array_equal(np.asarray(q.block_scale, np.float32),
                                  np.r_[448.0, np.ones(len(x) - 1)][:, None])
    got = np.asarray(q.values).view(np.uint8)
    want = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(got[1:], want[1:])
    assert np.asarray(q.values, np.float32)[0, 0] == 6.0  # 2688 / 448


def test_mxfp4_rne_is_bit_identical_to_ml_dtypes_including_saturation():
    # Blocks of 32 whose amax lies in [4, 8): OCP's floor rule gives scale 2^(2 - 2) = 1, so
    # elements are plain E2M1 casts; (6, 8) saturates to 6 as ml_dtypes' cast does.
    vals = np.concatenate([_e2m1_inputs(), np.float32([6.5, 7.0, 7.99, -7.5])])
    n = -(-len(vals) // 31) * 31
    body = np.concatenate([vals, np.zeros(n - len(vals), np.float32)]).reshape(-1, 31)
    x = np.concatenate([np.full((len(body), 1), 4.0, np.float32), body], axis=1)
    q = fp4.mxfp4_quantize(jnp.asarray(x), scale_rounding="floor")
    np.testing.assert_array_equal(np.asarray(q.block_scale, np.float32), 1.0)
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8),
                                  x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))


def test_nvfp4_two_level_scale_hand_derived():
    # amax_t = 10: s_enc = 6 * 448 / 10 = 268.8, tensor scale 1 / 268.8.
    # Block 0 (amax 10): 10 / 6 * 268.8 = 448 -> E4M3 448; 10 * 268.8 / 448 = 6 -> code 6.
    # Block 1 (amax 1): 1 / 6 * 268.8 = 44.8 -> E4M3 44 (spacing 4 in [32, 64));
    #   encode 268.8 / 44 = 6.109: 1 -> 6.11 -> 6, 0.5 -> 3.05 -> 3, 0.25 -> 1.53 -> 1.5,
    #   0.1 -> 0.61 -> 0.5, 0.05 -> 0.305 -> 0.5, 0.04 -> 0.244 -> 0 (below 0.25: underflow).
    x = np.zeros((2, 16), np.float32)
    x[0, 0] = 10.0
    x[1, :6] = [1.0, 0.5, 0.25, 0.1, 0.05, -0.04]
    q = fp4.nvfp4_quantize(jnp.asarray(x))
    np.testing.assert_allclose(float(q.tensor_scale), 1 / 268.8, rtol=1e-7)
    assert np.asarray(q.block_scale, np.float32).ravel().tolist() == [448.0, 44.0]
    v = np.asarray(q.values, np.float32)
    assert v[0, 0] == 6.0
    assert v[1, :6].tolist() == [6.0, 3.0, 1.5, 0.5, 0.5, -0.0]
    np.testing.assert_allclose(np.asarray(q.dequantize())[1, :4],
                               np.array([6.0, 3.0, 1.5, 0.5]) * 44 / 268.8, rtol=1e-6)


def test_nvfp4_zero_underflow_and_2d_blocks():
    q = fp4.nvfp4_quantize(jnp.zeros((2, 32)))
    assert float(q.tensor_scale) == 1.0  # TE: s_enc = 1 for an all-zero tensor
    assert not np.asarray(q.dequantize()).any() and np.isfinite(np.asarray(q.dequantize())).all()
    # A block far below the tensor amax: 1e-3 / 6 * 1 rounds to E4M3 0 (min subnormal 2^-9),
    # so the block stores scale 0 and dequantizes to 0 (the hardware's underflow).
    x = np.zeros((2, 16), np.float32)
    x[0, 0], x[1, 0] = 6.0 * 448, 1e-3
    q = fp4.nvfp4_quantize(jnp.asarray(x))
    assert float(q.block_scale[1, 0].astype(jnp.float32)) == 0.0
    assert float(q.dequantize()[1, 0]) == 0.0
    # 16x16 blocks: one scale per tile, and the transpose quantizes to the transposed codes.
    w = np.random.default_rng(0).normal(size=(32, 48)).astype(np.float32)
    qw, qt = fp4.nvfp4_quantize(jnp.asarray(w), (16, 16)), fp4.nvfp4_quantize(
        jnp.asarray(w.T), (16, 16))
    assert qw.block_scale.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(qw.values).view(np.uint8).T,
                                  np.asarray(qt.values).view(np.uint8))


def test_mx_e8m0_scale_hand_derived():
    def one(amax, rule):
        x = np.zeros((1, 32), np.float32)
        x[0, 0] = amax
        q = fp4.mxfp4_quantize(jnp.asarray(x), scale_rounding=rule)
        return (float(q.block_scale.astype(jnp.float32)[0, 0]),
                float(q.values.astype(jnp.float32)[0, 0]))

    # floor (OCP): 2^(floor(log2 amax) - 2); rceil: 2^ceil(log2(amax / 6)).
    assert one(5.0, "floor") == (1.0, 4.0)  # 5 is the 4|6 tie: even mantissa, 4
    assert one(5.0, "rceil") == (1.0, 4.0)
    assert one(7.0, "floor") == (1.0, 6.0)  # saturates
    assert one(7.0, "rceil") == (2.0, 4.0)  # 3.5 -> 4 (tie 3|4 -> even)
    assert one(0.3, "floor") == (0.0625, 4.0)  # 0.3 / 2^-4 = 4.8 -> 4
    assert one(0.3, "rceil") == (0.0625, 4.0)  # ceil(log2 0.05) = -4
    assert one(0.0, "floor") == (1.0, 0.0)  # an all-zero block: scale 1
    q = fp4.mxfp4_quantize(jnp.asarray(np.r_[np.nan, np.zeros(31)].astype(np.float32)[None]))
    assert np.isnan(np.asarray(q.dequantize())).all()  # E8M0 NaN scale: the block is NaN


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours(kind):
    vals = np.float32([0.3, 1.2, 2.5, 5.0, -0.7, 3.9, 0.1, -4.4, 1.75])
    # Unit element scales (see _unit_scale_tensor): a block led by 6.0 in a tensor whose amax
    # is 6 * 448 (NVFP4), or a 32-block with amax 6 under the floor rule (MXFP4: 2^(2-2)).
    if kind == "nvfp4":
        x = np.zeros((2, 16), np.float32)
        x[0, 0] = 6.0 * 448
        quant = fp4.nvfp4_quantize
    else:
        x = np.zeros((2, 32), np.float32)
        x[0, 0] = 6.0
        quant = functools.partial(fp4.mxfp4_quantize, scale_rounding="floor")
    x[1, 0] = 6.0
    x[1, 1:1 + len(vals)] = vals
    n = 4000
    keys = jax.random.split(jax.random.key(0), n)
    draws = jax.jit(jax.vmap(lambda k: quant(jnp.asarray(x), rounding="stochastic",
                                             key=k).dequantize()))(keys)
    d = np.asarray(draws)[:, 1, 1:1 + len(vals)].astype(np.float64)
    a = np.abs(vals.astype(np.float64))
    lo = np.array([E2M1_POS[E2M1_POS <= v].max() for v in a])
    hi = np.array([E2M1_POS[E2M1_POS >= v].min() for v in a])
    for j in range(len(a)):  # every draw is one of the two neighbours, with x's sign
        assert set(np.unique(d[:, j] * np.sign(vals[j]))) <= {lo[j], hi[j]}, vals[j]
    p = (a - lo) / (hi - lo)
    sd = (hi - lo) * np.sqrt(p * (1 - p))  # one draw's standard deviation
    np.testing.assert_array_less(np.abs(d.mean(0) - vals), 5 * sd / np.sqrt(n) + 1e-6)
    # Deterministic given the key.
    k = jax.random.key(7)
    np.testing.assert_array_equal(np.asarray(quant(x, rounding="stochastic", key=k).values,
                                             np.float32),
                                  np.asarray(quant(x, rounding="stochastic", key=k).values,
                                             np.float32))


def test_rht_is_orthogonal_and_cancels_in_the_wgrad_product():
    h = fp4.hadamard_matrix(16)
    i, j = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    sylvester = (-1.0) ** np.vectorize(lambda v: bin(v).count("1"))(i & j) / 4
    np.testing.assert_array_equal(h, sylvester)
    r = fp4.rht_matrix(3)
    np.testing.assert_allclose(r @ r.T, np.eye(16), atol=1e-15)
    assert set(np.abs(r).ravel()) == {0.25}
    assert not np.array_equal(fp4.rht_matrix(3), fp4.rht_matrix(4))  # the seed matters
    np.testing.assert_array_equal(fp4.rht_matrix(3), fp4.rht_matrix(3))
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 64)), rng.normal(size=(7, 64))  # dyᵀ [N, M], xᵀ [K, M]
    blk = np.kron(np.eye(4), r)
    np.testing.assert_allclose((a @ blk) @ (b @ blk).T, a @ b.T, rtol=1e-12, atol=1e-12)
    got = np.asarray(fp4.random_hadamard_transform(jnp.asarray(a, jnp.float32), seed=3))
    np.testing.assert_allclose(got, a @ blk, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of size=16"):
        fp4.random_hadamard_transform(jnp.ones((2, 24)))


# ---------------------------------------------------------------------------------------------
# The recipes' GEMMs.


def _data(m=40, k=72, n=24, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=s), jnp.float32)
                 for s in ((m, k), (k, n), (m, n)))


@functools.cache
def _fwd_bwd(name):
    return _jit_fwd_bwd(fp4.RECIPES[name], *_data())


@functools.partial(jax.jit, static_argnums=0)
def _jit_fwd_bwd(recipe, x, w, dy):
    dg = fp4.dot_general_fn(recipe)
    y, vjp = jax.vjp(lambda x, w: dg(x, w, DN), x, w)
    return (y, *vjp(dy))


def _sqnr(ref, got):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return 10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2))


@pytest.mark.parametrize("name", list(fp4.RECIPES))
def test_recipes_track_float64(name):
    x, w, dy = (np.asarray(t, np.float64) for t in _data())
    y, dx, dw = _fwd_bwd(name)
    # E2M1 with 16/32-element scales: ~17 dB per operand (3-bit precision); SR adds variance.
    for ref, got in ((x @ w, y), (dy @ w.T, dx), (x.T @ dy, dw)):
        assert _sqnr(ref, got) > 11.0


def test_forward_equals_float64_product_of_the_quantized_operands():
    x, w, _ = _data()
    y = fp4.dot_general_fn("nvfp4")(x, w, DN)
    xq = fp4.nvfp4_quantize(jnp.pad(x, ((0, 0), (0, 8))))  # K padded 72 -> 80
    wq = fp4.nvfp4_quantize(jnp.pad(w.T, ((0, 8), (0, 8))), (16, 16))
    ref = np.asarray(xq.dequantize(), np.float64) @ np.asarray(wq.dequantize(), np.float64).T
    np.testing.assert_allclose(np.asarray(y), ref[:, :24], rtol=2e-5, atol=2e-5)


def test_scaled_matmul_path_equals_emulation():
    inter = dataclasses.replace(fp4.RECIPES["nvfp4"], use_kernel="interpret")
    for a, b in zip(_jit_fwd_bwd(inter, *_data()), _fwd_bwd("nvfp4")):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_ingredients_change_what_they_should():
    y, dx, dw = _fwd_bwd("nvfp4")
    y2, dx2, dw2 = _fwd_bwd("nvfp4-no-rht")  # RHT only on the wgrad inputs
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx2))
    assert not np.array_equal(np.asarray(dw), np.asarray(dw2))
    y3, dx3, _ = _fwd_bwd("nvfp4-no-sr")  # SR only on the gradients
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y3))
    assert not np.array_equal(np.asarray(dx), np.asarray(dx3))
    y4, _, _ = _fwd_bwd("nvfp4-no-2d")  # 1x16 weight blocks: a different forward
    assert not np.array_equal(np.asarray(y), np.asarray(y4))
    # Reproducible: the same recipe and data give the same SR draws.
    again = _jit_fwd_bwd(fp4.RECIPES["nvfp4"], *_data())
    np.testing.assert_array_equal(np.asarray(again[1]), np.asarray(dx))
    other = _jit_fwd_bwd(dataclasses.replace(fp4.RECIPES["nvfp4"], sr_seed=1), *_data())
    assert not np.array_equal(np.asarray(other[1]), np.asarray(dx))  # the seed matters


@pytest.mark.parametrize("name,block", [("nvfp4", 16), ("mxfp4", 32)])
def test_three_gemms_take_fp4_operands(name, block):
    x, w, _ = _data(m=32, k=64, n=16)
    dg = fp4.dot_general_fn(name)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(lambda x, w: jnp.sum(dg(x, w, DN)),
                                              argnums=(0, 1)))(x, w)
    sizes = fp4_gemms(jaxpr)
    assert len(sizes) == 3 and set(sizes) == {block}  # fwd, dgrad, wgrad; per-block partials
    # No other matmul on the side (the RHT is a butterfly of adds, not a matmul).
    assert sum(e.primitive.name == "dot_general" for e in iter_eqns(jaxpr)) == 3


def test_non_finite_in_non_finite_out():
    x, w, dy = _data()
    for name in fp4.RECIPES:
        r = fp4.RECIPES[name]
        y, _, _ = _jit_fwd_bwd(r, x.at[3, 5].set(jnp.nan), w, dy)
        assert np.isnan(np.asarray(y)[3]).all(), name
        _, dx, dw = _jit_fwd_bwd(r, x, w, dy.at[0, 0].set(jnp.inf))
        assert not np.isfinite(np.asarray(dx)).all() and not np.isfinite(np.asarray(dw)).all()
        y, _, _ = _jit_fwd_bwd(r, x, w.at[0, 0].set(-jnp.inf), dy)
        assert not np.isfinite(np.asarray(y)).all(), name


def test_recipe_validation_and_names():
    with pytest.raises(ValueError, match="E2M1"):
        fp4.Fp4Recipe(x_format="e4m3")
    with pytest.raises(ValueError, match="'mxB'"):
        fp4.Fp4Recipe(block_scale="e8m0")
    with pytest.raises(ValueError, match="'1xB' or 'BxB'"):
        fp4.Fp4Recipe(w_tile="16x32")
    with pytest.raises(ValueError, match="grad_rounding"):
        fp4.Fp4Recipe(grad_rounding="up")
    with pytest.raises(ValueError, match="rht_size"):
        fp4.Fp4Recipe(rht_size=12)
    with pytest.raises(ValueError, match="FP4 recipes: nvfp4"):
        fp4.get_recipe("nvfp5")
    assert fp4.get_recipe("blockwise") is fp8.RECIPES["blockwise"]
    assert str(fp4.RECIPES["nvfp4-no-sr"]) == "nvfp4-no-sr"
    assert str(dataclasses.replace(fp4.RECIPES["nvfp4"], rht_seed=5)) == "nvfp4(rht_seed=5)"
    with pytest.raises(TypeError, match="no fmtkit\\.scaling equivalent"):
        fp4.RECIPES["nvfp4"].scaling("x")


def _lower_for(kind, fn, *args):
    dev = jax.sharding.AbstractDevice(device_kind=kind, platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_nvfp4_lowers_to_the_native_block_scaled_dot_on_blackwell_only():
    # No Blackwell here: the recipe is lowered for an abstract B200 (three block-scaled dots:
    # forward, dgrad, wgrad) and an H200 (none: the emulated FP8 GEMMs).
    x, w, dy = (jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in _data(64, 128, 32))
    fn = functools.partial(_jit_fwd_bwd, fp4.RECIPES["nvfp4"])
    assert _lower_for("NVIDIA B200", fn, x, w, dy).count("block_scaled_dot") == 3
    assert "block_scaled_dot" not in _lower_for("NVIDIA H200", fn, x, w, dy)


def test_batched_dimension_numbers_and_bf16_inputs():
    # A batched einsum ("bmk,bkn->bmn"): the core runs vmapped per batch element; bf16 inputs
    # come out bf16 (the wrapper's rule) and track the float64 product like the 2-D case.
    rng = np.random.default_rng(1)
    a = rng.normal(size=(3, 16, 48)).astype(np.float32)
    b = rng.normal(size=(3, 48, 8)).astype(np.float32)
    dn = (((2,), (1,)), ((0,), (0,)))
    dg = fp4.dot_general_fn("nvfp4")
    out = jax.jit(lambda a, b: dg(a, b, dn))(jnp.asarray(a, jnp.bfloat16),
                                             jnp.asarray(b, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and out.shape == (3, 16, 8)
    ref = np.einsum("bmk,bkn->bmn", a.astype(np.float64), b.astype(np.float64))
    assert _sqnr(ref, np.asarray(out, np.float32)) > 11.0


def test_backward_gemms_equal_float64_products_of_their_quantized_operands():
    # nvfp4-no-sr (all RNE, so the test can rebuild each operand): dgrad reads dy in 1x16
    # blocks along N and the forward's 16x16 weight blocks transposed; wgrad reads dyᵀ and xᵀ
    # along the tokens, both rotated by the RHT, in 1x16 blocks. Shapes pad every dim.
    x, w, dy = _data()  # m=40, k=72, n=24
    _, dx, dw = _fwd_bwd("nvfp4-no-sr")

    def deq(t, block=(1, 16)):
        return np.asarray(fp4.nvfp4_quantize(t, block).dequantize(), np.float64)

    gq = deq(jnp.pad(dy, ((0, 0), (0, 8))))  # N 24 -> 32
    wq = deq(jnp.pad(w.T, ((0, 8), (0, 8))), (16, 16))  # [N, K] 32 x 80
    np.testing.assert_allclose(np.asarray(dx), (gq @ wq)[:, :72], rtol=2e-5, atol=2e-5)
    a = fp4.random_hadamard_transform(jnp.pad(dy.T, ((0, 0), (0, 8))))  # tokens 40 -> 48
    b = fp4.random_hadamard_transform(jnp.pad(x.T, ((0, 0), (0, 8))))
    ref = (deq(a) @ deq(b).T).T  # dw [N, K] -> the kernel's [K, N]
    np.testing.assert_allclose(np.asarray(dw), ref, rtol=2e-5, atol=2e-5)
