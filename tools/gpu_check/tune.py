"""The ``tune`` phase: every shipped config at one shape, interleaved (data for
``pallas_kernels.config.choose_config``)."""

from __future__ import annotations

from tools.gpu_check.timing import time_interleaved

__all__ = ["TUNE_ROUNDS", "TUNE_SHAPES", "tune_shape"]

TUNE_SHAPES = ((8192, 8192, 8192), (4096, 7168, 2048))
TUNE_ROUNDS = 10


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
