"""Benchmark: the blockwise FP8 Pallas kernel vs XLA's bf16 matmul vs the pure-JAX reference.

    fmtkit bench fp8-matmul [--shapes 4096x4096x4096,...] [--repeats 20] [--out DIR]
    python -m studies.bench_fp8_matmul

On a Hopper GPU, for each MxNxK: TFLOP/s of ``blockwise_fp8_matmul`` (FP8 operands, 1x128
and 128x128 scales, bf16 out), of ``jnp.dot`` on bf16 operands (XLA/cuBLAS, bf16 out) and of
``blockwise_fp8_matmul_reference`` (what runs without the kernel), timed side by side in one
process, interleaved, median of repeats after warm-up (compile time reported apart). The
ratios kernel/bf16 and kernel/reference are printed last; results go to
runs/bench-fp8-matmul/results.json. Default shapes: 4096^3, 8192^3 and DeepSeek-V3's
(M=4096 tokens; (N, K) = (7168, 2048), (2112, 7168), (24576, 1536), (7168, 16384)).

Anchors (H200 dense peaks: bf16 ~990, FP8 ~1979 TFLOP/s): DeepGEMM's blockwise FP8 GEMM
reaches ~1500 TFLOP/s at 4096x7168x16384 on H800.

Without a GPU it says so and exits 0 (there is nothing meaningful to time on a CPU).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from studies._bench import time_interleaved, write_results

DEFAULT_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 7168, 2048),
                  (4096, 2112, 7168), (4096, 24576, 1536), (4096, 7168, 16384))


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """"MxNxK,MxNxK" -> ((M, N, K), ...); K must be a multiple of 128."""
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
    from pallas_kernels import quantize_1x128_reference, quantize_128x128_reference

    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (n, k), jnp.float32)
    xq, xs = quantize_1x128_reference(x)
    wq, ws = quantize_128x128_reference(w)
    return dict(x=x, w=w, xq=xq, xs=xs, wq=wq, ws=ws, x16=x.astype(jnp.bfloat16),
                wt16=w.T.astype(jnp.bfloat16))


def bench_shape(m: int, n: int, k: int, *, repeats: int, with_kernel: bool) -> dict:
    """Times the implementations at one shape; returns seconds, TFLOP/s and compile times."""
    from pallas_kernels import blockwise_fp8_matmul

    ops = make_operands(m, n, k)
    kernel = jax.jit(lambda a, sa, b, sb: blockwise_fp8_matmul(a, sa, b, sb, impl="kernel"))
    reference = jax.jit(lambda a, sa, b, sb: blockwise_fp8_matmul(a, sa, b, sb,
                                                                  impl="reference"))
    bf16 = jax.jit(lambda a, b: jnp.dot(a, b))
    fns = {"xla_bf16": lambda: bf16(ops["x16"], ops["wt16"]),
           "reference": lambda: reference(ops["xq"], ops["xs"], ops["wq"], ops["ws"])}
    if with_kernel:
        fns = {"pallas_fp8": lambda: kernel(ops["xq"], ops["xs"], ops["wq"], ops["ws"]),
               **fns}
    compile_s = {}
    for name, fn in fns.items():  # first call: compile + one run
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        compile_s[name] = time.perf_counter() - t0
    seconds = time_interleaved(fns, repeats=repeats, warmup=2)
    flops = 2.0 * m * n * k
    return {"shape": [m, n, k], "seconds": seconds, "first_call_seconds": compile_s,
            "tflops": {name: flops / t / 1e12 for name, t in seconds.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fmtkit bench fp8-matmul", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help="comma-separated MxNxK (default: the six shapes above)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None, help="output folder (default runs/bench-fp8-matmul)")
    args = p.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else DEFAULT_SHAPES
    except ValueError as e:
        p.error(str(e))
    if args.repeats <= 0:
        p.error(f"--repeats must be positive, got {args.repeats}")

    if jax.default_backend() != "gpu":
        print(f"fp8-matmul: no GPU present (backend: {jax.default_backend()}); this "
              "benchmark times a Hopper GPU kernel, nothing to do.")
        return 0
    from pallas_kernels import is_hopper

    with_kernel = is_hopper()
    if not with_kernel:
        print(f"{jax.devices()[0].device_kind} is not a Hopper GPU: timing the bf16 and "
              "reference paths only (the kernel needs sm_90).")
    rows = []
    for m, n, k in shapes:
        r = bench_shape(m, n, k, repeats=args.repeats, with_kernel=with_kernel)
        rows.append(r)
        cells = "  ".join(f"{name} {tf:7.1f}" for name, tf in r["tflops"].items())
        print(f"{m}x{n}x{k}: TFLOP/s  {cells}", flush=True)
    ratios = []
    if with_kernel:
        for r in rows:
            tf = r["tflops"]
            r["ratio_kernel_over_bf16"] = tf["pallas_fp8"] / tf["xla_bf16"]
            r["ratio_kernel_over_reference"] = tf["pallas_fp8"] / tf["reference"]
            ratios.append(r)
    file = write_results("fp8-matmul", {"repeats": args.repeats, "results": rows}, args.out)
    print(f"wrote {file}")
    for r in ratios:
        m, n, k = r["shape"]
        print(f"ratio {m}x{n}x{k}: kernel/bf16 {r['ratio_kernel_over_bf16']:.2f}x  "
              f"kernel/reference {r['ratio_kernel_over_reference']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
