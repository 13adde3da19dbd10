"""The blockwise kernel's benchmark sweep: operands, shapes and device timing.

Shared by the fp8-matmul benchmark (``fmtkit bench fp8-matmul``, ``studies.bench``), the
GPU check (``tools.gpu_check``) and the kernel tests, which may not import one another: so
it lives with the kernel, below all three, as a Pallas op keeps its sweep beside it.

Timing (``device_times``): on a GPU, CUPTI kernel timestamps through Mosaic GPU's profiler
(``jax.experimental.mosaic.gpu.profiler.measure``): the summed duration of every kernel one
call launches, per call, with no host dispatch in it (about 20 µs of dispatch would be
10-20% of a 0.1-0.26 ms GEMM). Where CUPTI is not available (CPU, or a plugin without
it), ``repeats`` calls are issued back to back and blocked on once, so dispatch overlaps
execution; the result says which method measured it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["DEFAULT_SHAPES", "bench_shape", "device_times", "make_operands", "parse_shapes"]

# The benchmark's shapes: 4096^3, 8192^3 and DeepSeek-V3's projections at M = 4096 tokens,
# (N, K) = (7168, 2048), (2112, 7168), (24576, 1536), (7168, 16384) (arXiv 2412.19437;
# DeepGEMM's benchmark set).
DEFAULT_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 7168, 2048),
                  (4096, 2112, 7168), (4096, 24576, 1536), (4096, 7168, 16384))


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """"MxNxK,MxNxK" -> ((M, N, K), ...); K must be a multiple of 128.

    Raises:
      ValueError: an item is not three positive integers, or K is not a multiple of 128.
    """
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"shape {item!r} is not MxNxK with positive integers")
        m, n, k = map(int, parts)
        if k % 128:
            raise ValueError(f"shape {item!r}: K={k} must be a multiple of 128")
        shapes.append((m, n, k))
    return tuple(shapes)


def make_operands(m: int, n: int, k: int, seed: int = 0) -> dict[str, jax.Array]:
    """Gaussian x [m, k], w [n, k] (f32, on the default device) with their blockwise FP8
    quantizations (pure-JAX quantizers) and bf16 copies for the XLA baseline."""
    from pallas_kernels.quantize import quantize_1x128_reference, quantize_128x128_reference

    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (n, k), jnp.float32)
    xq, xs = quantize_1x128_reference(x)
    wq, ws = quantize_128x128_reference(w)
    return dict(x=x, w=w, xq=xq, xs=xs, wq=wq, ws=ws, x16=x.astype(jnp.bfloat16),
                wt16=w.T.astype(jnp.bfloat16))


def _cupti_times(fn: Callable[..., Any], args: tuple, repeats: int) -> dict[str, Any]:
    from jax.experimental.mosaic.gpu import profiler

    _, per_call = profiler.measure(fn, aggregate=False, iterations=repeats)(*args)
    if not per_call:
        raise RuntimeError("CUPTI recorded no kernel launches")
    if repeats == 1:  # measure returns one list of (name, ms), not a list of them
        per_call = [per_call]
    totals = [sum(ms for _, ms in call) for call in per_call]
    kernels: dict[str, list[float]] = {}
    for call in per_call:
        for name, ms in call:
            kernels.setdefault(name, []).append(ms)
    return {"method": "cupti", "seconds": statistics.median(totals) * 1e-3,
            "seconds_min": min(totals) * 1e-3,
            "kernels_ms": {name: statistics.median(v) for name, v in kernels.items()}}


def _host_loop_times(fn: Callable[..., Any], args: tuple, repeats: int) -> dict[str, Any]:
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = [fn(*args) for _ in range(repeats)]
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / repeats)
    return {"method": "host_loop", "seconds": statistics.median(samples),
            "seconds_min": min(samples)}


def device_times(fn: Callable[..., Any], args: tuple, repeats: int = 20) -> dict[str, Any]:
    """Time per call of the jitted ``fn(*args)`` (one warm-up call happens here; pass the
    operands as ``args``, not in a closure, or a re-trace would bake them in as constants).

    Returns a dict with ``method`` ("cupti": device time from kernel timestamps, median over
    ``repeats`` calls; "host_loop": host time of ``repeats`` back-to-back calls, median of
    3 loops), ``seconds`` (median), ``seconds_min`` and, with CUPTI, ``kernels_ms`` (median
    milliseconds per kernel name, so the GEMM's own time can be told from its helpers') or
    ``cupti_error`` (why CUPTI was not used).
    """
    jax.block_until_ready(fn(*args))
    if jax.default_backend() == "gpu":
        try:
            return _cupti_times(fn, args, repeats)
        except Exception as e:  # no CUPTI in this plugin: fall back, and say why
            result = _host_loop_times(fn, args, repeats)
            result["cupti_error"] = f"{type(e).__name__}: {e}"[:500]
            return result
    return _host_loop_times(fn, args, repeats)


def bench_shape(m: int, n: int, k: int, *, repeats: int, with_kernel: bool,
                with_reference: bool = True, with_bf16: bool = True, config=None,
                impl: str = "kernel") -> dict[str, Any]:
    """Times the implementations at one shape: the kernel (bf16 out, ``config`` or the
    chosen one; ``impl="interpret"`` only to rehearse on CPU), XLA's bf16 ``jnp.dot`` and the
    pure-JAX reference, one after another in this process; returns seconds, TFLOP/s,
    first-call (compile) seconds, the timing method and the config."""
    from pallas_kernels._backend import num_sms
    from pallas_kernels.blockwise_fp8_matmul import blockwise_fp8_matmul
    from pallas_kernels.config import choose_config

    ops = make_operands(m, n, k)
    bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
    fp8_args = (ops["xq"], ops["xs"], ops["wq"], ops["ws"])
    fns: dict[str, tuple[Callable[..., Any], tuple]] = {}
    result: dict[str, Any] = {"shape": [m, n, k]}
    if with_kernel:
        cfg = config or choose_config(m, n, k, jnp.bfloat16, num_sms("kernel"))
        result["config"] = str(cfg)
        kernel = jax.jit(lambda a, sa, b, sb: blockwise_fp8_matmul(
            a, sa, b, sb, impl=impl, config=cfg))
        fns["pallas_fp8"] = (kernel, fp8_args)
    if with_bf16:
        fns["xla_bf16"] = (bf16, (ops["x16"], ops["wt16"]))
    if with_reference:
        reference = jax.jit(lambda a, sa, b, sb: blockwise_fp8_matmul(a, sa, b, sb,
                                                                      impl="reference"))
        fns["reference"] = (reference, fp8_args)
    first_call = {}
    for name, (fn, args) in fns.items():  # first call: compile + one run
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        first_call[name] = time.perf_counter() - t0
    timings = {name: device_times(fn, args, repeats) for name, (fn, args) in fns.items()}
    flops = 2.0 * m * n * k
    result.update({
        "seconds": {name: t["seconds"] for name, t in timings.items()},
        "tflops": {name: flops / t["seconds"] / 1e12 for name, t in timings.items()},
        "timing": timings, "first_call_seconds": first_call})
    if with_kernel and with_bf16:
        result["ratio_kernel_over_bf16"] = (result["tflops"]["pallas_fp8"]
                                            / result["tflops"]["xla_bf16"])
    return result
