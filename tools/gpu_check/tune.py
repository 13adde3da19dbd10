"""The ``tune`` phase: every shipped config at one shape, interleaved (data for
``pallas_kernels.config.choose_config``); and the kernel's opt-in forms (scales staged in
shared memory, 128 x 144-192 tiles, the other output epilogue, two-CTA clusters) against
the default config at the production shapes."""

from __future__ import annotations

from tools.gpu_check.timing import time_interleaved

__all__ = ["FORM_SHAPES", "TUNE_ROUNDS", "TUNE_SHAPES", "compare_forms", "tune_shape"]

TUNE_SHAPES = ((8192, 8192, 8192), (4096, 7168, 2048))
TUNE_ROUNDS = 10
# (m, n, k, out dtype, B scaled per row): DeepSeek-V3's largest forward GEMM, 8192^3, the
# N = 2112 projection, and the weight gradient of that projection (f32 out, 1x128 scales on
# both sides).
FORM_SHAPES = ((4096, 7168, 16384, "bfloat16", False), (8192, 8192, 8192, "bfloat16", False),
               (4096, 2112, 7168, "bfloat16", False), (7168, 2112, 4096, "float32", True))
FORM_ROUNDS = 5
# The wide tiles timed where N makes whole waves more nearly (N = 2112: 11 or 12 column tiles
# of 176 or 192; N = 7168: 41 or 38).
_WIDE_WIDTHS = (176, 192)


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


def form_configs(m: int, n: int, k: int, out_dtype: str, *, base) -> dict:
    """The variants ``compare_forms`` times: ``base`` (the default form), ``base`` with the
    scales staged in shared memory, ``base`` with the other output epilogue ("tile" or
    "chunks", named ``tile_epilogue`` or ``chunks_epilogue``) at the most stages that fit
    with it for ``out_dtype`` (no more than ``base``'s), at N = 2112 or 7168 the 128 x 176
    and 128 x 192 tiles (default scale form), and ``base`` in the two-CTA cluster the
    heuristic asks for at this shape (``choose_config(..., clusters=True)``; none at one
    wave)."""
    import dataclasses

    from pallas_kernels.config import TuningConfig, choose_config, max_stages, with_scales

    variants = {"default": base, "smem_scales": with_scales(base, "smem")}
    other = "chunks" if base.epilogue == "tile" else "tile"
    epi = dataclasses.replace(base, epilogue=other)
    variants[f"{other}_epilogue"] = dataclasses.replace(epi, max_concurrent_steps=min(
        base.max_concurrent_steps, max_stages(epi, out_dtype)))
    if n in (2112, 7168):
        for w in _WIDE_WIDTHS:
            variants[f"128x{w}"] = with_scales(TuningConfig(128, w, "m", 1), "global")
    cluster = choose_config(m, n, k, out_dtype, clusters=True).cluster
    if cluster != (1, 1) and base.scales == "global":
        variants["cluster"] = dataclasses.replace(base, cluster=cluster)
    return variants


def compare_forms(m: int, n: int, k: int, *, out_dtype: str, b_rows: bool, impl: str,
                  base, rounds: int, rehearsal: bool, variants: dict | None = None) -> dict:
    """The variants of ``form_configs`` (or ``variants``) at one shape, interleaved, with
    each one's error against the default's output (same inputs, same promotion order: f32
    round-off apart)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import blockwise_fp8_matmul, quantize_1x128
    from pallas_kernels.bench import make_operands

    ops = make_operands(m, n, k)
    if b_rows:  # the weight gradient's form: both operands scaled per 1x128 tile
        wq, ws = quantize_1x128(ops["w"], impl="reference")
        args = (ops["xq"], ops["xs"], wq, ws)
    else:
        args = (ops["xq"], ops["xs"], ops["wq"], ops["ws"])
    variants = variants or form_configs(m, n, k, out_dtype, base=base)
    fns, outs = {}, {}
    for name, cfg in variants.items():
        fn = jax.jit(lambda a, sa, b, sb, cfg=cfg: blockwise_fp8_matmul(
            a, sa, b, sb, out_dtype=jnp.dtype(out_dtype), impl=impl, config=cfg))
        outs[name] = np.asarray(fn(*args), np.float64)
        fns[name] = (lambda fn=fn: fn(*args), jax.block_until_ready)
    times = time_interleaved(fns, rounds, rehearsal)
    flops = 2.0 * m * n * k
    ref = outs["default"]
    norm = float(np.linalg.norm(ref)) or 1.0
    return {"shape": [m, n, k], "out_dtype": out_dtype, "b_rows": b_rows, "ok": True,
            "variants": {name: {**times[name], "config": str(cfg),
                                "tflops_median": flops / times[name]["median_s"] / 1e12,
                                "rel_fro_vs_default": float(np.linalg.norm(outs[name] - ref))
                                / norm}
                         for name, cfg in variants.items()}}
