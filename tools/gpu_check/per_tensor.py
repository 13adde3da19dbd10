"""The ``bench`` phase's ``fp8-per-tensor`` item: fmtkit's per-tensor FP8 GEMMs (the
``current`` recipe's own dot, scales included) against XLA's bf16 dot, and which GEMM
custom calls XLA compiled them to (``__cublas$lt$matmul$f8`` is cuBLASLt's FP8 GEMM).

Three compiled programs are read: the GEMM of two quantized operands
(``fmtkit.fp8.scaled_matmul``), the forward, data-gradient and weight-gradient GEMMs of
``fmtkit.fp8.dot_general_fn("current")`` (a ``jax.vjp``, quantization included) and, for
comparison, the dequantize-in-bf16 pattern the ``bench`` items time (``xla_fp8_per_tensor``).
The worker runs with ``TF_CPP_VMODULE=gemm_rewriter=1`` (``cli``): XLA's GEMM rewriter logs
each FP8 dot it rewrote or why it did not into ``bench.log`` (``report.rewriter_lines``).
"""

from __future__ import annotations

import re
import time
from typing import Any

from tools.gpu_check.timing import time_interleaved

__all__ = ["PER_TENSOR_SHAPE", "gemm_targets", "per_tensor_gemms"]

PER_TENSOR_SHAPE = (8192, 8192, 8192)
"""The measuring point (8192³) for the per-tensor GEMM against XLA's bf16 one."""

_GEMM_TARGET = re.compile(r'custom_call_target="(__cublas[^"]*|__gemm[^"]*|__cudnn[^"]*)"'
                          r'|"kind":"(__triton[^"]*gemm[^"]*)"')


def gemm_targets(hlo_text: str) -> dict[str, int]:
    """How many GEMMs of each kind a compiled HLO text holds: cuBLAS / cuBLASLt / cuDNN custom
    calls by target, and fusions XLA gave to Triton's GEMM emitter by their kind (XLA's
    autotuner may pick Triton over cuBLASLt for an FP8 dot)."""
    found: dict[str, int] = {}
    for call, fusion in _GEMM_TARGET.findall(hlo_text):
        t = call or fusion
        found[t] = found.get(t, 0) + 1
    return found


def per_tensor_gemms(m: int, n: int, k: int, *, rounds: int, rehearsal: bool) -> dict:
    """Compiles and times (interleaved) the per-tensor FP8 GEMM alone, XLA's bf16 dot, and the
    forward + backward GEMMs of ``dot_general_fn("current")`` against the same three GEMMs in
    bf16; records each program's GEMM custom-call targets."""
    import jax
    import jax.numpy as jnp

    import fmtkit
    from fmtkit import fp8

    k1, k2, k3 = jax.random.split(jax.random.key(11), 3)
    x = jax.random.normal(k1, (m, k), jnp.bfloat16)
    w = (jax.random.normal(k2, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    g = jax.random.normal(k3, (m, n), jnp.bfloat16)
    xq = fmtkit.quantize(x, "e4m3", fmtkit.TensorScaling())
    wq = fmtkit.quantize(w.T, "e4m3", fmtkit.TensorScaling())
    dg = fp8.dot_general_fn("current")
    dn = (((1,), (0,)), ((), ()))

    def step(dot):
        def f(a, b, c):
            y, vjp = jax.vjp(lambda a, b: dot(a, b, dn), a, b)
            return (y, *vjp(c))
        return jax.jit(f)

    def bf16_dot(a, b, dn, **_):
        return jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.bfloat16)

    fns = {"fmtkit_per_tensor_gemm": (jax.jit(fp8.scaled_matmul), (xq, wq)),
           "xla_bf16_gemm": (jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=(
               jnp.bfloat16))), (x, w)),
           "fmtkit_current_fwd_bwd": (step(dg), (x, w, g)),
           "xla_bf16_fwd_bwd": (step(bf16_dot), (x, w, g))}
    targets, first_call, timed = {}, {}, {}
    for name, (fn, args) in fns.items():
        targets[name] = gemm_targets(fn.lower(*args).compile().as_text())
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        first_call[name] = time.perf_counter() - t0
        timed[name] = (lambda fn=fn, args=args: fn(*args), jax.block_until_ready)
    times = time_interleaved(timed, rounds, rehearsal)
    gemm_flops = 2.0 * m * n * k
    impls: dict[str, Any] = {}
    for name, t in times.items():
        flops = gemm_flops * (3 if name.endswith("fwd_bwd") else 1)
        impls[name] = {**t, "tflops_median": flops / t["median_s"] / 1e12,
                       "first_call_s": first_call[name], "gemm_custom_calls": targets[name]}
    on_gpu = jax.default_backend() == "gpu"
    f8_calls = {name: t.get("__cublas$lt$matmul$f8", 0) for name, t in targets.items()}

    def ratio(a, b):
        return impls[b]["median_s"] / impls[a]["median_s"]

    return {"shape": [m, n, k], "impls": impls,
            # GPU facts only (null on the CPU rehearsal): the GEMM alone and all three GEMMs
            # of the step are cuBLASLt FP8 calls
            "gemm_uses_cublaslt_fp8": (f8_calls["fmtkit_per_tensor_gemm"] == 1
                                       if on_gpu else None),
            "fwd_bwd_cublaslt_fp8_calls": f8_calls["fmtkit_current_fwd_bwd"] if on_gpu
            else None,
            "ratios": {"gemm_over_xla_bf16": ratio("fmtkit_per_tensor_gemm", "xla_bf16_gemm"),
                       "fwd_bwd_over_xla_bf16": ratio("fmtkit_current_fwd_bwd",
                                                      "xla_bf16_fwd_bwd")},
            "targets": {"gemm_over_xla_bf16": 1.6},
            "timing": "host, interleaved batches", "ok": True}
