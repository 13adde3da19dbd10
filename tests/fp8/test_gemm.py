"""The emulated FP8 GEMM: FP8 operands in every dot, the fallback's memory, the fold of
power-of-two scales, the widened dots off GPUs and the per-block dots.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_testlib import DN, data, exact_operand, fwd_bwd, np_tile_qdq, reference_gemms
from jaxpr_utils import dot_operand_dtypes, iter_eqns, iter_eqns_with_trips

from fmtkit import fp8, scaling
from fmtkit._lowp import gemm
from fmtkit.formats import get_format
from fmtkit.scaling import BlockScaling, ScaledArray


def _on_h200():
    """Traces as for an H200 (``fp8``'s GPU checks read the abstract mesh's device)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev))


@pytest.mark.parametrize("name", list(fp8.RECIPES))
def test_all_three_gemms_take_fp8_operands(name):
    """On a GPU every GEMM of every recipe's pure-JAX path is an FP8 dot (where no kernel
    backend takes it). (Off GPUs the power-of-two recipes fold their scales into one f32
    dot: see the next test.)"""
    x, w, dy = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in data(128, 256, 128))
    recipe = dataclasses.replace(fp8.RECIPES[name], use_kernel="never")
    state = fp8.init_state() if recipe.delayed else None
    with _on_h200():
        jaxpr = jax.make_jaxpr(lambda a, b, g: fwd_bwd(recipe, a, b, g, state))(x, w, dy)
    dots = dot_operand_dtypes(jaxpr, entered=True)  # the dtypes entering the dots
    assert len(dots) == 3
    for dtypes in dots:
        assert all(jnp.dtype(d).itemsize == 1 for d in dtypes), dtypes


_POW2_RECIPES = {
    "mxfp8": fp8.RECIPES["mxfp8"],
    "blockwise-pow2": dataclasses.replace(fp8.RECIPES["blockwise"], power_of_two=True),
}


@pytest.mark.parametrize("name", [*fp8.RECIPES, "blockwise-pow2"])
def test_off_gpu_fp8_dots_read_bf16_operands_and_power_of_two_scales_fold(name):
    """On CPU (XLA:CPU runs an FP8 dot as an f32 GEMM of converted operands, a bf16 one as
    its faster bf16 GEMM) every GEMM's dot reads its FP8 operands widened exactly to bf16,
    with f32 output, in a scope that names the FP8 formats for jaxpr readers
    (``inspect_policy``); a GEMM whose operands both have power-of-two block scales is one
    dot of the dequantized operands over the whole contraction, and other block-scaled
    GEMMs keep their per-block partials: one 2-D dot of a 128-block, run once per block
    (a ``lax.scan``), never a batched dot (XLA:CPU runs those in f32)."""
    recipe = _POW2_RECIPES.get(name, fp8.RECIPES.get(name))
    x, w, dy = data(256, 384, 512)  # 2, 3 and 4 128-blocks along the three contractions
    state = fp8.init_state() if recipe.delayed else None
    jaxpr = jax.make_jaxpr(lambda a, b, g: fwd_bwd(recipe, a, b, g, state))(x, w, dy)
    dots = [(e, trips) for e, trips in iter_eqns_with_trips(jaxpr)
            if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # one dot equation per GEMM
    # (contracted size, times it runs) of each GEMM: forward K, dgrad N, wgrad M
    per_block = [(128, 3), (128, 4), (128, 2)]
    whole = [(384, 1), (512, 1), (256, 1)]
    got = sorted((math.prod(e.invars[0].aval.shape[d] for d in e.params[
        "dimension_numbers"][0][0]), trips) for e, trips in dots)
    assert got == sorted(per_block if name == "blockwise" else whole), (name, got)
    formats = {"current": ("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"),
               "delayed": ("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"),
               "rowwise": ("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2")}.get(
                   name, ("float8_e4m3fn",) * 3)
    for e, _ in dots:
        assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16, jnp.bfloat16]  # exact
        assert e.outvars[0].aval.dtype == jnp.float32
        stack = str(e.source_info.name_stack)
        named = re.findall(re.escape(fp8.WIDENED_SCOPE) + r"-(\w+)-(\w+)", stack)
        assert named and set(named[-1]) <= set(formats), stack
        assert e.params["dimension_numbers"][1] == ((), ())  # no batched dot
    assert dot_operand_dtypes(jaxpr)  # the walker reports the formats, not bf16
    assert all(jnp.dtype(d).itemsize == 1 for pair in dot_operand_dtypes(jaxpr) for d in pair)


# ---------------------------------------------------------------------------------------------
# The fallback GEMM scales: no [K/block, M, N] intermediate.


def _blockwise_operands(m, k, n):
    """The blockwise GEMM on already-quantized operands (1x128 a, 128x128 b) and their
    abstract arguments: what the fallback itself allocates, without the quantization."""
    e4m3 = get_format("e4m3")
    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n // 128, k // 128), jnp.float32))

    def matmul(a, sa, b, sb):
        return fp8.scaled_matmul(ScaledArray(a, sa, e4m3, BlockScaling((1, 128))),
                                 ScaledArray(b, sb, e4m3, BlockScaling((128, 128))))

    return matmul, args


def test_fallback_has_no_per_block_partials_array():
    # All partials at once would be an [8, 2048, 1024] f32 array (64 MiB), over the budget,
    # so the 8 K-blocks are accumulated one at a time.
    m, k, n = 2048, 1024, 1024
    assert 4 * (k // 128) * m * n > fp8.PARTIALS_BUDGET_BYTES
    matmul, args = _blockwise_operands(m, k, n)
    jaxpr = jax.make_jaxpr(matmul)(*args)
    biggest = max(math.prod(v.aval.shape) for e in iter_eqns(jaxpr) for v in e.outvars)
    assert biggest <= m * max(n, k)  # the output or an input, never 8 * m * n
    # Compiled on CPU: peak footprint (arguments + temporaries + output) within 2x that of
    # an f32 matmul of the same shape. (XLA:CPU runs FP8 dots in f32 and hoists the
    # conversion of one operand out of the loop: one [M, K] f32 temporary, as large as the
    # f32 matmul's own argument.)
    def footprint(f, *a):
        mem = jax.jit(f).lower(*a).compile().memory_analysis()
        return mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes

    f32 = footprint(lambda x, w: x @ w.T, jax.ShapeDtypeStruct((m, k), jnp.float32),
                    jax.ShapeDtypeStruct((n, k), jnp.float32))
    assert footprint(matmul, *args) <= 2 * f32


def test_fallback_lowered_for_the_h200_has_no_per_block_partials():
    """The GPU compiler need not fuse what XLA:CPU fuses: lower for CUDA (no GPU needed) and
    check the StableHLO's largest f32 tensor."""
    import re

    m, k, n = 2048, 1024, 1024
    matmul, args = _blockwise_operands(m, k, n)
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=h200)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(matmul).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    sizes = [math.prod(int(d) for d in dims.split("x"))
             for dims in re.findall(r"tensor<((?:\d+x)+)f32>", text)
             for dims in [dims.rstrip("x")]]
    assert sizes and max(sizes) <= m * max(n, k)


@pytest.mark.parametrize("name", ["current", "rowwise"])
def test_weight_gradient_equals_scaled_matmul_of_the_quantized_operands(set_fp8_switch, name):
    """The weight gradient, computed in the kernel's [K, N] layout, equals bit for bit
    ``scaled_matmul`` of the two quantized operands (``fmtkit.quantize`` along the tokens)
    transposed, on Gaussian data: the scales are applied in ``scaled_matmul``'s order. With
    the FP8 dots of the GPU path (the ``widen_off_gpu`` switch off): XLA:CPU's bf16 GEMM may sum
    ``b · aᵀ`` in another order than ``a · bᵀ`` (the float64 reference tests cover the
    widened dots)."""
    set_fp8_switch("widen_off_gpu", False)
    r = fp8.get_recipe(name)
    x, w, dy = data(128, 256, 96, seed=3)
    _, _, gw = jax.jit(lambda a, b, g: fwd_bwd(name, a, b, g))(x, w, dy)
    tile = {"tensor": scaling.TensorScaling(), "row": scaling.AxisScaling(-1)}
    gq = scaling.quantize(dy.T, r.grad_format, tile[r.grad_tile])
    xq = scaling.quantize(x.T, r.x_format, tile[r.x_tile])
    want = jax.jit(lambda a, b: fp8.scaled_matmul(a, b).T)(gq, xq)
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(want))


# ---------------------------------------------------------------------------------------------
# Power-of-two scales: the fold (one f32 dot of dequantized operands) against the per-block
# form it replaces off GPUs (the ``fold_pow2_scales`` switch).


def _fold_vs_per_block(set_fp8_switch, recipe, x, w, dy):
    set_fp8_switch("fold_pow2_scales", True)  # no trace of another test's setting reused
    folded = jax.jit(lambda a, b, g: fwd_bwd(recipe, a, b, g))(x, w, dy)
    set_fp8_switch("fold_pow2_scales", False)
    per_block = jax.jit(lambda a, b, g: fwd_bwd(recipe, a, b, g))(x, w, dy)
    return folded, per_block


def _summation_bounds(recipe, x, w, dy):
    """Per output, the f32 summation error bound of either form: (C - 1) * 2^-24 times the
    sum of |products| of the recipe's quantized operands (float64 reference quantization;
    the products themselves are exact in f32 here). Two summation orders differ by at most
    twice that."""
    r = fp8.get_recipe(recipe)
    x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
    q = {"x": lambda t: np.abs(np_tile_qdq(t, r.x_tile, r.x_format)),
         "w": lambda t: np.abs(np_tile_qdq(t, r.w_tile, r.w_format)),
         "g": lambda t: np.abs(np_tile_qdq(t, r.grad_tile, r.grad_format))}
    sums = (q["x"](x) @ q["w"](w.T).T, q["g"](dy) @ q["w"](w).T,
            (q["g"](dy.T) @ q["x"](x.T).T).T)
    terms = (x.shape[1], w.shape[1], x.shape[0])  # K, N, M
    return [2 * (c - 1) * 2.0**-24 * s for s, c in zip(sums, terms)]


@pytest.mark.parametrize("name", list(_POW2_RECIPES))
def test_power_of_two_fold_equals_per_block_form_up_to_summation_order(set_fp8_switch, name):
    """Gaussian data with 100x outlier channels (blocks of very different scales): the fold
    and the per-block partials sum the same exact products; their difference stays within
    the f32 summation bound of the two orders, for y, dx and dw."""
    recipe = _POW2_RECIPES[name]
    x, w, dy = data(256, 512, 128, seed=5)
    x = x.at[:, ::37].multiply(100.0)
    folded, per_block = _fold_vs_per_block(set_fp8_switch, recipe, x, w, dy)
    for what, a, b, bound in zip(("y", "dx", "dw"), folded, per_block,
                                 _summation_bounds(recipe, x, w, dy)):
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        assert np.all(diff <= bound), (what, float((diff - bound).max()))


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**100], ids=["tiny", "huge"])
def test_power_of_two_fold_at_extreme_block_scales(set_fp8_switch, scale):
    """Blocks of x scaled by 2^-100 (E8M0 scales near 2^-108: dequantized elements near
    2^-117, still f32 normals) or 2^100 (scales near 2^92), next to ordinary blocks: the fold
    gives the per-block form's values (within the summation bound) and flushes nothing the
    per-block form keeps (the exactness bounds in ``gemm._folds_scales``)."""
    x, w, dy = data(128, 256, 64, seed=9)
    x = x.at[:, :64].multiply(scale)  # two MX blocks of every row, one 128-block half
    if scale > 1:
        w, dy = w * 2.0**-20, dy * 2.0**-20  # keep the products inside f32's range
    folded, per_block = _fold_vs_per_block(set_fp8_switch, "mxfp8", x, w, dy)
    for what, a, b, bound in zip(("y", "dx", "dw"), folded, per_block,
                                 _summation_bounds("mxfp8", x, w, dy)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), what
        assert np.all((a == 0) == (b == 0)), what  # nothing flushed by one form only
        assert np.all(np.abs(a - b) <= bound), what
    # dw rows 0..63 come only from the scaled x columns: their magnitude is kept
    dw = np.asarray(folded[2], np.float64)
    assert 0 < np.abs(dw[:64]).max() < np.inf


# ---------------------------------------------------------------------------------------------
# Off GPUs every FP8 dot reads its operands widened exactly to bf16 (``gemm._emulated_dot``): that
# relies on XLA:CPU accumulating a bf16 x bf16 -> f32 dot in f32, checked here directly.


@pytest.mark.parametrize("dims,a_shape,b_shape", [
    ((((1,), (1,)), ((), ())), (7, 1027), (13, 1027)),  # a · bᵀ, odd sizes
    ((((0,), (0,)), ((), ())), (1027, 7), (1027, 13)),  # both contraction-major
    # the per-block partials: [F1, nb, g] · [F2, nb, g], batch nb, contract g
    ((((2,), (2,)), ((1,), (1,))), (7, 5, 515), (13, 5, 515)),
    # ... and every mix of contraction-major ([nb, g, F]) and -minor operands, both orders
    ((((1,), (2,)), ((0,), (1,))), (5, 515, 7), (13, 5, 515)),
    ((((2,), (1,)), ((1,), (0,))), (7, 5, 515), (5, 515, 13)),
    ((((1,), (1,)), ((0,), (0,))), (5, 515, 7), (5, 515, 13)),
], ids=["nt", "tn", "batched", "batched-cmajor-a", "batched-cmajor-b", "batched-cmajor"])
def test_cpu_bf16_dot_accumulates_in_f32(dims, a_shape, b_shape):
    """An adversarial sum: along the contraction, one product of 1 (2^7 * 2^-7) at a random
    position and all others 2^-14 (2^-7 * 2^-7; bf16 and E4M3 values); every partial sum of
    them is exact in f32 (below 2, on the 2^-14 grid: 15 bits), so any order of f32
    accumulation gives the float64 sum exactly, while a bf16 accumulator (8 bits: 1 + 2^-14
    rounds to 1) or a TF32-like one (11 bits) would lose the small terms. The dot is the one
    ``gemm._emulated_dot`` emits off GPUs (``_wide_dot``: bf16 operands, f32 output; its
    layouts are every one the per-block partials take, a plain ``lax.dot_general`` of
    some of which XLA:CPU rejects)."""
    ca = dims[0][0]
    rng = np.random.default_rng(0)
    a = np.full(a_shape, 2.0**-7, np.float32)
    b = np.full(b_shape, 2.0**-7, np.float32)
    # one product of 1 per output, at a random position of the contraction
    k = a_shape[ca[0]]
    a = np.moveaxis(a, ca[0], -1)
    pos = rng.integers(0, k, size=a.shape[:-1])
    np.put_along_axis(a, pos[..., None], 2.0**7, axis=-1)
    a = np.moveaxis(a, -1, ca[0])
    a *= rng.choice([1.0, -1.0], size=(*a.shape[:ca[0]], 1, *a.shape[ca[0] + 1:])).astype(
        np.float32)  # signs per output row of a: sums of equal-sign terms
    dot = jax.jit(lambda p, q: gemm._wide_dot(p, q, dims))
    got = np.asarray(dot(jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)))
    assert got.dtype == np.float32
    want = _np_dot_general(a.astype(np.float64), b.astype(np.float64), dims)
    # the sums hold more than a bf16 accumulator could: a real test of f32 accumulation
    assert np.all(np.abs(want) > 1.0 + 2.0**-7)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    np.testing.assert_array_equal(want.astype(np.float32).astype(np.float64), want)  # exact


def _np_dot_general(a, b, dims):
    """NumPy ``lax.dot_general`` (one contracting, at most one batch axis): [batch, a free,
    b free], by einsum."""
    (ca, cb), (ba, bb) = dims
    la, lb = list("abcd"[:a.ndim]), list("efgh"[:b.ndim])
    lb[cb[0]] = la[ca[0]]
    batch = []
    if ba:
        lb[bb[0]] = la[ba[0]]
        batch = [la[ba[0]]]
    free = [c for c in la if c not in (la[ca[0]], *batch)] + [
        c for c in lb if c not in la]
    return np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(batch + free)}", a, b)


@pytest.mark.parametrize("name", [*fp8.RECIPES])
def test_widened_dots_equal_fp8_dots_up_to_summation_order(set_fp8_switch, name):
    """Off GPUs the dots read FP8 operands widened to bf16; against the FP8 dots they replace
    (the ``widen_off_gpu`` switch off) y, dx and dw differ at most by the f32 summation bound of
    the two orders (the values and products are the same), on data with outlier channels."""
    x, w, dy = data(128, 384, 256, seed=11)
    x = x.at[:, ::37].multiply(100.0)
    state = fp8.init_state() if fp8.RECIPES[name].delayed else None  # bootstrap: current
    set_fp8_switch("widen_off_gpu", True)
    widened = jax.jit(lambda a, b, g: fwd_bwd(name, a, b, g, state))(x, w, dy)
    set_fp8_switch("widen_off_gpu", False)
    fp8_dots = jax.jit(lambda a, b, g: fwd_bwd(name, a, b, g, state))(x, w, dy)
    for what, a, b, bound in zip(("y", "dx", "dw"), widened, fp8_dots,
                                 _summation_bounds(name, x, w, dy)):
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        assert np.all(diff <= bound), (what, float((diff - bound).max()))


# ---------------------------------------------------------------------------------------------
# Off GPUs the blockwise per-block partials are one 2-D dot per 128-block in a lax.scan
# (``gemm._block_dots``; the ``scan_block_dots`` switch) instead of one batched dot.


_BLOCK_SHAPES = [(256, 1024, 384), (100, 200, 300), (128, 384, 256)]


def _blockwise_both_ways(set_fp8_switch, x, w, dy, budget=None):
    """blockwise y / dx / dw with the scanned 2-D dots and with the batched form (its one
    batched dot, or with ``budget`` its loop of one-block batched dots)."""
    if budget is not None:
        set_fp8_switch("partials_budget_bytes", budget)
    set_fp8_switch("scan_block_dots", True)
    scanned = jax.jit(lambda a, b, g: fwd_bwd("blockwise", a, b, g))(x, w, dy)
    set_fp8_switch("scan_block_dots", False)
    batched = jax.jit(lambda a, b, g: fwd_bwd("blockwise", a, b, g))(x, w, dy)
    return scanned, batched


@pytest.mark.parametrize("budget", [None, 0], ids=["one-batched-dot", "batched-loop"])
@pytest.mark.parametrize("shape", _BLOCK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_block_dots_equal_batched_partials_up_to_summation_order(set_fp8_switch, shape,
                                                                 budget):
    """Gaussian data with 100x outlier channels (blocks of very different scales): the
    scanned 2-D dots and the batched form they replace sum the same exact products, scale
    them by the same block scales and add the blocks in the same order; XLA:CPU rounds
    differently inside them (its bf16 GEMM sums a block's products in another order than
    the f32 GEMM it makes of a batched bf16 dot, and the scan's multiply-add is one FMA).
    Each is within the f32 summation bound of the float64 reference of the same block-scaled
    sum (independent NumPy quantization), so the two within twice that."""
    m, k, n = shape
    x, w, dy = data(m, k, n, seed=13)
    x = x.at[:, ::37].multiply(100.0)
    scanned, batched = _blockwise_both_ways(set_fp8_switch, x, w, dy, budget)
    refs = reference_gemms("blockwise", x, w, dy)
    bounds = _summation_bounds("blockwise", x, w, dy)  # two orders: twice one form's
    for what, a, b, ref, bound in zip(("y", "dx", "dw"), scanned, batched, refs, bounds):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.abs(a - ref) <= bound / 2), (what, float(np.abs(a - ref).max()))
        assert np.all(np.abs(b - ref) <= bound / 2), what
        assert np.all(np.abs(a - b) <= bound), what


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", _BLOCK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_block_dots_are_bit_identical_to_batched_partials_where_sums_are_exact(
        set_fp8_switch, shape, dtype):
    """On inputs whose f32 accumulation is exact in any order (``exact_operand``), y, dx and
    dw of the scanned 2-D dots equal those of the batched form bit for bit (and both the
    float64 reference): the same values, products, scales and padding."""
    m, k, n = shape
    keys = jax.random.split(jax.random.key(17), 3)
    x = exact_operand(keys[0], (m, k), "e4m3", -3, dtype)
    w = exact_operand(keys[1], (k, n), "e4m3", -9, dtype)
    dy = exact_operand(keys[2], (m, n), "e4m3", -17, dtype)
    scanned, batched = _blockwise_both_ways(set_fp8_switch, x, w, dy)
    refs = reference_gemms("blockwise", x, w, dy)
    for what, a, b, ref in zip(("y", "dx", "dw"), scanned, batched, refs):
        want = np.asarray(jnp.asarray(ref, jnp.float32).astype(dtype))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)
        np.testing.assert_array_equal(np.asarray(a), want, err_msg=what)


def test_block_dots_are_one_scanned_dot_per_gemm_and_fp4_keeps_its_batched_dot():
    """A 4096-wide contraction (32 blocks) is still one dot equation per GEMM, in a scan of
    32 steps; NVFP4's 16-wide blocks keep the batched form (``gemm._MIN_SCAN_BLOCK``)."""
    from fmtkit import fp4

    x, w, dy = (jax.ShapeDtypeStruct(s, jnp.float32) for s in
                ((128, 4096), (4096, 256), (128, 256)))
    jaxpr = jax.make_jaxpr(lambda a, b, g: fwd_bwd("blockwise", a, b, g))(x, w, dy)
    dots = [(e, t) for e, t in iter_eqns_with_trips(jaxpr) if e.primitive.name == "dot_general"]
    assert sorted(t for _, t in dots) == [1, 2, 32]  # wgrad: 1 block of 128 tokens (no scan)
    assert all(e.params["dimension_numbers"][1] == ((), ()) for e, _ in dots)
    x, w, dy = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((128, 256), (256, 64), (128, 64)))
    dg = fp4.dot_general_fn("nvfp4")
    jaxpr = jax.make_jaxpr(lambda a, b, g: jax.vjp(lambda p, q: dg(p, q, DN), a, b)[1](g))(
        x, w, dy)
    dots = [(e, t) for e, t in iter_eqns_with_trips(jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(t == 1 and e.params["dimension_numbers"][1] != ((), ())
                        for e, t in dots)
