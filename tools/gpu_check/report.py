"""The summary ``gpu_check.json``: every field null until measured, filled from the phases'
item results as they come in, and its headline lines."""

from __future__ import annotations

import re
from pathlib import Path

from tools.gpu_check.compilation import parse_ptxas, parse_sass

__all__ = ["empty_report", "fill", "rewriter_lines", "summary_lines"]


def rewriter_lines(log_text: str, limit: int = 40) -> list[str]:
    """XLA's GEMM rewriter's FP8 lines in a worker log (``TF_CPP_VMODULE=gemm_rewriter=1``):
    the dots it rewrote into an FP8 custom call and those it did not, with the reason;
    at most ``limit`` lines, the ones saying "not" or "Failed" first."""
    lines = [ln.strip()[:400] for ln in log_text.splitlines()
             if re.search(r"FP8 (Custom Call|GEMM)|into FP8", ln)]
    lines.sort(key=lambda ln: not re.search(r"not rewritten|Failed", ln))
    return lines[:limit]


def empty_report(command: str, rehearsal: bool, deadline: float) -> dict:
    """Every field of the summary, null until measured (and null for good where a value
    needs a GPU and this is the CPU rehearsal)."""
    return {"command": command,
            "mode": "cpu-rehearsal (GPU-interpret mode, tiny shapes)" if rehearsal else "gpu",
            "deadline_s": deadline, "status": "running", "elapsed_s": 0.0,
            "env": None, "driver": None,
            "telemetry": {"before": None, "during": None, "after": None},
            "kernels": {}, "sass_error": None, "excluded_configs": [], "correctness": {},
            "bench": {},
            "per_tensor": None, "fp8_rewriter_log": [], "train": None, "train_llama": None,
            "optimizer": None, "tune": {}, "profile": {}, "profile_traces": [],
            "pytest": None, "phases": {}}


def fill(report: dict, phase: str, items: dict, work: Path) -> None:
    """Copies a phase's item results into the summary's sections."""
    if phase == "compile":
        report["env"] = items.get("env")
        kernels = {r["kernel"]: r for r in items.values() if "kernel" in r}
        log = work / "compile.log"
        text = log.read_text() if log.exists() else ""
        ptxas = parse_ptxas(text, list(kernels))
        sass = parse_sass(text)
        for name, r in kernels.items():
            p = ptxas.get(name, {})
            for key in ("registers", "spill_store_bytes", "spill_load_bytes",
                        "stack_frame_bytes"):
                r[key] = p.get(key)
            r["wgmma_serialization_warnings"] = p.get("wgmma_serialization_warnings")
            r["ptxas_lines"] = p.get("lines")
            r["sass"] = sass.get(name)  # instruction counts (MOSAIC_GPU_DUMP_SASS=1)
        report["kernels"] = kernels
        # Mosaic GPU runs nvdisasm for the SASS and says so where it could not
        report["sass_error"] = next((ln.strip() for ln in text.splitlines()
                                     if "nvdisasm invocation failed" in ln), None)
    elif phase == "train":
        report["train"] = items.get("transformer-step")
        report["train_llama"] = items.get("llama-step")
        report["optimizer"] = items.get("optax-chain")
    elif phase == "bench":
        report["bench"] = {k: v for k, v in items.items() if k != "fp8-per-tensor"}
        report["per_tensor"] = items.get("fp8-per-tensor")
        log = work / "bench.log"
        report["fp8_rewriter_log"] = rewriter_lines(log.read_text()) if log.exists() else []
    elif phase in ("correctness", "tune", "profile"):
        report[phase] = items


def summary_lines(report: dict) -> list[str]:
    """The headline numbers, one line each, printed at the end."""
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
    pt = report.get("per_tensor") or {}
    if pt.get("impls"):
        lines.append(f"per-tensor FP8 GEMM {'x'.join(map(str, pt['shape']))}: "
                     f"{pt['impls']['fmtkit_per_tensor_gemm']['tflops_median']:.1f} TFLOP/s, "
                     f"{pt['ratios']['gemm_over_xla_bf16']:.2f}x XLA bf16; cuBLASLt FP8 GEMM: "
                     f"{pt.get('gemm_uses_cublaslt_fp8')}, in the fwd+bwd step "
                     f"{pt.get('fwd_bwd_cublaslt_fp8_calls')} of 3 calls")
    for key in ("train_llama", "train"):
        train = report.get(key) or {}
        if train.get("steps_per_s"):
            lines.append(f"train steps/s ({train.get('model', 'transformer')}): " + "  ".join(
                f"{k} {v:.2f}" for k, v in train["steps_per_s"].items() if v))
    for name, r in (report.get("profile") or {}).items():
        roles = r.get("roles") or {}
        if roles:
            step = roles.get("consumer0", {}).get("regions", {}).get("k_step") or {}
            tile = roles.get("producer", {}).get("regions", {}).get("tile") or {}
            lines.append(f"profile {name}: consumer0 k_step median {step.get('median_cycles')} "
                         f"cycles, {step.get('share')} of its time; producer in tiles "
                         f"{tile.get('share')} of its time"
                         f"{' (truncated)' if r.get('truncated') else ''}")
    opt = report.get("optimizer") or {}
    if opt.get("ratio_median"):
        lines.append(f"optimizer step: the studies' optax chain / plain adamw "
                     f"{opt['ratio_median']:.2f}x (median over {opt['params']:,d} parameters)")
    return lines
