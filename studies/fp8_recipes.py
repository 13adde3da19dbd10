"""Study ``fp8-recipes``: training loss of the small transformer under each FP8 recipe vs
bf16-mixed.

Each setup is the ``fp8-<recipe>`` policy preset of ``studies.train`` (bf16-mixed with the
recipe on every linear layer; embeddings, head, norms, router and the attention core stay
bf16/f32, as in DeepSeek-V3 section 3.3), trained from the same initialization on the same
batches as the ``bf16-mixed`` baseline. Reported per recipe: the final loss (mean of the
last 10% of steps) and the **relative loss gap** ``(L_fp8 - L_bf16) / L_bf16``. DeepSeek-V3
(arXiv 2412.19437, section 3.3 and appendix B.1) reports a gap below 0.25% for its
fine-grained recipe on ~1T-token runs; a few hundred steps of a tiny model on a CPU give the
sign and size of the early gap, not that bar: there the gaps are a few hundredths of a
percent either way, the size of the step-to-step spread of the per-step gap (``gap_std``).

Recipes (``fmtkit.fp8.RECIPES``): ``current`` and ``delayed`` (per tensor, E4M3 forward,
E5M2 gradients), ``rowwise``, ``blockwise`` (DeepSeek: 1x128 activations and gradients,
128x128 weights, E4M3 throughout), ``mxfp8`` (OCP MX: 32-element blocks, E8M0 scales) and
``blockwise-g128``: blockwise with the activation gradients quantized in 128x128 blocks like
the weights (``FP8Recipe(grad_tile="128x128")``): the variant DeepSeek-V3 appendix B.2 found
to diverge a 16B MoE after ~300B tokens (token-correlated outliers in activation gradients
need per-token 1x128 tiles). Its forward pass is the same as blockwise's; only the
gradients differ.

    fmtkit study fp8-recipes [--steps 200] [--recipes blockwise blockwise-g128]
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from fmtkit.fp8 import RECIPES, FP8Recipe
from fmtkit.policy import Policy, Rules, get_preset
from studies._common import figure, format_table, no_progress, plot_style, save
from studies.training.config import TrainConfig

__all__ = ["EXTRA_RECIPES", "Config", "plot", "recipe_of", "run", "setup_of", "summarize"]

EXTRA_RECIPES: dict[str, FP8Recipe] = {
    "blockwise-g128": dataclasses.replace(RECIPES["blockwise"], name="blockwise-g128",
                                          grad_tile="128x128"),
}
"""Recipes beyond ``fmtkit.fp8.RECIPES``: blockwise with 128x128 activation-gradient blocks."""

BASELINE = "bf16-mixed"


def recipe_of(name: str) -> FP8Recipe:
    """The FP8 recipe called ``name`` (``fmtkit.fp8.RECIPES`` or ``EXTRA_RECIPES``)."""
    if name in RECIPES:
        return RECIPES[name]
    if name in EXTRA_RECIPES:
        return EXTRA_RECIPES[name]
    raise ValueError(f"unknown recipe {name!r}; valid: "
                     f"{', '.join([*RECIPES, *EXTRA_RECIPES])}.")


def setup_of(name: str):
    """The ``studies.train.Setup`` of a recipe: the registered ``fp8-<name>`` setup, or, for
    an extra recipe, bf16-mixed's rules with the recipe on every other (linear) layer, as
    ``fmtkit``'s ``fp8-*`` presets are built."""
    from studies import train

    if name == BASELINE:
        return train.get_setup(BASELINE)
    if f"fp8-{name}" in train.SETUPS:
        return train.get_setup(f"fp8-{name}")
    recipe = recipe_of(name)
    mixed = get_preset("bf16-mixed")
    rules = Rules(mixed.rules, default=Policy("float32", "bfloat16", "bfloat16", fp8=recipe),
                  check_unmatched=False)
    return train.Setup(f"fp8-{name}", rules, grad_format="bfloat16",
                       description=f"bf16-mixed + FP8 {name} recipe on the linear layers")


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``fp8-recipes`` study.

    Attributes:
      recipes: FP8 recipes to train (current, delayed, rowwise, blockwise, mxfp8,
        blockwise-g128); each is compared with bf16-mixed.
      train: the training settings shared by every setup (model size, steps, batch, lr,
        seed: the same initialization and batches for every setup).
    """

    recipes: tuple[str, ...] = ("current", "delayed", "rowwise", "blockwise", "mxfp8",
                                "blockwise-g128")
    train: TrainConfig = TrainConfig(steps=100, warmup=20)

    def __post_init__(self):
        if not self.recipes:
            raise ValueError("recipes must name at least one recipe.")
        for r in self.recipes:
            recipe_of(r)
        if not isinstance(self.train, TrainConfig):
            raise TypeError(f"train must be a studies.train.TrainConfig, got "
                            f"{type(self.train).__name__}.")


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains bf16-mixed and each recipe; final losses, relative gaps, loss curves.

    Returns:
      ``{"baseline": {...}, "recipes": {name: {"final_loss", "rel_gap", "loss": [...],
      "recipe": str, ...}}, ...}``.

    Raises:
      StudyError: a non-finite loss.
    """
    from studies import train

    tcfg = config.train
    data = train.load_data(tcfg)
    params = train.init_params(tcfg)
    names = [BASELINE, *dict.fromkeys(config.recipes)]
    runs: dict[str, dict[str, Any]] = {}
    for name in progress(names, total=len(names), desc="setups"):
        runs[name] = train.train(setup_of(name), tcfg, progress=progress, data=data,
                                 params=params).summary()
    base = runs[BASELINE]["final_loss"]
    recipes = {}
    for name in names[1:]:
        r = runs[name]
        rec = recipe_of(name)
        n = min(len(r["history"]["loss"]), len(runs[BASELINE]["history"]["loss"]))
        b = np.asarray(runs[BASELINE]["history"]["loss"][:n], np.float64)
        step_gap = (np.asarray(r["history"]["loss"][:n], np.float64) - b) / b
        recipes[name] = {
            "final_loss": r["final_loss"],
            "rel_gap": (r["final_loss"] - base) / base,
            # Step-to-step spread of the per-step gap over the second half of the run: how
            # much of the final gap is noise (both runs see the same batches).
            "gap_std": float(np.std(step_gap[n // 2:])) if n >= 2 else 0.0,
            "loss": r["history"]["loss"],
            "compile_seconds": r["compile_seconds"],
            "step_ms": r["step_ms"],
            "tiles": {"x": rec.x_tile, "w": rec.w_tile, "grad": rec.grad_tile},
            "formats": {"x": rec.x_format, "w": rec.w_format, "grad": rec.grad_format},
            "delayed": rec.delayed,
        }
    mcfg = tcfg.model_config()
    return {
        "steps": tcfg.steps,
        "model": {"d_model": mcfg.d_model, "num_layers": mcfg.num_layers, "d_ff": mcfg.d_ff},
        "tokens_per_step": tcfg.batch * tcfg.seq_len,
        "baseline": {"name": BASELINE, "final_loss": base,
                     "loss": runs[BASELINE]["history"]["loss"],
                     "step_ms": runs[BASELINE]["step_ms"]},
        "recipes": recipes,
        "deepseek_v3_bar": 0.0025,
    }


def summarize(results: dict[str, Any]) -> str:
    """Final loss and relative gap to bf16-mixed per recipe."""
    b = results["baseline"]
    rows = [[b["name"], "-", f"{b['final_loss']:.4f}", "-", "-", f"{b['step_ms']:.0f}"]]
    for name, r in results["recipes"].items():
        t = r["tiles"]
        rows.append([f"fp8 {name}", f"x {t['x']} / w {t['w']} / g {t['grad']}",
                     f"{r['final_loss']:.4f}", f"{100 * r['rel_gap']:+.3f}%",
                     f"{100 * r['gap_std']:.3f}%", f"{r['step_ms']:.0f}"])
    m = results["model"]
    return format_table(
        ["setup", "tiles", "final loss", "gap vs bf16", "per-step gap std", "ms/step"], rows,
        title=(f"{results['steps']} steps, d_model {m['d_model']}, layers {m['num_layers']}, "
               f"{results['tokens_per_step']} tokens/step; DeepSeek-V3 at scale: gap < 0.25%"))


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``fp8_recipes.png``: loss curves, and the relative gap to bf16-mixed over the steps."""
    b = np.asarray(results["baseline"]["loss"], np.float64)
    with plot_style():
        fig, (ax1, ax2) = figure(1, 2, width=12.0, height=4.0)
        ax1.plot(b, color="k", label="bf16-mixed")
        k = max(1, len(b) // 20)
        kernel = np.ones(k) / k
        for name, r in results["recipes"].items():
            loss = np.asarray(r["loss"], np.float64)
            ax1.plot(loss, label=f"fp8 {name}", alpha=0.8)
            n = min(len(loss), len(b))
            gap = 100 * (loss[:n] - b[:n]) / b[:n]
            smooth = np.convolve(gap, kernel, mode="valid") if n >= k else gap
            ax2.plot(np.arange(len(smooth)) + (n - len(smooth)), smooth, label=f"fp8 {name}")
        ax1.set_xlabel("step")
        ax1.set_ylabel("loss (nats/byte)")
        ax1.set_title("training loss")
        ax1.legend(fontsize=7)
        ax2.axhline(0, color="k", lw=0.8)
        ax2.axhspan(-25e-2, 25e-2, color="#2ca02c", alpha=0.15, label="DeepSeek-V3: |gap| < 0.25%")
        ax2.set_xlabel("step")
        ax2.set_ylabel(f"(L_fp8 - L_bf16) / L_bf16 (%), {k}-step mean")
        ax2.set_title("relative loss gap to bf16-mixed")
        ax2.legend(fontsize=7)
        return [save(fig, out_dir, "fp8_recipes")]
