"""The ``train`` phase's training steps: steps/s of the policied train step of a Llama-style
stack at realistic width and of a small transformer LM, through ``fmtkit bench fp8-step``
run as a command (the tool imports no study, only ``studies.lib``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tools.gpu_check.files import REPO

__all__ = ["LLAMA_ARGS", "TRAIN_ARGS", "TRAIN_ARGS_REHEARSAL", "train_step"]

# Small transformer of the training-step phase: d_model 1024, 4 blocks, 8192 tokens a step
# (GEMMs of 8192 x 1024 x 4096: big enough that FP8's GEMM speed shows, small enough to
# compile four variants in about a minute); no f32 variant, to leave time to the Llama stack.
TRAIN_ARGS = ("--d-model", "1024", "--layers", "4", "--heads", "8", "--seq", "1024",
              "--lm-batch", "8", "--repeats", "15", "--baselines", "bf16")
TRAIN_ARGS_REHEARSAL = ("--d-model", "32", "--layers", "1", "--heads", "2", "--seq", "16",
                        "--lm-batch", "2", "--repeats", "1", "--baselines", "bf16")
# The Llama-style model at its realistic size on a GPU (d_model 4096, SwiGLU 11008, 4 blocks,
# 8192 tokens a step: ``fmtkit bench fp8-step``'s ``llama`` model); its rehearsal size off
# GPUs. Fewer repeats: five variants of 4 such blocks take most of the item's time to compile.
LLAMA_ARGS = ("--repeats", "10")
LLAMA_ARGS_REHEARSAL = ("--repeats", "1")
_TRAIN_VARIANTS = {"bf16-mixed": "bf16", "fp8-current": "current",
                   "fp8-delayed": "delayed", "fp8-blockwise": "blockwise", "f32": "f32"}


def train_step(work: Path, rehearsal: bool, model: str = "transformer") -> dict:
    """Steps/s of the policied train step (``fmtkit bench fp8-step``, one model:
    "transformer", d_model 1024, or "llama", d_model 4096) under f32, bf16-mixed and the
    current, delayed and blockwise FP8 recipes, run as a command in this worker's process
    group."""
    out = work / f"train-{model}"
    args = ((LLAMA_ARGS_REHEARSAL if rehearsal else LLAMA_ARGS) if model == "llama" else
            (TRAIN_ARGS_REHEARSAL if rehearsal else TRAIN_ARGS))
    # The rehearsal runs the Llama stack under one FP8 recipe: the transformer step
    # rehearses all three (and tests/studies/test_bench_fp8_step.py the Llama model).
    recipes = "current" if rehearsal and model == "llama" else "current,delayed,blockwise"
    cmd = [sys.executable, "-m", "studies.app.cli", "bench", "fp8-step", "--models",
           model, "--recipes", recipes, "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-6000:], flush=True)
    if proc.returncode:
        return {"ok": False, "error": f"exit status {proc.returncode}: {proc.stderr[-2000:]}",
                "command": " ".join(cmd)}
    res = json.loads((out / "results.json").read_text())[model]
    secs = res["seconds"]
    bf16 = secs.get("bf16")
    return {"ok": True, "command": " ".join(cmd), "model": model,
            "size": res.get("size"), "realistic": res.get("realistic"),
            "speedup_over_bf16": {k: (bf16 / secs[v] if v in secs and bf16 else None)
                                  for k, v in _TRAIN_VARIANTS.items()},
            "gpu_targets": ({"fp8-current": 1.3, "fp8-delayed": 1.3, "fp8-blockwise": 1.2}
                            if model == "llama" else
                            {"fp8-current": 1.0, "fp8-delayed": 1.0, "fp8-blockwise": 1.0}),
            "steps_per_s": {k: (1.0 / secs[v] if v in secs else None)
                            for k, v in _TRAIN_VARIANTS.items()},
            "step_ms": {k: (secs[v] * 1e3 if v in secs else None)
                        for k, v in _TRAIN_VARIANTS.items()},
            "compile_s": {k: res["compile_seconds"].get(v) for k, v in _TRAIN_VARIANTS.items()},
            "loss": {k: res["loss"].get(v) for k, v in _TRAIN_VARIANTS.items()}}
