"""Benchmark: the blockwise FP8 Pallas kernel vs XLA's bf16 matmul vs the pure-JAX reference.

    fmtkit bench fp8-matmul [--shapes 4096x4096x4096,...] [--repeats 20] [--out DIR]
    python -m studies.bench.fp8_matmul

On a Hopper GPU, for each MxNxK: TFLOP/s of ``blockwise_fp8_matmul`` (FP8 operands, 1x128
and 128x128 scales, bf16 out), of ``jnp.dot`` on bf16 operands (XLA/cuBLAS, bf16 out) and of
``blockwise_fp8_matmul_reference`` (what runs without the kernel), timed one after another in one
process on the device (CUPTI kernel timestamps through Mosaic GPU's profiler: no host
dispatch in the figure), median of repeats after warm-up (compile time reported apart). The
ratios kernel/bf16 and kernel/reference are printed last; results go to
runs/bench-fp8-matmul/results.json. Default shapes: 4096^3, 8192^3 and DeepSeek-V3's
(M=4096 tokens; (N, K) = (7168, 2048), (2112, 7168), (24576, 1536), (7168, 16384)).

Anchors (H200 dense peaks: bf16 ~990, FP8 ~1979 TFLOP/s): DeepGEMM's blockwise FP8 GEMM
reaches ~1500 TFLOP/s at 4096x7168x16384 on H800.

Without a GPU it says so and exits 0 (there is nothing meaningful to time on a CPU).
"""

from __future__ import annotations

import argparse

import jax

from pallas_kernels.bench import DEFAULT_SHAPES, bench_shape, make_operands, parse_shapes
from studies.lib.common import write_bench_results

# How the command line lists this benchmark (studies.app.registry).
NAME = "fp8-matmul"
SUMMARY = "the blockwise FP8 Pallas kernel vs XLA's bf16 matmul vs the pure-JAX reference"

__all__ = ["DEFAULT_SHAPES", "bench_shape", "main", "make_operands", "parse_shapes"]


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
            r["ratio_kernel_over_reference"] = tf["pallas_fp8"] / tf["reference"]
            ratios.append(r)
    file = write_bench_results("fp8-matmul", {"repeats": args.repeats, "results": rows}, args.out)
    print(f"wrote {file}")
    for r in ratios:
        m, n, k = r["shape"]
        print(f"ratio {m}x{n}x{k}: kernel/bf16 {r['ratio_kernel_over_bf16']:.2f}x  "
              f"kernel/reference {r['ratio_kernel_over_reference']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
