"""The ``correctness`` phase: the kernels against float64 and the quantizers bit for bit.

The data (``block_magnitude_operands``) spreads per-block magnitudes over 2^-6..2^6, so every
block scale differs and a misapplied one shows; the error is measured on a sample of rows and
columns, spread evenly over the 128-blocks (``float64_errors``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BF16_RTOL", "DEEPGEMM_DIFF", "F32_RTOL_GPU", "F32_RTOL_INTERPRET", "SAMPLE_MIN",
           "block_magnitude_operands", "check_gradients", "check_matmul", "check_quantizers",
           "f32_rtol", "float64_errors"]

# Compiled kernel vs float64 of the same quantized operands, f32 output. Hopper's FP8
# wgmma accumulates a 128-wide K block with fewer bits than f32 (about 14, DeepSeek-V3
# §3.3.2) before the f32 promotion: ~2^-14 per block partial. 1e-3 is a loose first bound;
# the check records the measured values so that it can be tightened.
F32_RTOL_GPU = 1e-3
F32_RTOL_INTERPRET = 1e-6  # interpret mode: exact products, f32 sums
BF16_RTOL = 2.0**-8  # the final bf16 rounding is <= 2^-9 per element
DEEPGEMM_DIFF = 1e-3  # DeepGEMM tests/test_core.py: calc_diff < 0.001
SAMPLE_MIN = 128  # rows (and columns) of the float64 sample: spread over the 128-blocks


def block_magnitude_operands(m: int, n: int, k: int, *, b_rows: bool = False, seed: int = 0
                             ) -> dict[str, Any]:
    """Gaussian x [m, k] and w [n, k] whose 1x128 tiles (x) and 128x128 blocks (w; 1x128
    tiles with ``b_rows``) are scaled by 2^e, e uniform in -6..6, so every block scale
    differs; quantized with the pure-JAX quantizers. Built on the default device."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.quantize import quantize_1x128_reference, quantize_128x128_reference

    kx, kw, ex, ew = jax.random.split(jax.random.key(seed), 4)
    kb, nb = k // 128, -(-n // 128)
    x = jax.random.normal(kx, (m, k), jnp.float32) * jnp.repeat(
        2.0 ** jax.random.randint(ex, (m, kb), -6, 7).astype(jnp.float32), 128, 1)
    if b_rows:
        wmag = jnp.repeat(2.0 ** jax.random.randint(ew, (n, kb), -6, 7).astype(jnp.float32),
                          128, 1)
    else:
        e = 2.0 ** jax.random.randint(ew, (nb, kb), -6, 7).astype(jnp.float32)
        wmag = jnp.repeat(jnp.repeat(e, 128, 0), 128, 1)[:n]
    w = jax.random.normal(kw, (n, k), jnp.float32) * wmag
    xq, xs = quantize_1x128_reference(x)
    if b_rows:
        wq, ws = quantize_1x128_reference(w)
    else:
        wq, ws = quantize_128x128_reference(jnp.pad(w, ((0, -n % 128), (0, 0))))
        wq = wq[:n]
    return dict(x=x, w=w, xq=xq, xs=xs, wq=wq, ws=ws)


def _sample_index(size: int, seed: int):
    """About ``SAMPLE_MIN`` indices of ``size``, the same number (at least 2) in each
    128-block, sorted."""
    import numpy as np

    rng = np.random.default_rng(seed)
    per_block = max(2, -(-SAMPLE_MIN // -(-size // 128)))
    idx = []
    for b0 in range(0, size, 128):
        span = min(128, size - b0)
        idx += sorted(b0 + rng.choice(span, min(per_block, span), replace=False))
    return np.asarray(idx)


def float64_errors(out, ops: dict, *, seed: int = 0, worst: int = 5) -> dict[str, Any]:
    """``out`` [M, N] against float64 on a sample of rows and columns: the exact product
    of the dequantized operands (the kernel's semantics) and of the unquantized inputs
    (what the training path approximates)."""
    import numpy as np

    m, n = out.shape
    rows, cols = _sample_index(m, seed), _sample_index(n, seed + 1)
    got = np.asarray(out[rows][:, cols], np.float64)
    xs = np.repeat(np.asarray(ops["xs"][rows], np.float64), 128, 1)
    xd = np.asarray(ops["xq"][rows], np.float64) * xs
    ws = np.asarray(ops["ws"], np.float64)
    if ws.shape[0] != ops["wq"].shape[0]:  # per 128x128 block
        ws = np.repeat(ws, 128, 0)[:n]
    wd = np.asarray(ops["wq"][cols], np.float64) * np.repeat(ws[cols], 128, 1)
    ref = xd @ wd.T
    exact = (np.asarray(ops["x"][rows], np.float64)
             @ np.asarray(ops["w"][cols], np.float64).T)
    err = got - ref
    blocks = []
    for rb in np.unique(rows // 128):
        for cb in np.unique(cols // 128):
            r, c = rows // 128 == rb, cols // 128 == cb
            e, f = err[np.ix_(r, c)], ref[np.ix_(r, c)]
            blocks.append((float(np.linalg.norm(e) / max(np.linalg.norm(f), 1e-300)),
                           int(rb), int(cb)))
    blocks.sort(reverse=True)
    return {
        "sampled_rows": len(rows), "sampled_cols": len(cols),
        "rel_fro_vs_float64": float(np.linalg.norm(err) / np.linalg.norm(ref)),
        "max_abs_error": float(np.max(np.abs(err))),
        "max_error_over_max_abs_ref": float(np.max(np.abs(err)) / np.max(np.abs(ref))),
        "worst_blocks": [{"row_block": rb, "col_block": cb, "rel_fro": e}
                         for e, rb, cb in blocks[:worst]],
        "deepgemm_diff_vs_unquantized": float(np.sum((got - exact) ** 2)
                                              / np.sum(got * got + exact * exact)),
    }


def _bits_equal(a, b) -> tuple[bool, int]:
    import numpy as np

    ua = np.asarray(a).view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)
    ub = np.asarray(b).view(np.uint8 if b.dtype.itemsize == 1 else np.uint32)
    bad = int(np.sum(ua != ub))
    return bad == 0, bad


def _hard_input(rows: int, cols: int, dtype, seed: int):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-20, 20, (rows, cols))
    x[:128, :128] = 0.0
    x[128:130, 128:256] = 1e-40 if np.dtype(dtype) == np.float32 else 1e-30
    x[130, :128] = 3e38
    x[131, 256:384] = np.nan
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


def check_quantizers(impl: str = "kernel", shape=(4096, 7168), dtypes=None,
                     pow2s=(False, True)) -> dict:
    """Compiled quantizers vs ``fmtkit.quantize`` (XLA on the same device), bit for bit."""
    import jax.numpy as jnp
    import numpy as np

    from fmtkit.scaling import BlockScaling, quantize
    from pallas_kernels import quantize_1x128, quantize_128x128

    out: dict[str, Any] = {}
    ok_all = True
    for dtype in dtypes or (jnp.float32, jnp.bfloat16):
        x = _hard_input(*shape, dtype, seed=0)
        for pow2 in pow2s:
            for name, fn, block in (("1x128", quantize_1x128, (1, 128)),
                                    ("128x128", quantize_128x128, (128, 128))):
                v, s = fn(x, power_of_two=pow2, impl=impl)
                sa = quantize(x, "e4m3", BlockScaling(block, power_of_two=pow2))
                nan = np.isnan(np.asarray(sa.values, np.float32))
                same_nan = bool(np.array_equal(np.isnan(np.asarray(v, np.float32)), nan))
                ok_v, bad_v = _bits_equal(np.asarray(v)[~nan], np.asarray(sa.values)[~nan])
                ok_s, bad_s = _bits_equal(s, sa.scale)
                ok = ok_v and ok_s and same_nan
                ok_all = ok_all and ok
                out[f"{name}-{np.dtype(dtype).name}-pow2={pow2}"] = {
                    "ok": ok, "value_mismatches": bad_v, "scale_mismatches": bad_s,
                    "nan_mask_equal": same_nan}
    out["ok"] = ok_all
    return out


def f32_rtol(impl: str) -> float:
    """The f32-output bound of ``impl``: interpret mode sums exactly in f32, the GPU not."""
    return F32_RTOL_INTERPRET if impl == "interpret" else F32_RTOL_GPU


def check_matmul(m: int, n: int, k: int, *, impl: str, config=None,
                 out_dtypes=("bfloat16", "float32"), b_rows: bool = False) -> dict:
    """``blockwise_fp8_matmul`` on block-magnitude data, each output dtype against float64
    on a sample of rows and columns."""
    from pallas_kernels import blockwise_fp8_matmul

    ops = block_magnitude_operands(m, n, k, b_rows=b_rows, seed=m + n + k)
    row: dict[str, Any] = {"shape": [m, n, k], "b_rows": b_rows,
                           "config": None if config is None else str(config)}
    ok = True
    for dt in out_dtypes:
        out = blockwise_fp8_matmul(ops["xq"], ops["xs"], ops["wq"], ops["ws"], out_dtype=dt,
                                   impl=impl, config=config)
        e = float64_errors(out, ops)
        bound = BF16_RTOL if dt == "bfloat16" else f32_rtol(impl)
        e["ok"] = bool(e["rel_fro_vs_float64"] < bound
                       and e["deepgemm_diff_vs_unquantized"] < DEEPGEMM_DIFF)
        e["bound"] = bound
        row[dt] = e
        ok = ok and e["ok"]
    row["ok"] = ok
    return row


def check_gradients(m: int, n: int, k: int, *, impl: str) -> dict:
    """``blockwise_fp8_dgrad`` / ``blockwise_fp8_wgrad`` vs their reference paths and the
    unquantized weight gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import blockwise_fp8_dgrad, blockwise_fp8_wgrad

    ops = block_magnitude_operands(m, n, k, seed=2)
    dy = jax.random.normal(jax.random.key(3), (m, n), jnp.float32)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    dx = blockwise_fp8_dgrad(dy, ops["wq"], ops["ws"], out_dtype=jnp.float32, impl=impl)
    dx_ref = blockwise_fp8_dgrad(dy, ops["wq"], ops["ws"], out_dtype=jnp.float32,
                                 impl="reference")
    dw = blockwise_fp8_wgrad(dy, ops["x"], impl=impl)
    dw_ref = blockwise_fp8_wgrad(dy, ops["x"], impl="reference")
    dw_exact = np.asarray(dy, np.float64).T @ np.asarray(ops["x"], np.float64)
    got = np.asarray(dw, np.float64)
    row = {"shape": [m, n, k], "dgrad_rel_fro_vs_reference": rel(dx, dx_ref),
           "wgrad_rel_fro_vs_reference": rel(dw, dw_ref),
           "wgrad_deepgemm_diff_vs_unquantized": float(
               np.sum((got - dw_exact) ** 2) / np.sum(got * got + dw_exact * dw_exact))}
    tol = f32_rtol(impl)
    row["ok"] = bool(row["dgrad_rel_fro_vs_reference"] < tol
                     and row["wgrad_rel_fro_vs_reference"] < tol
                     and row["wgrad_deepgemm_diff_vs_unquantized"] < DEEPGEMM_DIFF)
    return row
