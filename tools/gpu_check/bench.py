"""The ``bench`` phase: the kernel against XLA's bf16 and per-tensor FP8 dots and cuBLAS's
blockwise FP8 GEMM (``torch._scaled_mm``) at the production shapes, interleaved."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from tools.gpu_check.timing import time_interleaved

__all__ = ["BENCH_ROUNDS", "PRODUCTION_SHAPES", "bench_shape"]

# The production shapes: 8192^3 and DeepSeek-V3's projections at M = 4096 tokens.
PRODUCTION_SHAPES = ((8192, 8192, 8192), (4096, 7168, 16384), (4096, 7168, 2048),
                     (4096, 24576, 1536), (4096, 2112, 7168))
BENCH_ROUNDS = 30


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
