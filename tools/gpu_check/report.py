"""The summary ``gpu_check.json``: every field null until measured, filled from the phases'
item results as they come in, and its headline lines."""

from __future__ import annotations

from pathlib import Path

from tools.gpu_check.compilation import parse_ptxas

__all__ = ["empty_report", "fill", "summary_lines"]


def empty_report(command: str, rehearsal: bool, deadline: float) -> dict:
    """Every field of the summary, null until measured (and null for good where a value
    needs a GPU and this is the CPU rehearsal)."""
    return {"command": command,
            "mode": "cpu-rehearsal (GPU-interpret mode, tiny shapes)" if rehearsal else "gpu",
            "deadline_s": deadline, "status": "running", "elapsed_s": 0.0,
            "env": None, "driver": None,
            "telemetry": {"before": None, "during": None, "after": None},
            "kernels": {}, "excluded_configs": [], "correctness": {}, "bench": {},
            "train": None, "optimizer": None, "tune": {}, "pytest": None, "phases": {}}


def fill(report: dict, phase: str, items: dict, work: Path) -> None:
    """Copies a phase's item results into the summary's sections."""
    if phase == "compile":
        report["env"] = items.get("env")
        kernels = {r["kernel"]: r for r in items.values() if "kernel" in r}
        log = work / "compile.log"
        ptxas = parse_ptxas(log.read_text(), list(kernels)) if log.exists() else {}
        for name, r in kernels.items():
            p = ptxas.get(name, {})
            for key in ("registers", "spill_store_bytes", "spill_load_bytes",
                        "stack_frame_bytes"):
                r[key] = p.get(key)
            r["wgmma_serialization_warnings"] = p.get("wgmma_serialization_warnings")
            r["ptxas_lines"] = p.get("lines")
        report["kernels"] = kernels
    elif phase == "train":
        report["train"] = items.get("transformer-step")
        report["optimizer"] = items.get("optax-chain")
    elif phase in ("correctness", "bench", "tune"):
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
    train = report.get("train") or {}
    if train.get("steps_per_s"):
        lines.append("train steps/s: " + "  ".join(
            f"{k} {v:.2f}" for k, v in train["steps_per_s"].items() if v))
    opt = report.get("optimizer") or {}
    if opt.get("ratio_median"):
        lines.append(f"optimizer step: the studies' optax chain / plain adamw "
                     f"{opt['ratio_median']:.2f}x (median over {opt['params']:,d} parameters)")
    return lines
