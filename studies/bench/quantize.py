"""Benchmark: ``qdq`` with 1x128 blocks vs a plain FP8 round trip of the same array.

    fmtkit bench quantize [--size 4096] [--repeats 30]

Both are jitted; the baseline ``x.astype(float8_e4m3fn).astype(float32)`` is the cheapest
possible FP8 round trip (no scaling at all), so the ratio is the cost of blockwise scaling.
Target: at most 1.35x on a 2-core CPU.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from fmtkit.scaling import BlockScaling, qdq
from studies.lib.common import write_bench_results
from studies.lib.timing import time_interleaved

# How the command line lists this benchmark (studies.app.registry).
NAME = "quantize"
SUMMARY = "qdq with 1x128 blocks vs a plain FP8 round trip of the same array"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fmtkit bench quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=4096, help="the array is size x size f32")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None, help="output folder (default runs/bench-quantize)")
    args = p.parse_args(argv)
    if args.size <= 0 or args.size % 128:
        p.error(f"--size must be a positive multiple of 128, got {args.size}")

    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.float32)
    plain = jax.jit(lambda a: a.astype(jnp.float8_e4m3fn).astype(jnp.float32))
    blocked = jax.jit(lambda a: qdq(a, "e4m3", BlockScaling((1, 128))))
    times = time_interleaved({"plain_roundtrip": lambda: plain(x),
                              "qdq_1x128": lambda: blocked(x)}, repeats=args.repeats)
    ratio = times["qdq_1x128"] / times["plain_roundtrip"]
    print(f"array {args.size}x{args.size} f32, median of {args.repeats}")
    for k, t in times.items():
        print(f"  {k:<16} {t * 1e3:8.2f} ms")
    print(f"ratio qdq_1x128 / plain_roundtrip: {ratio:.2f}x  (target <= 1.35x)")
    file = write_bench_results("quantize", {"size": args.size, "seconds": times, "ratio": ratio},
                         args.out)
    print(f"wrote {file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
