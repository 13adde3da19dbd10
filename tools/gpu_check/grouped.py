"""The grouped FP8 kernels in the GPU check: items added to the ``correctness`` and
``bench`` phases (``grouped_items``, called from ``worker.phase_items``).

Correctness: the grouped forward at several expert layouts (balanced, skewed with empty
experts, boundaries inside tiles, rows past ``sum(group_sizes)``), the data gradient and
the per-expert weight gradient, against float64 on a sample of rows and columns.
Bench, at DeepSeek-V3's expert shapes (G = 8, (N, K) = (4096, 7168) and (7168, 2048)),
interleaved on the same warm device: the grouped kernel against the dense kernel at the
same total FLOPs and XLA's ``lax.ragged_dot`` on the same FP8 values (widened to bf16:
XLA's GPU ragged_dot takes no FP8), at 4096 and 512 rows per expert; the grouped weight
gradient against the dense weight-gradient kernel. Targets (ratios of median TFLOP/s):
grouped >= 0.85x dense and >= 5x XLA at 4096 rows per expert, >= 0.6x dense at 512;
wgrad >= 0.8x dense wgrad.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tools.gpu_check.correctness import BF16_RTOL, f32_rtol
from tools.gpu_check.timing import time_interleaved

__all__ = ["GROUPED_BENCH", "GROUPED_TARGETS", "grouped_items"]

# (G, rows per expert, N, K): DeepSeek-V3's routed-expert up (N, K = 4096, 7168 for the
# fused gate/up of 2048 each) and down (7168, 2048) projections.
GROUPED_BENCH = ((8, 4096, 4096, 7168), (8, 4096, 7168, 2048), (8, 512, 4096, 7168))
GROUPED_TARGETS = {"grouped_over_dense_4096": 0.85, "grouped_over_xla": 5.0,
                   "grouped_over_dense_512": 0.6, "wgrad_over_dense_wgrad": 0.8}
BENCH_ROUNDS = 20


def _layouts(m: int, g: int) -> dict[str, list[int]]:
    """Expert layouts of ``m`` rows: balanced; skewed with two empty experts and
    boundaries off the tiles; a quarter of the rows past the sum."""
    base = m // g
    skew = [0, 3 * base + 17, base - 17, 0] + [base] * (g - 4)
    skew[-1] += m - sum(skew)
    tail = [base * 3 // 4 + (1 if i % 2 else -1) * 5 for i in range(g)]
    return {"balanced": [base] * g, "skewed": skew, "tail": tail}


def _operands(m: int, n: int, k: int, g: int, seed: int = 0) -> dict[str, Any]:
    """Tokens x [m, k] (1x128 tiles spanning 2^±6) and experts w [g, n, k] (128x128
    blocks spanning 2^±6), quantized by the pure-JAX quantizers."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.quantize import quantize_1x128_reference, quantize_128x128_reference

    kx, kw, ex, ew = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (m, k), jnp.float32) * jnp.repeat(
        2.0 ** jax.random.randint(ex, (m, k // 128), -6, 7).astype(jnp.float32), 128, 1)
    mag = 2.0 ** jax.random.randint(ew, (g, n // 128, k // 128), -6, 7).astype(jnp.float32)
    w = jax.random.normal(kw, (g, n, k), jnp.float32) * jnp.repeat(
        jnp.repeat(mag, 128, 1), 128, 2)
    xq, xs = quantize_1x128_reference(x)
    wq, ws = jax.vmap(quantize_128x128_reference)(w)
    return dict(x=x, w=w, xq=xq, xs=xs, wq=wq, ws=ws)


def _sample(size: int, count: int, seed: int):
    import numpy as np

    return np.sort(np.random.default_rng(seed).choice(size, min(size, count), replace=False))


def _grouped_rel_error(out, xq, xs, wq, ws, sizes, seed=0) -> float:
    """Relative Frobenius error of ``out`` [M, N] on sampled rows and columns against the
    float64 product of each row with its expert (zeros past the sum)."""
    import numpy as np

    m, n = out.shape
    rows, cols = _sample(m, 256, seed), _sample(n, 256, seed + 1)
    ends = np.cumsum(sizes)
    gid = np.searchsorted(ends, rows, side="right")
    xd = np.asarray(xq[rows], np.float64) * np.repeat(np.asarray(xs[rows], np.float64), 128, 1)
    ref = np.zeros((len(rows), len(cols)))
    wsf = np.asarray(ws, np.float64)
    for g in np.unique(gid):
        if g >= len(sizes):
            continue
        sel = gid == g
        wd = (np.asarray(wq[g][cols], np.float64)
              * np.repeat(np.repeat(wsf[g], 128, 0)[cols], 128, 1))
        ref[sel] = xd[sel] @ wd.T
    got = np.asarray(out[rows][:, cols], np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))


def check_grouped(m: int, n: int, k: int, g: int, *, impl: str,
                  layouts: tuple[str, ...] = ("balanced", "skewed", "tail")) -> dict:
    """The grouped forward at ``layouts`` (bf16 and f32 out) vs float64 on samples."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import grouped_fp8_matmul

    ops = _operands(m, n, k, g)
    row: dict[str, Any] = {"shape": [m, n, k, g]}
    ok = True
    for name in layouts:
        sizes = _layouts(m, g)[name]
        gs = jnp.array(sizes, jnp.int32)
        for dt in ("bfloat16", "float32"):
            out = grouped_fp8_matmul(ops["xq"], ops["xs"], ops["wq"], ops["ws"], gs,
                                     out_dtype=dt, impl=impl)
            err = _grouped_rel_error(out, ops["xq"], ops["xs"], ops["wq"], ops["ws"], sizes)
            bound = BF16_RTOL if dt == "bfloat16" else f32_rtol(impl)
            past = np.asarray(out[sum(sizes):], np.float32)
            tail_zero = bool(not past.size or not np.any(past))
            row[f"{name}-{dt}"] = {"sizes": sizes, "rel_fro_vs_float64": err, "bound": bound,
                                   "rows_past_sum_zero": tail_zero}
            ok = ok and err < bound and tail_zero
    row["ok"] = bool(ok)
    return row


def check_grouped_gradients(m: int, n: int, k: int, g: int, *, impl: str) -> dict:
    """dgrad and wgrad at the skewed layout against their reference paths (which compute
    every expert for every row: keep the shape moderate)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import grouped_fp8_dgrad, grouped_fp8_wgrad

    ops = _operands(m, n, k, g)
    row: dict[str, Any] = {"shape": [m, n, k, g]}
    sizes = _layouts(m, g)["skewed"]
    gs = jnp.array(sizes, jnp.int32)
    dy = jax.random.normal(jax.random.key(3), (m, n), jnp.float32)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    dx = grouped_fp8_dgrad(dy, ops["wq"], ops["ws"], gs, out_dtype=jnp.float32, impl=impl)
    dx_ref = grouped_fp8_dgrad(dy, ops["wq"], ops["ws"], gs, out_dtype=jnp.float32,
                               impl="reference")
    dw = grouped_fp8_wgrad(dy, ops["x"], gs, impl=impl)
    dw_ref = grouped_fp8_wgrad(dy, ops["x"], gs, impl="reference")
    row["dgrad_rel_fro_vs_reference"] = rel(dx, dx_ref)
    row["wgrad_rel_fro_vs_reference"] = rel(dw, dw_ref)
    tol = f32_rtol(impl)
    row["ok"] = bool(row["dgrad_rel_fro_vs_reference"] < tol
                     and row["wgrad_rel_fro_vs_reference"] < tol)
    return row


def bench_grouped(g: int, rows: int, n: int, k: int, *, impl: str, rounds: int,
                  rehearsal: bool, wgrad: bool) -> dict:
    """Median TFLOP/s, interleaved: the grouped kernel (balanced experts), the dense kernel
    on all the rows at once (same FLOPs), XLA's ragged_dot on the FP8 values widened to
    bf16; with ``wgrad``, the grouped and the dense weight-gradient kernels."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import (
        blockwise_fp8_matmul,
        grouped_fp8_matmul,
        grouped_fp8_wgrad_matmul,
        quantize_1x128,
    )
    from pallas_kernels.grouped_fp8_matmul import padded_token_layout

    m = g * rows
    ops = _operands(m, n, k, g)
    gs = jnp.full((g,), rows, jnp.int32)
    fns: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {}

    def add(name, fn, *args):
        jax.block_until_ready(fn(*args))
        fns[name] = (lambda: fn(*args), jax.block_until_ready)

    add("grouped", jax.jit(lambda a, sa, b, sb, s: grouped_fp8_matmul(
        a, sa, b, sb, s, impl=impl)), ops["xq"], ops["xs"], ops["wq"], ops["ws"], gs)
    add("dense", jax.jit(lambda a, sa, b, sb: blockwise_fp8_matmul(a, sa, b, sb, impl=impl)),
        ops["xq"], ops["xs"], ops["wq"][0], ops["ws"][0])
    add("xla_ragged_dot", jax.jit(lambda a, b, s: jax.lax.ragged_dot(
        a.astype(jnp.bfloat16), jnp.swapaxes(b, 1, 2).astype(jnp.bfloat16), s,
        preferred_element_type=jnp.bfloat16)), ops["xq"], ops["wq"], gs)
    flops = 2.0 * m * n * k
    if wgrad:  # dw[g] = dy_gᵀ x_g [N, K]: the tokens of each expert are the contraction
        dy = jax.random.normal(jax.random.key(4), (m, n), jnp.bfloat16)
        dest, blocks, tp = padded_token_layout(gs, m)
        gq, gsc = quantize_1x128(jnp.zeros((tp, n), dy.dtype).at[dest].set(dy).T, impl=impl)
        xq, xsc = quantize_1x128(jnp.zeros((tp, k), jnp.float32).at[dest].set(
            ops["x"]).T, impl=impl)
        add("grouped_wgrad", jax.jit(lambda a, sa, b, sb, bl: grouped_fp8_wgrad_matmul(
            a, sa, b, sb, bl, impl=impl)), gq, gsc, xq, xsc, blocks)
        # the dense weight gradient over all m tokens: [N, K], the same FLOPs
        add("dense_wgrad", jax.jit(lambda a, sa, b, sb: blockwise_fp8_matmul(
            a, sa, b, sb, out_dtype=jnp.float32, impl=impl)),
            gq[:, :m], gsc[:, :m // 128], xq[:, :m], xsc[:, :m // 128])
    times = time_interleaved(fns, rounds, rehearsal)
    tf = {name: flops / t["median_s"] / 1e12 for name, t in times.items()}
    ratios = {"grouped_over_dense": tf["grouped"] / tf["dense"],
              "grouped_over_xla": tf["grouped"] / tf["xla_ragged_dot"]}
    if wgrad:
        ratios["wgrad_over_dense_wgrad"] = tf["grouped_wgrad"] / tf["dense_wgrad"]
    return {"shape": {"experts": g, "rows_per_expert": rows, "n": n, "k": k},
            "impls": {name: {**times[name], "tflops_median": tf[name]} for name in times},
            "ratios": ratios, "targets": GROUPED_TARGETS, "ok": True}


def grouped_items(phase: str, *, rehearsal: bool, impl: str
                  ) -> list[tuple[str, Callable[[], dict]]]:
    """The grouped kernels' items of ``phase`` (none for the other phases)."""
    # Rehearsal: the smallest shapes that keep every path (an empty expert, boundaries
    # inside tiles, rows past the sum, several tiles per program); ~1-2 s an interpret call.
    if phase == "correctness":
        m, n, k, g = (128, 128, 128, 4) if rehearsal else (8 * 4096, 4096, 7168, 8)
        gm, gn, gk = (128, 128, 128) if rehearsal else (8 * 512, 1024, 1024)
        layouts = ("skewed",) if rehearsal else ("balanced", "skewed", "tail")
        return [(f"grouped-{m}x{n}x{k}-g{g}",
                 lambda: check_grouped(m, n, k, g, impl=impl, layouts=layouts)),
                (f"grouped-gradients-{gm}x{gn}x{gk}-g{g}",
                 lambda: check_grouped_gradients(gm, gn, gk, g, impl=impl))]
    if phase == "bench":
        cases = ((2, 64, 128, 128),) if rehearsal else GROUPED_BENCH
        rounds = 2 if rehearsal else BENCH_ROUNDS
        return [(f"grouped-g{g}-{rows}x{n}x{k}", lambda g=g, rows=rows, n=n, k=k, i=i:
                 bench_grouped(g, rows, n, k, impl=impl, rounds=rounds, rehearsal=rehearsal,
                               wgrad=i == 0))
                for i, (g, rows, n, k) in enumerate(cases)]
    return []
