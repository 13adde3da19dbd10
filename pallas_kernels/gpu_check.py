"""The one prepared GPU check of the blockwise FP8 kernels: run it when a Hopper GPU is lent.

    python -m pallas_kernels.gpu_check [--out-dir runs/gpu-check] [--repeats 10]
                                      [--deadline 270] [--skip-bench] [--skip-pytest]

Phases, in order of importance, each written to ``<out-dir>/gpu_check.json`` as soon as it
ends (so a run cut short still leaves its results):

1. quantizers: compiled ``quantize_1x128`` / ``quantize_128x128`` vs ``fmtkit.quantize``
   (XLA on the same GPU), bit for bit, f32 and bf16 inputs, both scale rules, with zero,
   tiny, huge and NaN blocks;
2. matmul: compiled ``blockwise_fp8_matmul`` vs ``blockwise_fp8_matmul_reference`` at the
   benchmark shapes (f32 output: relative Frobenius error < ``F32_RTOL_GPU``; bf16 output
   at two shapes: < 2^-8) and vs the f32 product of the unquantized Gaussian inputs
   (DeepGEMM's criterion < 1e-3); the dgrad and wgrad helpers at one DeepSeek-V3 shape;
3. the benchmark (``studies.bench_fp8_matmul``), JSON in ``<out-dir>/bench``;
4. the compiled-mode kernel tests (``pytest -m gpu tests/pallas_kernels``), if pytest is
   installed and time is left.

Phases are skipped once ``--deadline`` seconds have passed (default 270: the whole run is
meant to fit in 5 minutes of an H200, compiles included). Exit status 1 if a check fails,
0 otherwise (also without a GPU, after saying so).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Compiled kernel vs reference, f32 output. Hopper's FP8 wgmma accumulates a 128-wide K
# block with fewer bits than f32 (about 14, DeepSeek-V3 §3.3.2) before the f32 promotion;
# the error budget per block partial is ~2^-14. 1e-3 is a loose first bound: this check
# records the measured values so the bound can be tightened.
F32_RTOL_GPU = 1e-3
BF16_RTOL = 2.0**-8  # the final bf16 rounding is <= 2^-9 per element
DEEPGEMM_DIFF = 1e-3  # DeepGEMM tests/test_core.py: calc_diff < 0.001
CHECK_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 7168, 2048),
                (4096, 2112, 7168), (4096, 24576, 1536), (4096, 7168, 16384))
BF16_SHAPES = ((4096, 7168, 2048), (4096, 2112, 7168))


def _rel_fro(x, ref) -> float:
    x = x.astype(jnp.float32)
    ref = ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def _deepgemm_diff(x, y) -> float:
    x = x.astype(jnp.float32)
    y = y.astype(jnp.float32)
    return float(jnp.sum((x - y) ** 2) / jnp.sum(x * x + y * y))


def _bits_equal(a, b) -> tuple[bool, int]:
    ua = np.asarray(a).view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)
    ub = np.asarray(b).view(np.uint8 if b.dtype.itemsize == 1 else np.uint32)
    bad = int(np.sum(ua != ub))
    return bad == 0, bad


def _hard_input(rows: int, cols: int, dtype, seed: int) -> jax.Array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-20, 20, (rows, cols))
    x[:128, :128] = 0.0
    x[128:130, 128:256] = 1e-40 if np.dtype(dtype) == np.float32 else 1e-30
    x[130, :128] = 3e38
    x[131, 256:384] = np.nan
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


def check_quantizers(impl: str = "kernel", shape=(4096, 7168)) -> dict:
    from fmtkit.scaling import BlockScaling, quantize
    from pallas_kernels import quantize_1x128, quantize_128x128

    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        x = _hard_input(*shape, dtype, seed=0)
        for pow2 in (False, True):
            for name, fn, block in (("1x128", quantize_1x128, (1, 128)),
                                    ("128x128", quantize_128x128, (128, 128))):
                v, s = fn(x, power_of_two=pow2, impl=impl)
                sa = quantize(x, "e4m3", BlockScaling(block, power_of_two=pow2))
                nan = np.isnan(np.asarray(sa.values, np.float32))
                same_nan = bool(np.array_equal(np.isnan(np.asarray(v, np.float32)), nan))
                ok_v, bad_v = _bits_equal(np.asarray(v)[~nan], np.asarray(sa.values)[~nan])
                ok_s, bad_s = _bits_equal(s, sa.scale)
                out[f"{name}-{np.dtype(dtype).name}-pow2={pow2}"] = {
                    "ok": ok_v and ok_s and same_nan, "value_mismatches": bad_v,
                    "scale_mismatches": bad_s, "nan_mask_equal": same_nan}
    return out


def check_matmul(impl: str = "kernel", shapes=CHECK_SHAPES, bf16_shapes=BF16_SHAPES,
                 grad_shape=(4096, 7168, 2048)) -> dict:
    from pallas_kernels import (
        blockwise_fp8_dgrad,
        blockwise_fp8_matmul,
        blockwise_fp8_matmul_reference,
        blockwise_fp8_wgrad,
    )
    from studies.bench_fp8_matmul import make_operands

    exact_dot = jax.jit(lambda x, w: jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST))
    out = {}
    for m, n, k in shapes:
        ops = make_operands(m, n, k, seed=1)
        args = (ops["xq"], ops["xs"], ops["wq"], ops["ws"])
        ref = blockwise_fp8_matmul_reference(*args, out_dtype=jnp.float32)
        got = blockwise_fp8_matmul(*args, out_dtype=jnp.float32, impl=impl)
        exact = exact_dot(ops["x"], ops["w"])
        row = {"rel_fro_f32_vs_reference": _rel_fro(got, ref),
               "deepgemm_diff_vs_exact": _deepgemm_diff(got, exact),
               "reference_deepgemm_diff_vs_exact": _deepgemm_diff(ref, exact)}
        ok = (row["rel_fro_f32_vs_reference"] < F32_RTOL_GPU
              and row["deepgemm_diff_vs_exact"] < DEEPGEMM_DIFF)
        if (m, n, k) in bf16_shapes:
            got16 = blockwise_fp8_matmul(*args, out_dtype=jnp.bfloat16, impl=impl)
            row["rel_fro_bf16_vs_reference"] = _rel_fro(got16, ref)
            ok = ok and row["rel_fro_bf16_vs_reference"] < BF16_RTOL
        row["ok"] = ok
        out[f"{m}x{n}x{k}"] = row
        del ops, ref, got, exact
    # Gradient GEMMs (default: DeepSeek-V3's (N, K) = (7168, 2048) projection, 4096 tokens).
    m, n, k = grad_shape
    ops = make_operands(m, n, k, seed=2)
    dy = jax.random.normal(jax.random.key(3), (m, n), jnp.float32)
    dx = blockwise_fp8_dgrad(dy, ops["wq"], ops["ws"], out_dtype=jnp.float32, impl=impl)
    dx_ref = blockwise_fp8_dgrad(dy, ops["wq"], ops["ws"], out_dtype=jnp.float32,
                                 impl="reference")
    dw = blockwise_fp8_wgrad(dy, ops["x"], impl=impl)
    dw_ref = blockwise_fp8_wgrad(dy, ops["x"], impl="reference")
    dw_exact = jax.jit(lambda g, x: jnp.dot(g.T, x, precision=jax.lax.Precision.HIGHEST))(
        dy, ops["x"])
    row = {"dgrad_rel_fro_vs_reference": _rel_fro(dx, dx_ref),
           "wgrad_rel_fro_vs_reference": _rel_fro(dw, dw_ref),
           "wgrad_deepgemm_diff_vs_exact": _deepgemm_diff(dw, dw_exact)}
    row["ok"] = (row["dgrad_rel_fro_vs_reference"] < F32_RTOL_GPU
                 and row["wgrad_rel_fro_vs_reference"] < F32_RTOL_GPU
                 and row["wgrad_deepgemm_diff_vs_exact"] < DEEPGEMM_DIFF)
    out[f"grads-{m}x{n}x{k}"] = row
    return out


def run_pytest(timeout_s: float) -> dict:
    if importlib.util.find_spec("pytest") is None:
        return {"skipped": "pytest is not installed"}
    cmd = [sys.executable, "-m", "pytest", "tests/pallas_kernels", "-m", "gpu", "-q",
           "-p", "no:cacheprovider"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        return {"ok": False, "timeout_s": timeout_s, "tail": str(e.stdout or "")[-3000:]}
    return {"ok": proc.returncode == 0, "returncode": proc.returncode,
            "tail": (proc.stdout + proc.stderr)[-3000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pallas_kernels.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="runs/gpu-check")
    p.add_argument("--repeats", type=int, default=10, help="benchmark repeats per shape")
    p.add_argument("--deadline", type=float, default=270.0,
                   help="seconds after which remaining phases are skipped")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-pytest", action="store_true")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="rehearse the check phases on CPU: GPU-interpret mode, small shapes, "
                        "no benchmark or pytest (catches script errors before GPU time)")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report_file = out_dir / "gpu_check.json"
    dev = jax.devices()[0]
    report: dict = {"jax": jax.__version__, "device": getattr(dev, "device_kind", str(dev)),
                    "backend": jax.default_backend(), "phases": {}}

    def save():
        report["elapsed_s"] = time.perf_counter() - t_start
        report_file.write_text(json.dumps(report, indent=2, default=str))

    from pallas_kernels._backend import is_hopper

    impl = "kernel"
    phases = [("quantizers", check_quantizers), ("matmul", check_matmul)]
    if args.cpu_smoke:
        impl = "interpret"
        args.skip_bench = args.skip_pytest = True
        phases = [("quantizers", lambda: check_quantizers(impl, shape=(256, 384))),
                  ("matmul", lambda: check_matmul(
                      impl, shapes=((256, 256, 384), (128, 320, 256)),
                      bf16_shapes=((128, 320, 256),), grad_shape=(128, 256, 128)))]
        report["mode"] = "cpu-smoke (GPU-interpret mode, small shapes)"
    elif not is_hopper():
        report["status"] = "no Hopper GPU: nothing checked"
        save()
        print(f"gpu_check: no Hopper GPU here ({report['device']}); nothing to check.")
        return 0

    failed = False
    if not args.skip_bench:
        def bench():
            from studies import bench_fp8_matmul
            rc = bench_fp8_matmul.main(["--out", str(out_dir / "bench"),
                                        "--repeats", str(args.repeats)])
            return {"ok": rc == 0, "results": str(out_dir / "bench" / "results.json")}
        phases.append(("bench", bench))
    if not args.skip_pytest:
        phases.append(("pytest", lambda: run_pytest(
            max(30.0, args.deadline - (time.perf_counter() - t_start)))))
    for name, fn in phases:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.deadline:
            report["phases"][name] = {"skipped": f"deadline ({elapsed:.0f} s elapsed)"}
            save()
            continue
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception:  # record and go on: later phases may still tell us something
            result = {"ok": False, "error": traceback.format_exc()[-4000:]}
        result = {"seconds": time.perf_counter() - t0, **result}
        report["phases"][name] = result
        ok = result.get("ok", all(r.get("ok", True) for r in result.values()
                                  if isinstance(r, dict)))
        failed = failed or not ok
        print(f"[{name}] {'ok' if ok else 'FAILED'} in {result['seconds']:.1f} s", flush=True)
        if not ok:
            print(json.dumps(result, indent=1, default=str)[-3000:], flush=True)
        save()
    report["status"] = "failed" if failed else "passed"
    save()
    print(f"gpu_check {report['status']}; wrote {report_file}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
