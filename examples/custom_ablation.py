"""A custom precision ablation from Python, with the studies' training library.

A registered setup as the reference and a setup of your own (FP8 only in the MLP blocks,
written as module-path rules), trained on the same seeds and batches (seed k of every setup
starts from the same parameters), compared as `fmtkit ablate` compares: mean ± std over
seeds and the paired gap, marked `*` where it exceeds 3 standard errors.

Run: python examples/custom_ablation.py   (under a minute on a 2-core CPU)
"""

import os

# Keep bf16/fp16 intermediates in their format inside jit (what the fmtkit CLI sets).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_allow_excess_precision=false").strip()

from fmtkit import Rules, fp8
from studies.lib import stats
from studies.training import Setup, TrainConfig
from studies.training.multiseed import final_loss, train_seeds

cfg = TrainConfig(steps=30, seeds=2, batch=8, seq_len=32)  # the tiny byte-level LM

# FP8 blockwise on the projections inside the MLP blocks only (first matching rule wins);
# everything else as bf16-mixed, the output head on bf16 operands with f32 logits.
mlp_fp8 = Rules([("MlpBlock", fp8.RECIPES["blockwise"])], default="p=f32,c=bf16,o=bf16",
                head="p=f32,c=bf16,o=f32", output_dtype="f32")
setups = ["bf16-mixed", Setup("fp8-mlp-only", mlp_fp8, description="FP8 in the MLP blocks")]

final = {}
for setup in setups:
    result = train_seeds(setup, cfg)
    final[result.setup] = [final_loss(h["loss"]) for h in result.histories]
    print(f"{result.setup:14s} final loss {stats.format_mean_std(final[result.setup])} "
          f"(compile {result.compile_seconds:.1f} s, step {result.step_ms:.0f} ms)")

gap = stats.compare(final["bf16-mixed"], final["fp8-mlp-only"], paired=True)
print(f"fp8-mlp-only vs bf16-mixed (paired): {stats.format_gap(gap)}")
