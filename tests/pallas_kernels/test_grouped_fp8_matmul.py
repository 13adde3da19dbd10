"""The grouped blockwise FP8 GEMMs: the task table and the padded token layout against
loops written here, the interpret-mode kernel against ``fmtkit.fp8.ragged_dot`` (the
emulated grouped GEMM on the same FP8 operands), against float64 products of the
dequantized operands and against the dense kernel; negative controls; validation.

Interpret-mode cases take 10-20 s each on a 2-core CPU (slow)."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fmtkit import fp8
from fmtkit.scaling import BlockScaling, quantize
from pallas_kernels import blockwise_fp8_matmul
from pallas_kernels.config import SHIPPED_CONFIGS, choose_config
from pallas_kernels.grouped_fp8_matmul import (
    choose_grouped_config,
    group_tasks,
    grouped_fp8_dgrad,
    grouped_fp8_matmul,
    grouped_fp8_matmul_masked,
    grouped_fp8_matmul_masked_reference,
    grouped_fp8_matmul_reference,
    grouped_fp8_wgrad,
    grouped_fp8_wgrad_matmul_reference,
    masked_tasks,
    padded_token_layout,
)

# The module (its name is also the function's, which the package exports).
gm = importlib.import_module("pallas_kernels.grouped_fp8_matmul")
# 64-row tiles: more tiles (and tasks) per small problem than 128-row ones.
CFG = SHIPPED_CONFIGS["64x128"]
XLA = dataclasses.replace(fp8.RECIPES["blockwise"], use_kernel="never")
# 200 rows in 64-row tiles (padded to 256): an empty expert, experts ending mid-tile
# (50, 127, 187), 13 rows past sum(group_sizes) (zeros), 7 tasks for 2 interpret programs.
M, N, K = 200, 256, 256
SIZES = (50, 0, 77, 60)
# Kernel vs the emulated path on the same FP8 operands, f32 output: both sum the exact
# products of each 128-wide K block in f32, in another order (a few f32 ulps of the block
# sums). bf16 output: one rounding of that f32 value, at most one bf16 ulp apart.
F32_RTOL = 1e-5
BF16_RTOL = 2.0**-7
# Compiled on a Hopper GPU, FP8 wgmma accumulates a 128-wide block with fewer bits than f32
# (about 14, DeepSeek-V3 §3.3.2): the dense kernel's tests' compiled bound.
RTOL = {"interpret": F32_RTOL, "kernel": 1e-3}


def _data(m, n, k, g, seed=0):
    """x [m, k] and experts w [g, n, k] whose 1x128 / 128x128 blocks span 2^±6, so a
    scale applied to the wrong block or expert shows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.repeat(2.0 ** rng.integers(-6, 7, (m, k // 128)),
                                                128, 1)
    mag = 2.0 ** rng.integers(-6, 7, (g, n // 128, k // 128))
    w = rng.standard_normal((g, n, k)) * np.repeat(np.repeat(mag, 128, 1), 128, 2)
    return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)


def _quantized(x, w):
    """fmtkit's quantizers (the blockwise recipe's): x per 1x128 tile, each expert per
    128x128 block."""
    xs = quantize(x, "e4m3", BlockScaling((1, 128)))
    ws = jax.vmap(lambda t: quantize(t, "e4m3", BlockScaling((128, 128))))(w)
    return xs.values, xs.scale, ws.values, ws.scale


def _float64_grouped(xq, xs, wq, ws, sizes):
    """Row m times its expert's dequantized weight in float64; zeros past the sum."""
    x64 = np.asarray(xq, np.float64) * np.repeat(np.asarray(xs, np.float64), 128, 1)
    s = np.repeat(np.repeat(np.asarray(ws, np.float64), 128, 1), 128, 2)
    w64 = np.asarray(wq, np.float64) * s[:, :wq.shape[1]]
    out = np.zeros((x64.shape[0], wq.shape[1]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = x64[start:start + size] @ w64[g].T
        start += size
    return out


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


# --------------------------------------------------------------------------------------
# Task table and padded layout (fast).


def _tasks_by_loop(sizes, m, bm):
    """The task table by walking rows: one task per (group, tile) with rows in it."""
    gid = []
    for g, size in enumerate(sizes):
        gid += [g] * size
    gid += [len(sizes)] * (m - len(gid))  # the tail's pseudo-group
    tasks = []
    for r, g in enumerate(gid):
        if tasks and tasks[-1][0] == g and tasks[-1][1] == r // bm:
            tasks[-1][3] = r + 1
        else:
            tasks.append([g, r // bm, r, r + 1])
    return tasks


# Eager XLA ops, 2-4 s each on a loaded 2-core CPU: the first case (an empty expert,
# boundaries mid-tile, a tail) in the fast suite, the others slow.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("sizes,m,bm", [
    (SIZES, 256, 64),
    pytest.param((0, 0, 0), 128, 64, marks=_SLOW),  # no rows in any group: only the tail
    pytest.param((128, 128), 256, 128, marks=_SLOW),  # boundaries on tiles
    pytest.param((1, 1, 1, 1, 1), 64, 64, marks=_SLOW),  # five experts in one tile
    pytest.param((300,), 384, 128, marks=_SLOW),  # one expert
])
def test_group_tasks_match_a_row_loop(sizes, m, bm):
    tasks, n_real = group_tasks(jnp.array(sizes, jnp.int32), m, bm)
    want = _tasks_by_loop(sizes, m, bm)
    assert tasks.shape == (4, -(-m // bm) + len(sizes))
    assert int(n_real[0]) == len(want) <= tasks.shape[1]
    np.testing.assert_array_equal(np.asarray(tasks)[:, :len(want)].T, np.array(want))
    assert not np.asarray(tasks)[:, len(want):].any()


@pytest.mark.slow
def test_masked_tasks_match_a_row_loop():
    """The masked layout: expert g's valid rows, then its empty slots as zero tasks."""
    counts, cap, bm = (5, 0, 64, 70), 64, 64
    tasks, n_real = masked_tasks(jnp.array(counts, jnp.int32), cap, bm)
    gid = []
    for g, c in enumerate(counts):
        c = min(c, cap)
        gid += [g] * c + [len(counts)] * (cap - c)
    want = []
    for r, g in enumerate(gid):
        if want and want[-1][0] == g and want[-1][1] == r // bm:
            want[-1][3] = r + 1
        else:
            want.append([g, r // bm, r, r + 1])
    assert tasks.shape == (4, len(counts) * cap // bm + 2 * len(counts))
    assert int(n_real[0]) == len(want)
    np.testing.assert_array_equal(np.asarray(tasks)[:, :len(want)].T, np.array(want))


@pytest.mark.parametrize("m,g,want_bm", [(32768, 8, None), (512, 64, 64), (4096, 64, 64)])
def test_choose_grouped_config(m, g, want_bm):
    """Large experts: the dense choice for the rows computed; experts of fewer than 128
    rows on average: a 64-row tile of the same width."""
    cfg = choose_grouped_config(m, 4096, 7168, g)
    if want_bm is None:
        assert cfg == choose_config(m + 64 * g, 4096, 7168)
    else:
        assert cfg.block_m == want_bm and cfg in SHIPPED_CONFIGS.values()


@pytest.mark.slow
def test_padded_token_layout_matches_a_loop():
    sizes, m = (130, 0, 5, 128), 300
    dest, blocks, tp = padded_token_layout(jnp.array(sizes, jnp.int32), m)
    want, blk0 = [], 0
    first, count = [], []
    for size in sizes:
        first.append(blk0)
        count.append(-(-size // 128))
        want += [blk0 * 128 + i for i in range(size)]
        blk0 += -(-size // 128)
    want += [tp] * (m - len(want))  # past the sum: dropped
    assert tp == 128 * (-(-m // 128) + len(sizes))
    np.testing.assert_array_equal(np.asarray(dest), want)
    np.testing.assert_array_equal(np.asarray(blocks), [first, count])


# --------------------------------------------------------------------------------------
# Interpret mode (slow).


@pytest.fixture(scope="module")
def operands():
    x, w = _data(M, N, K, len(SIZES))
    return x, w, _quantized(x, w)


@pytest.mark.slow
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_forward_matches_ragged_dot_and_float64(operands, out_dtype, mode):
    """Empty expert, experts ending mid-tile, rows past sum(group_sizes), more tasks than
    programs: the kernel against fmtkit.fp8.ragged_dot (the emulated grouped GEMM, which
    quantizes x and w with the same quantizers) and against float64."""
    x, w, (xq, xs, wq, ws) = operands
    gs = jnp.array(SIZES, jnp.int32)
    out = grouped_fp8_matmul(xq, xs, wq, ws, gs, out_dtype=out_dtype, impl=mode,
                             config=CFG)
    assert out.dtype == out_dtype and out.shape == (M, N)
    got = np.asarray(out.astype(jnp.float32))
    emulated = fp8.ragged_dot(x, jnp.swapaxes(w, 1, 2), gs, XLA,
                              preferred_element_type=jnp.float32)
    exact = _float64_grouped(xq, xs, wq, ws, SIZES)
    assert not np.isnan(got).any()  # every row written (uninitialized memory is NaN)
    assert not got[sum(SIZES):].any()  # rows past the sum: zeros
    tol = RTOL[mode] if out_dtype == jnp.float32 else BF16_RTOL
    np.testing.assert_allclose(got, np.asarray(emulated), rtol=tol, atol=tol * np.abs(
        exact).max())
    np.testing.assert_allclose(got, exact, rtol=tol, atol=tol * np.abs(exact).max())
    ref = grouped_fp8_matmul_reference(xq, xs, wq, ws, gs, out_dtype=out_dtype)
    np.testing.assert_allclose(got, np.asarray(ref.astype(jnp.float32)), rtol=tol,
                               atol=tol * np.abs(exact).max())


@pytest.mark.slow
def test_one_expert_equals_the_dense_kernel(operands):
    """G = 1 with every row: the same tiles, K loop and promotion as the dense kernel,
    bit for bit."""
    _, _, (xq, xs, wq, ws) = operands
    xq, xs = xq[:192], xs[:192]  # whole 64-row tiles (the dense kernel pads otherwise)
    out = grouped_fp8_matmul(xq, xs, wq[:1], ws[:1], jnp.array([192], jnp.int32),
                             out_dtype=jnp.float32, impl="interpret", config=CFG)
    dense = blockwise_fp8_matmul(xq, xs, wq[0], ws[0], out_dtype=jnp.float32,
                                 impl="interpret", config=CFG)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(dense))


@pytest.mark.slow
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_both_epilogues_agree_bit_for_bit(operands, out_dtype):
    """The forward (row ladders from the staging slots, rows past the sum stored as zeros)
    and the weight gradient (``store_passes``; an empty expert's zero tile) in the
    "chunks" epilogue equal the shipped 64x128's "tile" epilogue bit for bit: the
    epilogue only moves the same rounded values."""
    _, _, (xq, xs, wq, ws) = operands
    gs = jnp.array(SIZES, jnp.int32)
    chunks = dataclasses.replace(CFG, epilogue="chunks")
    assert CFG.epilogue == "tile"
    fwd = [np.asarray(grouped_fp8_matmul(xq, xs, wq, ws, gs, out_dtype=out_dtype,
                                         impl="interpret", config=c)) for c in (CFG, chunks)]
    np.testing.assert_array_equal(*fwd)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((200, 128)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((200, 256)), jnp.float32)
    wgrad = [np.asarray(grouped_fp8_wgrad(dy, x, jnp.array((130, 0, 60), jnp.int32),
                                          out_dtype=out_dtype, impl="interpret", config=c))
             for c in (CFG, chunks)]
    np.testing.assert_array_equal(*wgrad)
    assert not wgrad[0][1].any() and wgrad[0][0].any()


@pytest.mark.slow
def test_masked_layout(operands, mode):
    """A fixed capacity of 48 slots per expert (experts' slots straddle the 64-row tiles),
    counts 0, 5, 48 and 33: each expert's valid rows against the reference and float64,
    the other slots zeros, every slot written."""
    _, _, (xq, xs, wq, ws) = operands
    cap, counts = 48, (0, 5, 48, 33)
    a, a_s = xq[:4 * cap].reshape(4, cap, K), xs[:4 * cap].reshape(4, cap, K // 128)
    c = jnp.array(counts, jnp.int32)
    out = grouped_fp8_matmul_masked(a, a_s, wq, ws, c, out_dtype=jnp.float32, impl=mode,
                                    config=CFG)
    got = np.asarray(out)
    ref = np.asarray(grouped_fp8_matmul_masked_reference(a, a_s, wq, ws, c,
                                                         out_dtype=jnp.float32))
    assert not np.isnan(got).any()
    scale, tol = np.abs(ref).max(), RTOL[mode]
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * scale)
    for g, cnt in enumerate(counts):
        exact = _float64_grouped(a[g, :cnt], a_s[g, :cnt], wq[g:g + 1], ws[g:g + 1], [cnt])
        np.testing.assert_allclose(got[g, :cnt], exact, rtol=tol, atol=tol * scale)
        assert not got[g, cnt:].any()


@pytest.mark.slow
def test_data_gradient_matches_ragged_dot_vjp(operands, mode):
    """dgrad: dy quantized 1x128 along N, the expert blocks transposed; against the
    emulated path's data gradient (same quantizers) and float64."""
    x, w, (_, _, wq, ws) = operands
    gs = jnp.array(SIZES, jnp.int32)
    dy = jax.random.normal(jax.random.key(3), (M, N), jnp.float32)
    dx = grouped_fp8_dgrad(dy, wq, ws, gs, out_dtype=jnp.float32, impl=mode, config=CFG)
    _, vjp = jax.vjp(lambda a: fp8.ragged_dot(a, jnp.swapaxes(w, 1, 2), gs, XLA,
                                              preferred_element_type=jnp.float32), x)
    (want,) = vjp(dy)
    dq = quantize(dy, "e4m3", BlockScaling((1, 128)))
    exact = _float64_grouped(dq.values, dq.scale, jnp.swapaxes(wq, 1, 2),
                             jnp.swapaxes(ws, 1, 2), SIZES)
    got = np.asarray(dx)
    assert not got[sum(SIZES):].any()
    scale, tol = np.abs(exact).max(), RTOL[mode]
    np.testing.assert_allclose(got, np.asarray(want), rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(got, exact, rtol=tol, atol=tol * scale)


@pytest.mark.slow
def test_weight_gradient_per_expert(mode):
    """wgrad on the padded token layout: an empty expert (zero gradient), experts whose
    tokens end mid-block, tokens past the sum dropped; against float64 of the padded,
    quantized operands per expert, and, with group sizes on 128-token blocks (where the
    padded layout is the sorted one), against the emulated path's weight gradient."""
    sizes, m, n, k = (130, 0, 60), 200, 256, 128
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, n)) * 4.0, jnp.float32)
    gs = jnp.array(sizes, jnp.int32)
    dw = grouped_fp8_wgrad(dy, x, gs, impl=mode, config=CFG)
    assert dw.shape == (3, n, k) and dw.dtype == jnp.float32
    dest, blocks, tp = padded_token_layout(gs, m)

    def padded_q(t):
        p = jnp.zeros((tp, t.shape[1]), jnp.float32).at[dest].set(t, mode="drop").T
        q = quantize(p, "e4m3", BlockScaling((1, 128)))
        return np.asarray(q.values, np.float64) * np.repeat(np.asarray(q.scale), 128, 1)

    g64, x64 = padded_q(dy), padded_q(x)  # float64 [F, Tp]
    got = np.asarray(dw)
    for g in range(3):
        b0, nb = (int(v) for v in np.asarray(blocks)[:, g])
        cols = slice(128 * b0, 128 * (b0 + nb))
        want = g64[:, cols] @ x64[:, cols].T
        if not nb:
            assert not got[g].any()
            continue
        np.testing.assert_allclose(got[g], want, rtol=RTOL[mode],
                                   atol=RTOL[mode] * np.abs(want).max())
    ref = grouped_fp8_wgrad_matmul_reference(*quantize_pair(dy, x, dest, tp), blocks)
    np.testing.assert_allclose(got, np.asarray(ref), rtol=RTOL[mode],
                               atol=RTOL[mode] * np.abs(got).max())
    # Sizes on whole blocks: the emulated path quantizes the same blocks.
    gs2 = jnp.array((128, 0, 128), jnp.int32)
    x2, dy2 = (jnp.pad(t, ((0, 256 - m), (0, 0))) for t in (x, dy))
    dw2 = grouped_fp8_wgrad(dy2, x2, gs2, impl=mode, config=CFG)
    w0 = jnp.zeros((3, k, n), jnp.float32)
    _, vjp = jax.vjp(lambda w_: fp8.ragged_dot(x2, w_, gs2, XLA,
                                              preferred_element_type=jnp.float32), w0)
    (want2,) = vjp(dy2)
    np.testing.assert_allclose(np.asarray(dw2), np.swapaxes(np.asarray(want2), 1, 2),
                               rtol=RTOL[mode], atol=RTOL[mode] * np.abs(np.asarray(want2)).max())


def quantize_pair(dy, x, dest, tp):
    """The padded, quantized wgrad operands (tokens minor) as the kernel takes them."""
    out = []
    for t in (dy, x):
        p = jnp.zeros((tp, t.shape[1]), jnp.float32).at[dest].set(t, mode="drop").T
        q = quantize(p, "e4m3", BlockScaling((1, 128)))
        out += [q.values, q.scale]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["wrong_offset", "drop_tail"])
def test_negative_controls_are_caught(operands, fault, monkeypatch):
    """A wrong group offset (each expert's first task computed with the expert before it)
    or a dropped tail task (left unwritten: NaN in the interpreter's memory) fails the
    comparison the forward test makes."""
    _, _, (xq, xs, wq, ws) = operands
    gs = jnp.array(SIZES, jnp.int32)
    ref = np.asarray(grouped_fp8_matmul_reference(xq, xs, wq, ws, gs, out_dtype=jnp.float32))
    monkeypatch.setattr(gm, "_FAULT", fault)
    jax.clear_caches()  # the switch is read while tracing
    try:
        out = np.asarray(grouped_fp8_matmul(xq, xs, wq, ws, gs, out_dtype=jnp.float32,
                                            impl="interpret", config=CFG))
    finally:
        monkeypatch.setattr(gm, "_FAULT", None)
        jax.clear_caches()
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(out, ref, rtol=F32_RTOL,
                                   atol=F32_RTOL * np.abs(ref).max())


# --------------------------------------------------------------------------------------
# Validation (reference path: fast).


def _args(m=128, n=128, k=256, g=2):
    xq, xs, wq, ws = _quantized(*_data(m, n, k, g))
    return [xq, xs, wq, ws, jnp.array([m // 2] * g, jnp.int32)]


@pytest.mark.slow
@pytest.mark.parametrize("i,bad,exc,match", [
    (0, lambda a: a.astype(jnp.float32), TypeError, "a must be a float8_e4m3fn"),
    (1, lambda a: a[:, :1], ValueError, "a_scale must have shape"),
    (2, lambda b: b[0], ValueError, "b must be 3-D"),
    (3, lambda s: s[:, :, :1], ValueError, "b_scale must have shape"),
    (4, lambda g: g[:1], ValueError, r"group_sizes must have shape \(2,\)"),
    (4, lambda g: g.astype(jnp.float32), TypeError, "group_sizes must be an integer"),
])
def test_bad_input(i, bad, exc, match):
    args = _args()
    args[i] = bad(args[i])
    with pytest.raises(exc, match=match):
        grouped_fp8_matmul(*args, impl="reference")


def test_bad_out_dtype_and_impl():
    with pytest.raises(ValueError, match="out_dtype must be bfloat16 or float32"):
        grouped_fp8_matmul(*_args(), out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_fp8_matmul(*_args(), impl="gpu")


def test_clusters_are_refused():
    """Clusters are the dense kernel's (``TuningConfig.cluster``): the grouped kernel says
    so before tracing a kernel."""
    cfg = dataclasses.replace(SHIPPED_CONFIGS["128x128"], cluster=(2, 1))
    with pytest.raises(ValueError, match=r"^config.cluster must be \(1, 1\) in the grouped"):
        grouped_fp8_matmul(*_args(), impl="interpret", config=cfg)
