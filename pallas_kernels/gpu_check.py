"""The one prepared GPU check: the first command a GPU session runs, and all it needs to run.

    python3 -m pallas_kernels.gpu_check OUTDIR                   # <= 8 min on one H200
    python3 -m pallas_kernels.gpu_check --cpu-rehearsal OUTDIR   # the same code on CPU

It leaves two files in OUTDIR: ``gpu_check.json`` (the summary, rewritten as every item
finishes) and ``gpu_check_logs.tar.gz`` (every worker's log, the per-phase results, ptxas's
output and the telemetry samples; rebuilt after every phase). Phases, in order:

1. ``compile``: the device, driver and versions; then every shipped config in the
   forward form (bf16 out) and the weight-gradient form (B scaled per row, f32 out), each
   under its own kernel name, with lowering, XLA compile (Mosaic GPU's PTX and ptxas) and
   first-run times taken separately, and ptxas's registers, spill bytes and any wgmma
   serialization warning attributed to the kernel by name (``MOSAIC_GPU_DUMP_PTXAS=1``).
   Configs that fail here are left out of the later phases.
2. ``correctness``: block-magnitude data (per-block magnitudes spread over 2^-6..2^6, so
   every scale differs and a misapplied one shows) at the production shapes, bf16 and f32
   output, against float64 on a sample of rows and columns (128 of each, spread evenly
   over the 128-blocks):
   relative Frobenius error, max error, the worst blocks; the gradient GEMMs; the
   quantizers bit for bit against ``fmtkit.quantize``.
3. ``bench``: per production shape, interleaved rounds (>= 30) of the kernel with bf16
   and with f32 output, XLA's bf16 dot, XLA's per-tensor FP8 dot (whether XLA made it a
   cuBLASLt FP8 GEMM is read from the compiled HLO) and ``torch._scaled_mm`` with
   blockwise scales when torch is importable; min / median / max and TFLOP/s.
4. ``train``: the policied training step of a small transformer LM under bf16-mixed,
   fp8-current and fp8-blockwise (steps/s), through the ``fmtkit bench fp8-step`` CLI
   (run as a command: this package never imports ``studies``).
5. ``tune``: every shipped config at 8192^3 and 4096x7168x2048 (data for ``choose_config``).
6. ``pytest``: the compiled-mode kernel tests, in the time left.

Nothing can hang the window: every item runs in a worker subprocess (its own process
group) that the watcher kills when the item overruns its timeout, when the phase's share
of the time left (``PHASE_SHARE``) or the global ``--deadline`` runs out (checked every
0.5 s); the worker is restarted on the remaining items. The watcher itself never
initializes a JAX backend (it would take the GPU's memory from the workers); it samples
``nvidia-smi`` (clocks, power, temperature, throttle reasons) before, during and after.
With ``--cpu-rehearsal`` every phase runs the same functions on CPU at tiny shapes in
GPU-interpret mode; values only a GPU can give are null. Exit status 1 if a check failed
or hung, 0 otherwise (also without a Hopper GPU, after saying so).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Compiled kernel vs float64 of the same quantized operands, f32 output. Hopper's FP8
# wgmma accumulates a 128-wide K block with fewer bits than f32 (about 14, DeepSeek-V3
# §3.3.2) before the f32 promotion: ~2^-14 per block partial. 1e-3 is a loose first bound;
# the check records the measured values so that it can be tightened.
F32_RTOL_GPU = 1e-3
F32_RTOL_INTERPRET = 1e-6  # interpret mode: exact products, f32 sums
BF16_RTOL = 2.0**-8  # the final bf16 rounding is <= 2^-9 per element
DEEPGEMM_DIFF = 1e-3  # DeepGEMM tests/test_core.py: calc_diff < 0.001
# The issue's production shapes: 8192^3 and DeepSeek-V3's projections at M = 4096 tokens.
PRODUCTION_SHAPES = ((8192, 8192, 8192), (4096, 7168, 16384), (4096, 7168, 2048),
                     (4096, 24576, 1536), (4096, 2112, 7168))
TUNE_SHAPES = ((8192, 8192, 8192), (4096, 7168, 2048))
# Several tiles per CTA for every config on 132 SMs and 8 K blocks (every ring wraps).
COMPILE_SHAPE = (4096, 2048, 1024)
BENCH_ROUNDS = 30
TUNE_ROUNDS = 10
BATCH_TARGET_S = 2e-3  # calls per timed batch: enough that one dispatch is noise
SAMPLE_MIN = 128  # rows (and columns) of the float64 sample: spread over the 128-blocks
PHASES = ("compile", "correctness", "bench", "train", "tune", "pytest")
# Per-item limits (seconds): a Mosaic GPU compile takes seconds; minutes mean a hang.
ITEM_TIMEOUT_S = {"compile": 90.0, "correctness": 90.0, "bench": 100.0, "train": 180.0,
                  "tune": 100.0}
STARTUP_TIMEOUT_S = 120.0  # a worker that has not started its first item by then is stuck
MIN_PHASE_S = 20.0  # starting a worker (imports, backend) costs ~5-10 s: not worth it below
MAX_RESTARTS = 4  # per phase; each restart skips the item that hung or crashed
# Share of the time left that a phase may use (the rest stays for the later phases). With
# the default 480 s and phases that use their budget: compile ~95 s, correctness ~95,
# bench ~115, train ~130, tune ~35, pytest the rest (phases that finish early leave
# their time to the next).
PHASE_SHARE = {"compile": 0.2, "correctness": 0.25, "bench": 0.4, "train": 0.75,
               "tune": 0.8}
_POLL_S = 0.5
_SUMMARY_EVERY_S = 2.0
_REPO = Path(__file__).resolve().parents[1]
_SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm",
               "power.draw", "power.limit", "temperature.gpu", "utilization.gpu",
               "clocks_throttle_reasons.active")
_KERNEL_MARK = "=== gpu_check kernel: "


# --------------------------------------------------------------------------------------
# Data and error measures (run in a worker; they import JAX).


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


def _f32_rtol(impl: str) -> float:
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
        bound = BF16_RTOL if dt == "bfloat16" else _f32_rtol(impl)
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
    tol = _f32_rtol(impl)
    row["ok"] = bool(row["dgrad_rel_fro_vs_reference"] < tol
                     and row["wgrad_rel_fro_vs_reference"] < tol
                     and row["wgrad_deepgemm_diff_vs_unquantized"] < DEEPGEMM_DIFF)
    return row


def compile_kernel(m: int, n: int, k: int, *, impl: str, config, out_dtype: str,
                   b_rows: bool) -> dict:
    """One kernel variant: lowering, compile and first-run times taken separately, a
    second run, and its output against float64 on a sample. Prints a marker with the
    kernel's name first, so that ptxas's report in the log can be attributed."""
    import functools

    import jax

    from pallas_kernels import blockwise_fp8_matmul
    from pallas_kernels.blockwise_fp8_matmul import kernel_name

    name = kernel_name(config, out_dtype, b_rows)
    print(f"{_KERNEL_MARK}{name} ===", flush=True)
    ops = block_magnitude_operands(m, n, k, b_rows=b_rows, seed=5)
    args = (ops["xq"], ops["xs"], ops["wq"], ops["ws"])
    jax.block_until_ready(args)
    fn = jax.jit(functools.partial(blockwise_fp8_matmul, out_dtype=out_dtype, impl=impl,
                                   config=config))
    t0 = time.perf_counter()
    lowered = fn.trace(*args).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    t4 = time.perf_counter()
    print(f"{_KERNEL_MARK}end ===", flush=True)
    e = float64_errors(out, ops)
    bound = BF16_RTOL if out_dtype == "bfloat16" else _f32_rtol(impl)
    return {"kernel": name, "config": str(config), "out_dtype": out_dtype,
            "form": "wgrad (B scaled per row)" if b_rows else "forward (B per 128x128)",
            "shape": [m, n, k], "lower_s": t1 - t0, "compile_s": t2 - t1,
            "first_run_s": t3 - t2, "second_run_s": t4 - t3,
            "rel_fro_vs_float64": e["rel_fro_vs_float64"],
            "ok": bool(e["rel_fro_vs_float64"] < bound)}


def environment() -> dict:
    import jax
    import jaxlib

    from pallas_kernels import _backend

    dev = jax.devices()[0]
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {"ok": True, "python": sys.version.split()[0], "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
            "device": getattr(dev, "device_kind", str(dev)),
            "compute_capability": getattr(dev, "compute_capability", None),
            "num_sms": _backend.num_sms("kernel"), "hopper": _backend.is_hopper(),
            "torch": torch_version, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


# --------------------------------------------------------------------------------------
# Timing (run in a worker).


def _batch_size(fn: Callable[[], Any], sync: Callable[[Any], Any], rehearsal: bool) -> int:
    if rehearsal:
        return 1
    t0 = time.perf_counter()
    sync([fn() for _ in range(3)])
    per_call = (time.perf_counter() - t0) / 3
    return max(1, min(50, math.ceil(BATCH_TARGET_S / max(per_call, 1e-7))))


def time_interleaved(fns: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]],
                     rounds: int, rehearsal: bool) -> dict[str, dict]:
    """Per implementation ``(call, sync)``: after warm-up, ``rounds`` rounds in which every
    implementation runs one batch of calls in turn (so drifting clocks hit all alike); a
    batch is timed on the host from its first dispatch to ``sync`` (dispatch overlaps the
    device's work; the batch is long enough, ``BATCH_TARGET_S``, for one dispatch to be
    noise). Returns per implementation min / median / max seconds per call."""
    batch = {}
    for name, (fn, sync) in fns.items():
        sync(fn())
        batch[name] = _batch_size(fn, sync, rehearsal)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (fn, sync) in fns.items():
            t0 = time.perf_counter()
            sync([fn() for _ in range(batch[name])])
            samples[name].append((time.perf_counter() - t0) / batch[name])
    return {name: {"min_s": min(v), "median_s": statistics.median(v), "max_s": max(v),
                   "samples": len(v), "calls_per_sample": batch[name]}
            for name, v in samples.items()}


def _xla_fp8_per_tensor(ops):
    """XLA's per-tensor FP8 GEMM: e4m3 operands with one f32 scale each, dequantized in
    the pattern XLA's GEMM rewriter turns into a cuBLASLt FP8 matmul on Hopper; returns
    (jitted fn, args, whether the compiled HLO calls cuBLASLt's FP8 GEMM, the GEMM
    custom-call targets found)."""
    import jax
    import jax.numpy as jnp

    def quant(t):
        s = jnp.max(jnp.abs(t)) / 448.0
        return (t / s).astype(jnp.float8_e4m3fn), s

    xq, xs = quant(ops["x"])
    wq, ws = quant(ops["w"])

    @jax.jit
    def fn(a, sa, b, sb):
        a = a.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16)
        b = b.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16)
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.bfloat16)

    args = (xq, xs, wq, ws)
    hlo = fn.lower(*args).compile().as_text()
    targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    gpu = jax.default_backend() == "gpu"
    used = any("f8" in t and "cublas" in t for t in targets) if gpu else None
    return fn, args, used, targets


def _torch_blockwise(m: int, n: int, k: int):
    """``torch._scaled_mm`` with 1x128 scales on A and 128x128 on B (cuBLAS's blockwise
    FP8 GEMM), or the reason it is not available."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    try:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        sa = torch.ones(m, k // 128, device="cuda", dtype=torch.float32)
        sb = torch.ones(-(-n // 128), k // 128, device="cuda", dtype=torch.float32)

        def call():
            return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(),
                                    out_dtype=torch.bfloat16)

        call()
        torch.cuda.synchronize()
        return (call, lambda _: torch.cuda.synchronize()), None
    except Exception as e:  # an older torch, or a shape cuBLAS rejects: say which
        return None, f"{type(e).__name__}: {e}"[:500]


def bench_shape(m: int, n: int, k: int, *, impl: str, config, rounds: int,
                rehearsal: bool) -> dict:
    """TFLOP/s of every implementation at one shape, interleaved (see ``time_interleaved``)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import blockwise_fp8_matmul
    from pallas_kernels.bench import make_operands

    ops = make_operands(m, n, k)
    fp8_args = (ops["xq"], ops["xs"], ops["wq"], ops["ws"])
    fns: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {}
    first_call: dict[str, float | None] = {}

    def add(name, fn, args):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        first_call[name] = time.perf_counter() - t0
        fns[name] = (lambda: fn(*args), jax.block_until_ready)

    for dt in ("bfloat16", "float32"):
        add(f"pallas_fp8_{dt}", jax.jit(lambda a, sa, b, sb, dt=dt: blockwise_fp8_matmul(
            a, sa, b, sb, out_dtype=dt, impl=impl, config=config)), fp8_args)
    add("xla_bf16", jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16)),
        (ops["x16"], ops["wt16"]))
    fp8_fn, fp8_args_t, cublaslt, targets = _xla_fp8_per_tensor(ops)
    add("xla_fp8_per_tensor", fp8_fn, fp8_args_t)
    torch_fns, torch_error = (None, "CPU rehearsal: no device") if rehearsal else (
        _torch_blockwise(m, n, k))
    if torch_fns is not None:
        fns["torch_scaled_mm_blockwise"] = torch_fns
    times = time_interleaved(fns, rounds, rehearsal)
    flops = 2.0 * m * n * k
    impls: dict[str, Any] = {}
    for name in ("pallas_fp8_bfloat16", "pallas_fp8_float32", "xla_bf16",
                 "xla_fp8_per_tensor", "torch_scaled_mm_blockwise"):
        t = times.get(name)
        impls[name] = None if t is None else {
            **t, "tflops_median": flops / t["median_s"] / 1e12,
            "tflops_best": flops / t["min_s"] / 1e12, "first_call_s": first_call.get(name)}

    def ratio(a, b):
        return (impls[a]["tflops_median"] / impls[b]["tflops_median"]
                if impls[a] and impls[b] else None)

    return {"shape": [m, n, k], "config": str(config), "impls": impls,
            "xla_fp8_uses_cublaslt_fp8": cublaslt, "xla_fp8_custom_calls": targets,
            "torch_error": torch_error, "timing": "host, interleaved batches",
            "ratios": {"pallas_bf16_over_xla_bf16": ratio("pallas_fp8_bfloat16", "xla_bf16"),
                       "pallas_bf16_over_xla_fp8": ratio("pallas_fp8_bfloat16",
                                                         "xla_fp8_per_tensor"),
                       "pallas_bf16_over_pallas_f32": ratio("pallas_fp8_bfloat16",
                                                            "pallas_fp8_float32"),
                       "pallas_bf16_over_torch": ratio("pallas_fp8_bfloat16",
                                                       "torch_scaled_mm_blockwise")},
            "ok": True}


def tune_shape(m: int, n: int, k: int, *, impl: str, configs: list, rounds: int,
               rehearsal: bool) -> dict:
    """Every config (bf16 out) at one shape, interleaved."""
    import jax

    from pallas_kernels import blockwise_fp8_matmul
    from pallas_kernels.bench import make_operands

    ops = make_operands(m, n, k)
    args = (ops["xq"], ops["xs"], ops["wq"], ops["ws"])
    fns = {}
    for cfg in configs:
        fn = jax.jit(lambda a, sa, b, sb, cfg=cfg: blockwise_fp8_matmul(
            a, sa, b, sb, impl=impl, config=cfg))
        fns[str(cfg)] = (lambda fn=fn: fn(*args), jax.block_until_ready)
    times = time_interleaved(fns, rounds, rehearsal)
    flops = 2.0 * m * n * k
    return {"shape": [m, n, k], "ok": True, "configs": {
        name: {**t, "tflops_median": flops / t["median_s"] / 1e12} for name, t in times.items()}}


# Small transformer of the training-step phase: d_model 1024, 4 blocks, 8192 tokens a step
# (GEMMs of 8192 x 1024 x 4096: big enough that FP8's GEMM speed shows, small enough to
# compile four variants in about a minute).
TRAIN_ARGS = ("--d-model", "1024", "--layers", "4", "--heads", "8", "--seq", "1024",
              "--lm-batch", "8", "--repeats", "20")
TRAIN_ARGS_REHEARSAL = ("--d-model", "32", "--layers", "1", "--heads", "2", "--seq", "16",
                        "--lm-batch", "2", "--repeats", "1")
_TRAIN_VARIANTS = {"bf16-mixed": "bf16", "fp8-current": "current",
                   "fp8-blockwise": "blockwise", "f32": "f32"}


def train_step(work: Path, rehearsal: bool) -> dict:
    """Steps/s of the policied train step (``fmtkit bench fp8-step``, transformer only),
    run as a command in this worker's process group."""
    out = work / "train"
    cmd = [sys.executable, "-m", "studies.cli", "bench", "fp8-step", "--models",
           "transformer", "--recipes", "current,blockwise", "--out", str(out),
           *(TRAIN_ARGS_REHEARSAL if rehearsal else TRAIN_ARGS)]
    proc = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-6000:], flush=True)
    if proc.returncode:
        return {"ok": False, "error": f"exit status {proc.returncode}: {proc.stderr[-2000:]}",
                "command": " ".join(cmd)}
    res = json.loads((out / "results.json").read_text())["transformer"]
    secs = res["seconds"]
    return {"ok": True, "command": " ".join(cmd),
            "steps_per_s": {k: (1.0 / secs[v] if v in secs else None)
                            for k, v in _TRAIN_VARIANTS.items()},
            "step_ms": {k: (secs[v] * 1e3 if v in secs else None)
                        for k, v in _TRAIN_VARIANTS.items()},
            "compile_s": {k: res["compile_seconds"].get(v) for k, v in _TRAIN_VARIANTS.items()},
            "loss": {k: res["loss"].get(v) for k, v in _TRAIN_VARIANTS.items()}}


# --------------------------------------------------------------------------------------
# The items of each phase.


def _items(phase: str, *, rehearsal: bool, work: Path, excluded: set[str]
           ) -> list[tuple[str, Callable[[], dict]]]:
    """(name, thunk) pairs of a phase, in the order they run."""
    from pallas_kernels import _backend
    from pallas_kernels.config import SHIPPED_CONFIGS, choose_config

    impl = "interpret" if rehearsal else "kernel"
    configs = [c for c in SHIPPED_CONFIGS.values() if str(c) not in excluded]
    if rehearsal:  # two configs, one per form, at tiny shapes: the same code, on CPU
        configs = [c for c in configs if str(c) in (str(SHIPPED_CONFIGS["128x128"]),
                                                    str(SHIPPED_CONFIGS["256x128"]))]

    def chosen(m, n, k):
        """choose_config, or the first config that passed the compile phase."""
        cfg = choose_config(m, n, k, "bfloat16", _backend.num_sms("kernel"))
        return cfg if str(cfg) not in excluded or not configs else configs[0]

    # Rehearsal shapes: the smallest that still take the N-tail path (N = 1.5 tiles) and
    # wrap nothing; GPU-interpret mode costs ~0.5-2 s a call on a loaded CPU.
    shapes = ((128, 192, 256),) if rehearsal else PRODUCTION_SHAPES
    tiny = (128, 128, 128)
    items: list[tuple[str, Callable[[], dict]]] = []
    if phase == "compile":
        items.append(("env", environment))
        m, n, k = tiny if rehearsal else COMPILE_SHAPE
        forms = (("bfloat16", False), ("float32", True))
        for i, cfg in enumerate(configs):
            # rehearsal: one form per config (128x128 forward, 256x128 weight gradient)
            for dt, b_rows in forms[i:i + 1] if rehearsal else forms:
                items.append((f"kernel-{cfg}-{dt}{'-brows' if b_rows else ''}",
                              lambda cfg=cfg, dt=dt, b_rows=b_rows: compile_kernel(
                                  m, n, k, impl=impl, config=cfg, out_dtype=dt,
                                  b_rows=b_rows)))
    elif phase == "correctness":
        for m, n, k in shapes:
            items.append((f"matmul-{m}x{n}x{k}", lambda m=m, n=n, k=k: check_matmul(
                m, n, k, impl=impl, config=chosen(m, n, k))))
        g = tiny if rehearsal else (4096, 7168, 2048)
        items.append((f"gradients-{'x'.join(map(str, g))}",
                      lambda: check_gradients(*g, impl=impl)))
        q = (256, 256) if rehearsal else (4096, 7168)
        items.append((f"quantizers-{q[0]}x{q[1]}", lambda: check_quantizers(
            impl, shape=q, pow2s=(False,) if rehearsal else (False, True))))
    elif phase == "bench":
        rounds = 2 if rehearsal else BENCH_ROUNDS
        for m, n, k in (tiny,) if rehearsal else shapes:
            items.append((f"{m}x{n}x{k}", lambda m=m, n=n, k=k: bench_shape(
                m, n, k, impl=impl, config=chosen(m, n, k), rounds=rounds,
                rehearsal=rehearsal)))
    elif phase == "train":
        items.append(("transformer-step", lambda: train_step(work, rehearsal)))
    elif phase == "tune":
        rounds = 1 if rehearsal else TUNE_ROUNDS
        for m, n, k in (tiny,) if rehearsal else TUNE_SHAPES:
            items.append((f"{m}x{n}x{k}", lambda m=m, n=n, k=k: tune_shape(
                m, n, k, impl=impl, configs=configs, rounds=rounds, rehearsal=rehearsal)))
    else:
        raise ValueError(f"phase must be one of {PHASES[:-1]}, got {phase!r}.")
    return items


# --------------------------------------------------------------------------------------
# Files.


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _record(results_file: Path, name: str, result: dict) -> None:
    data = _read_json(results_file, {"items": {}})
    data["items"][name] = result
    _write_json(results_file, data)


def _tar(work: Path, out_file: Path) -> None:
    tmp = out_file.with_name(out_file.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(work.rglob("*")):
            if f.is_file() and not f.name.endswith(".tmp"):
                tar.add(f, arcname=str(Path("gpu_check_logs") / f.relative_to(work)))
    os.replace(tmp, out_file)


# --------------------------------------------------------------------------------------
# Worker: runs the items of one phase, writing progress and results as it goes.


def _worker(phase: str, work: Path, deadline_at: float, skip: set[str], rehearsal: bool,
            excluded: set[str]) -> int:
    import jax

    if rehearsal:
        jax.config.update("jax_platforms", "cpu")
    results_file = work / f"{phase}.json"
    progress_file = work / f"{phase}.progress.json"
    items = _items(phase, rehearsal=rehearsal, work=work, excluded=excluded)
    for name, thunk in items:
        if name in skip:
            continue
        if time.time() > deadline_at:
            _record(results_file, name, {"skipped": "the phase's time ran out"})
            continue
        _write_json(progress_file, {"item": name, "started": time.time(), "pid": os.getpid()})
        print(f"[{phase}] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            result = thunk()
        except Exception:  # record and go on: the next items may still tell us something
            result = {"ok": False, "error": traceback.format_exc()[-4000:]}
        result = {"item_seconds": round(time.perf_counter() - t0, 3), **result}
        _record(results_file, name, result)
        print(f"[{phase}] {name}: {'ok' if result.get('ok') else 'FAILED'} "
              f"({result['item_seconds']:.1f} s)", flush=True)
        if name == "env" and not result.get("hopper") and not rehearsal:
            break  # nothing to compile here; the watcher reports it
    _write_json(progress_file, {"item": None, "done": True})
    return 0


# --------------------------------------------------------------------------------------
# Watcher: starts workers, kills them on a per-item timeout or the global deadline.


def supervise(cmd: list[str], progress_file: Path, *, item_timeout: float,
              deadline_at: float, log_file: Path, env: dict | None = None,
              startup_timeout: float = STARTUP_TIMEOUT_S,
              on_poll: Callable[[], None] | None = None) -> dict:
    """Runs ``cmd`` in a new process group; kills the group (SIGKILL) when the item named in
    ``progress_file`` has run longer than ``item_timeout``, when no item has started within
    ``startup_timeout``, or at ``deadline_at`` (epoch seconds). ``on_poll`` runs every
    ``_SUMMARY_EVERY_S`` while it waits (the summary is rewritten from it).

    Returns ``{"returncode", "killed": None or the reason, "item": the item in progress
    when it ended (None if it finished them all), "seconds"}``.
    """
    progress_file.unlink(missing_ok=True)
    t0 = last_poll = time.time()
    with open(log_file, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        killed = None
        while proc.poll() is None:
            time.sleep(_POLL_S)
            now = time.time()
            if on_poll is not None and now - last_poll > _SUMMARY_EVERY_S:
                on_poll()
                last_poll = now
            progress = _read_json(progress_file, {})
            item, started = progress.get("item"), progress.get("started")
            if now > deadline_at:
                killed = "deadline"
            elif not progress and now - t0 > startup_timeout:
                killed = f"no item started within {startup_timeout:.0f} s"
            elif item is not None and started is not None and now - started > item_timeout:
                killed = f"item ran past its {item_timeout:.0f} s timeout"
            if killed:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                break
    progress = _read_json(progress_file, {})
    return {"returncode": proc.returncode, "killed": killed, "item": progress.get("item"),
            "seconds": round(time.time() - t0, 1)}


def _run_phase(phase: str, work: Path, deadline_at: float, *, rehearsal: bool,
               excluded: set[str], env: dict, on_poll: Callable[[], None]) -> dict:
    results_file = work / f"{phase}.json"
    _write_json(results_file, {"items": {}})
    skip: list[str] = []
    runs = []
    timeout = ITEM_TIMEOUT_S[phase] * (2 if rehearsal else 1)  # CPU interpret mode is slow
    for _ in range(MAX_RESTARTS + 1):
        if deadline_at - time.time() < MIN_PHASE_S:
            runs.append({"not_started": "too little time left in the phase's budget"})
            break
        cmd = [sys.executable, "-m", "pallas_kernels.gpu_check", str(work), "--worker",
               phase, "--deadline-at", repr(deadline_at), "--skip", ",".join(skip),
               "--exclude-configs", ",".join(sorted(excluded))]
        if rehearsal:
            cmd.append("--cpu-rehearsal")
        outcome = supervise(cmd, work / f"{phase}.progress.json", item_timeout=timeout,
                            deadline_at=deadline_at, log_file=work / f"{phase}.log",
                            env=env, on_poll=on_poll)
        runs.append(outcome)
        item = outcome["item"]
        if outcome["returncode"] == 0 and item is None:
            break
        if item is None:  # died before or between items: nothing to skip, do not loop
            break
        if outcome["killed"] == "deadline":  # out of time, not a verdict on the kernel
            _record(results_file, item, {"skipped": "the phase's time ran out while it ran",
                                         "worker_seconds": outcome["seconds"]})
            break
        why = outcome["killed"] or f"worker died (exit status {outcome['returncode']})"
        _record(results_file, item, {"ok": False, "error": f"hung or crashed: {why}",
                                     "worker_seconds": outcome["seconds"]})
        print(f"[{phase}] {item}: FAILED ({why}); restarting on the remaining items",
              flush=True)
        skip.append(item)
    (work / f"{phase}.progress.json").unlink(missing_ok=True)
    data = _read_json(results_file, {"items": {}})
    data["workers"] = runs
    _write_json(results_file, data)
    return data


# --------------------------------------------------------------------------------------
# ptxas's report.

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FUNC_PROPS = re.compile(r"Function properties for (\S+)")


def parse_ptxas(log_text: str, kernels: list[str]) -> dict[str, dict]:
    """ptxas's verbose report (``MOSAIC_GPU_DUMP_PTXAS=1``: Mosaic GPU prints it to stdout
    as it compiles, per jaxlib 0.11.2's dump options) per kernel, from a worker log.

    A line belongs to the kernel named by the last ``Compiling entry function 'F'`` or
    ``Function properties for F`` line if one of ``kernels`` is a part of F (Mosaic GPU
    may decorate the name), else to the kernel whose ``_KERNEL_MARK`` marker was printed
    last (each compile item prints one before it compiles). All of a kernel's lines are
    kept. Returns, per kernel: registers, spill store / load bytes, stack frame bytes (the
    largest reported), wgmma-serialization warnings, the lines.
    """
    by_kernel: dict[str, list[str]] = {}
    marked = entry = None
    for line in log_text.splitlines():
        if line.startswith(_KERNEL_MARK):
            name = line.removeprefix(_KERNEL_MARK).removesuffix(" ===").strip()
            marked, entry = (None if name == "end" else name), None
            continue
        found = _ENTRY.search(line) or _FUNC_PROPS.search(line)
        if found:
            fn = found.group(1)
            entry = next((k for k in sorted(kernels, key=len, reverse=True) if k in fn),
                         None)
        owner = entry or marked
        if owner is None or not re.search(r"ptxas|registers|spill|stack frame|wgmma|"
                                          r"cmem|smem", line, re.IGNORECASE):
            continue
        by_kernel.setdefault(owner, []).append(line.strip())
    out = {}
    for name, lines in by_kernel.items():
        def biggest(pattern, lines=lines):
            vals = [int(v) for line in lines for v in re.findall(pattern, line)]
            return max(vals) if vals else None

        out[name] = {
            "registers": biggest(r"Used (\d+) registers"),
            "spill_store_bytes": biggest(r"(\d+) bytes spill stores"),
            "spill_load_bytes": biggest(r"(\d+) bytes spill loads"),
            "stack_frame_bytes": biggest(r"(\d+) bytes stack frame"),
            "wgmma_serialization_warnings": [
                line for line in lines if "wgmma" in line.lower() and "serializ" in line.lower()],
            "lines": lines}
    return out


# --------------------------------------------------------------------------------------
# nvidia-smi telemetry (the watcher; no JAX).


def gpu_telemetry() -> dict | None:
    """One ``nvidia-smi --query-gpu`` sample of the first GPU (clocks in MHz, power in W),
    or None where nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, f"--query-gpu={','.join(_SMI_FIELDS)}",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode or not proc.stdout.strip():
        return None
    values = [v.strip() for v in proc.stdout.splitlines()[0].split(",")]
    row: dict[str, Any] = {"time": time.time()}
    for key, v in zip(_SMI_FIELDS, values):
        try:
            row[key] = float(v)
        except ValueError:
            row[key] = v
    return row


class _Sampler:
    """Samples ``gpu_telemetry`` every ``period`` s in a thread, per phase."""

    def __init__(self, period: float = 1.0):
        self.period = period
        self.samples: dict[str, list[dict]] = {}
        self.phase: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = gpu_telemetry() is not None
        if self.available:
            self._thread.start()

    def _run(self):
        while not self._stop.wait(self.period):
            phase = self.phase
            if phase is not None:
                row = gpu_telemetry()
                if row is not None:
                    self.samples.setdefault(phase, []).append(row)

    def stop(self):
        self._stop.set()

    def summary(self) -> dict | None:
        if not self.available:
            return None

        def stats(rows, key):
            vals = [r[key] for r in rows if isinstance(r.get(key), float)]
            return ({"min": min(vals), "median": statistics.median(vals), "max": max(vals)}
                    if vals else None)

        return {phase: {"samples": len(rows), "sm_clock_mhz": stats(rows, "clocks.sm"),
                        "power_w": stats(rows, "power.draw"),
                        "temperature_c": stats(rows, "temperature.gpu"),
                        "throttle_reasons": sorted({str(r.get("clocks_throttle_reasons.active"))
                                                    for r in rows})}
                for phase, rows in self.samples.items()}


# --------------------------------------------------------------------------------------
# The summary.


def _empty_report(command: str, rehearsal: bool, deadline: float) -> dict:
    """Every field of the summary, null until measured (and null for good where a value
    needs a GPU and this is the CPU rehearsal)."""
    return {"command": command,
            "mode": "cpu-rehearsal (GPU-interpret mode, tiny shapes)" if rehearsal else "gpu",
            "deadline_s": deadline, "status": "running", "elapsed_s": 0.0,
            "env": None, "driver": None,
            "telemetry": {"before": None, "during": None, "after": None},
            "kernels": {}, "excluded_configs": [], "correctness": {}, "bench": {},
            "train": None, "tune": {}, "pytest": None, "phases": {}}


def _fill(report: dict, phase: str, items: dict, work: Path) -> None:
    """Copies a phase's item results into the summary's sections."""
    if phase == "compile":
        report["env"] = items.get("env")
        kernels = {r["kernel"]: r for r in items.values() if "kernel" in r}
        log = work / "compile.log"
        ptxas = parse_ptxas(log.read_text(), list(kernels)) if log.exists() else {}
        for name, r in kernels.items():
            p = ptxas.get(name, {})
            for key in ("registers", "spill_store_bytes", "spill_load_bytes",
                        "stack_frame_bytes"):
                r[key] = p.get(key)
            r["wgmma_serialization_warnings"] = p.get("wgmma_serialization_warnings")
            r["ptxas_lines"] = p.get("lines")
        report["kernels"] = kernels
    elif phase == "train":
        report["train"] = items.get("transformer-step")
    elif phase in ("correctness", "bench", "tune"):
        report[phase] = items


def _summary_lines(report: dict) -> list[str]:
    lines = []
    for name, r in report.get("bench", {}).items():
        impls = r.get("impls") or {}

        def tf(key, impls=impls):
            v = impls.get(key)
            return f"{v['tflops_median']:7.1f}" if v else "    n/a"

        if impls:
            lines.append(f"{name}: pallas bf16 {tf('pallas_fp8_bfloat16')} f32 "
                         f"{tf('pallas_fp8_float32')}  xla bf16 {tf('xla_bf16')}  xla fp8 "
                         f"{tf('xla_fp8_per_tensor')}  torch {tf('torch_scaled_mm_blockwise')}"
                         f" TFLOP/s (median) [{r.get('config')}]")
    train = report.get("train") or {}
    if train.get("steps_per_s"):
        lines.append("train steps/s: " + "  ".join(
            f"{k} {v:.2f}" for k, v in train["steps_per_s"].items() if v))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m pallas_kernels.gpu_check",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?", default=None,
                   help="folder for gpu_check.json and gpu_check_logs.tar.gz "
                        "(default runs/gpu-check)")
    p.add_argument("--out-dir", dest="out_dir_opt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=480.0,
                   help="seconds after which every worker is killed and the run ends "
                        "(default 480: fits a 10-minute device window with room to spare)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--cpu-rehearsal", action="store_true",
                   help="run every phase on CPU in GPU-interpret mode at tiny shapes "
                        "(no pytest): catches script errors before GPU time")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--skip", default="", help=argparse.SUPPRESS)
    p.add_argument("--exclude-configs", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir or args.out_dir_opt or "runs/gpu-check")
    if args.worker:  # out_dir is the watcher's work folder
        return _worker(args.worker, out_dir, args.deadline_at or time.time() + args.deadline,
                       set(filter(None, args.skip.split(","))), args.cpu_rehearsal,
                       set(filter(None, args.exclude_configs.split(","))))
    if args.deadline <= 0:
        p.error(f"--deadline must be positive, got {args.deadline}")
    phases = [s.strip() for s in args.phases.split(",") if s.strip()]
    bad = [s for s in phases if s not in PHASES]
    if bad:
        p.error(f"--phases: unknown {bad}; allowed: {', '.join(PHASES)}")
    if args.cpu_rehearsal and "pytest" in phases:
        phases.remove("pytest")
    out_dir.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    deadline_at = t_start + args.deadline
    report_file, tar_file = out_dir / "gpu_check.json", out_dir / "gpu_check_logs.tar.gz"
    command = " ".join(["python3 -m pallas_kernels.gpu_check",
                        *(argv if argv is not None else sys.argv[1:])])
    report = _empty_report(command, args.cpu_rehearsal, args.deadline)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    sampler = _Sampler()
    before = gpu_telemetry()
    report["telemetry"]["before"] = before
    report["driver"] = before.get("driver_version") if before else None

    def save():
        report["elapsed_s"] = round(time.time() - t_start, 1)
        report["telemetry"]["during"] = sampler.summary()
        _write_json(report_file, report)

    def refresh(phase):
        def poll():
            items = _read_json(work / f"{phase}.json", {}).get("items", {})
            report["phases"][phase] = {"ok": None, "items": items}
            _fill(report, phase, items, work)
            save()
        return poll

    env = dict(os.environ)  # workers import this checkout, wherever we were started from
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
    # Leave GPU memory to torch._scaled_mm (bench) and to the study's own process (train).
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    excluded: set[str] = set()
    failed = False
    save()
    try:
        for phase in phases:
            sampler.phase = phase
            if phase == "pytest":
                left = deadline_at - time.time()
                result = (run_pytest(left - 5.0, work / "pytest.log") if left > MIN_PHASE_S
                          else {"skipped": "too little time left before the global deadline"})
                report["pytest"] = result
                report["phases"]["pytest"] = {"ok": result.get("ok")}
                failed = failed or not result.get("ok", True)
                save()
                continue
            phase_env = dict(env)
            if phase == "compile":  # ptxas's register/spill report of every kernel compiled
                phase_env.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_RESOURCES="1")
            left = deadline_at - time.time()
            phase_deadline = time.time() + max(MIN_PHASE_S, PHASE_SHARE[phase] * left)
            data = _run_phase(phase, work, min(deadline_at, phase_deadline),
                              rehearsal=args.cpu_rehearsal, excluded=excluded, env=phase_env,
                              on_poll=refresh(phase))
            items = data.get("items", {})
            phase_ok = all(r.get("ok", True) for r in items.values())
            report["phases"][phase] = {"ok": phase_ok, **data}
            _fill(report, phase, items, work)
            failed = failed or not phase_ok
            print(f"[{phase}] {'ok' if phase_ok else 'FAILED'}: "
                  f"{sum(bool(r.get('ok')) for r in items.values())}/{len(items)} items ok, "
                  f"{sum('skipped' in r for r in items.values())} skipped", flush=True)
            if phase == "compile":
                env_item = items.get("env") or {}
                if not env_item.get("hopper") and not args.cpu_rehearsal:
                    report["status"] = ("no Hopper GPU: nothing checked" if env_item
                                        else "the compile worker did not report the device")
                    print(f"gpu_check: {report['status']} ({env_item.get('device')}).")
                    return 0 if env_item else 1
                for r in items.values():
                    if "config" in r and r.get("ok") is False:
                        excluded.add(r["config"])
                for name, r in items.items():  # hung or crashed: named by the item
                    m = re.match(r"^kernel-(bm\d+_bn\d+_split[mn]_s\d+)-", name)
                    if m and r.get("ok") is False:
                        excluded.add(m.group(1))
                report["excluded_configs"] = sorted(excluded)
            save()
            _tar(work, tar_file)
        skipped = any("skipped" in r for ph in report["phases"].values()
                      for r in (ph.get("items") or {}).values()) or any(
            "skipped" in (ph or {}) for ph in report["phases"].values())
        # "incomplete": nothing failed, but the time ran out before every item ran.
        report["status"] = "failed" if failed else "incomplete" if skipped else "passed"
    finally:
        sampler.phase = None
        sampler.stop()
        report["telemetry"]["after"] = gpu_telemetry()
        save()
        _tar(work, tar_file)
        shutil.rmtree(work, ignore_errors=True)
    for line in _summary_lines(report):
        print(line)
    print(f"gpu_check {report['status']}; wrote {report_file} and {tar_file}")
    return 1 if failed else 0


def run_pytest(timeout_s: float, log_file: Path) -> dict:
    """``pytest -m gpu tests/pallas_kernels`` (verbose, so each verdict is in the log as it
    happens); killed at ``timeout_s``: then the failures seen so far decide, and the rest
    counts as skipped."""
    cmd = [sys.executable, "-m", "pytest", "tests/pallas_kernels", "-m", "gpu", "-v",
           "-p", "no:cacheprovider"]
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=_REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    text = log_file.read_text()
    tail = text[-3000:]
    verdicts = re.findall(r"^(tests/\S+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.MULTILINE)
    failures = [t for t, v in verdicts if v in ("FAILED", "ERROR")]
    counts = {v: sum(1 for _, x in verdicts if x == v) for v in ("PASSED", "FAILED",
                                                                 "ERROR", "SKIPPED")}
    if rc is None:
        out = {"skipped": f"killed after {timeout_s:.0f} s (out of time)", "counts": counts,
               "failures": failures, "tail": tail}
        if failures:
            out["ok"] = False
        return out
    return {"ok": rc == 0, "returncode": rc, "counts": counts, "failures": failures,
            "tail": tail}


if __name__ == "__main__":
    raise SystemExit(main())
