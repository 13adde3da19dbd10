"""Study ``fp8-recipes``: training loss of the small transformer under each FP8 recipe vs
bf16-mixed, over several seeds.

Each setup is the ``fp8-<recipe>`` policy preset of ``studies.training`` (bf16-mixed with the
recipe on every linear layer; embeddings, head, norms, router and the attention core stay
bf16/f32, as in DeepSeek-V3 section 3.3). Every setup trains the seeds ``--seeds`` (default
3) together with one vmapped step (``studies.training.multiseed.train_seeds``); seed k of
every setup starts from the same initial parameters and sees the same batches as seed k of
the ``bf16-mixed`` baseline. Reported per recipe: the final loss (mean of the last 10% of
steps) as mean ± std over seeds, and the **relative loss gap** ``(L_fp8 - L_bf16) / L_bf16``
over seeds, ± the std of one seed's gap, marked when larger than 3 standard errors of the
per-seed differences (``studies.lib.stats.compare(paired=True)``; the pairing removes the
seed-to-seed spread both setups share). DeepSeek-V3 (arXiv 2412.19437, section 3.3 and
appendix B.1) reports a gap below 0.25% for its fine-grained recipe on ~1T-token runs; a few
hundred steps of a tiny model on a CPU give the sign and size of the early gap, not that bar.

Recipes (``fmtkit.fp8.RECIPES``): ``current`` and ``delayed`` (per tensor, E4M3 forward,
E5M2 gradients), ``rowwise``, ``blockwise`` (DeepSeek: 1x128 activations and gradients,
128x128 weights, E4M3 throughout), ``mxfp8`` (OCP MX: 32-element blocks, E8M0 scales) and
``blockwise-g128``: blockwise with the activation gradients quantized in 128x128 blocks like
the weights (``Fp8Recipe(grad_tile="128x128")``): the variant DeepSeek-V3 appendix B.2 found
to diverge a 16B MoE after ~300B tokens (token-correlated outliers in activation gradients
need per-token 1x128 tiles). Its forward pass is the same as blockwise's; only the
gradients differ. When both run, the paired gap blockwise-g128 minus blockwise is reported
too, with whether its sign is DeepSeek's (128x128 worse); ``--regime token-grad-outliers``
(``studies.lib.regimes``) gives the activation gradients the token-correlated outliers that
DeepSeek blames.

    fmtkit study fp8-recipes [--steps 200] [--seeds 3] [--recipes blockwise blockwise-g128]
                             [--regime token-grad-outliers]
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fmtkit.fp8 import RECIPES, Fp8Recipe
from fmtkit.policy import Policy, Rules, get_preset
from studies.lib import stats
from studies.lib.common import format_table, no_progress
from studies.training import multiseed
from studies.training.config import TrainConfig

# How the command line lists this study (studies.app.registry).
NAME = "fp8-recipes"
SUMMARY = "training loss under each FP8 recipe (incl. 128x128 grad blocks) vs bf16-mixed"
ORDER = 130

__all__ = ["EXTRA_RECIPES", "G128_PAIR", "Config", "g128_verdict", "plot", "recipe_of", "run",
           "setup_of", "summarize"]

EXTRA_RECIPES: dict[str, Fp8Recipe] = {
    "blockwise-g128": dataclasses.replace(RECIPES["blockwise"], name="blockwise-g128",
                                          grad_tile="128x128"),
}
"""Recipes beyond ``fmtkit.fp8.RECIPES``: blockwise with 128x128 activation-gradient blocks."""

BASELINE = "bf16-mixed"

G128_PAIR = ("blockwise", "blockwise-g128")
"""(reference, candidate) of the gradient-tile comparison: DeepSeek-V3 appendix B.2 found the
candidate (128x128 activation-gradient blocks) worse, so a positive gap is its sign."""


def recipe_of(name: str) -> Fp8Recipe:
    """The FP8 recipe called ``name`` (``fmtkit.fp8.RECIPES`` or ``EXTRA_RECIPES``)."""
    if name in RECIPES:
        return RECIPES[name]
    if name in EXTRA_RECIPES:
        return EXTRA_RECIPES[name]
    raise ValueError(f"unknown recipe {name!r}; valid: "
                     f"{', '.join([*RECIPES, *EXTRA_RECIPES])}.")


def setup_of(name: str):
    """The ``studies.training.Setup`` of a recipe: the registered ``fp8-<name>`` setup, or, for
    an extra recipe, bf16-mixed's rules with the recipe on every other (linear) layer, as
    ``fmtkit``'s ``fp8-*`` presets are built."""
    from studies import training

    if name == BASELINE:
        return training.get_setup(BASELINE)
    if f"fp8-{name}" in training.SETUPS:
        return training.get_setup(f"fp8-{name}")
    recipe = recipe_of(name)
    mixed = get_preset("bf16-mixed")
    rules = Rules(mixed.rules, default=Policy("float32", "bfloat16", "bfloat16", fp8=recipe),
                  head=mixed.head, output_dtype=mixed.output_dtype, check_unmatched=False)
    return training.Setup(f"fp8-{name}", rules, grad_format="bfloat16",
                       description=f"bf16-mixed + FP8 {name} recipe on the linear layers")


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``fp8-recipes`` study.

    Attributes:
      recipes: FP8 recipes to train (current, delayed, rowwise, blockwise, mxfp8,
        blockwise-g128); each is compared with bf16-mixed.
      train: the training settings shared by every setup (model size, steps, batch, lr,
        seeds: seed k of every setup has the same initialization and batches; regime).
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
            raise TypeError(f"train must be a studies.training.TrainConfig, got "
                            f"{type(self.train).__name__}.")


def _paired(ref: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any]:
    """The paired gap of two ``SeedsResult.summary`` rows' final losses, as a dict."""
    return stats.compare(ref["final_loss"], cand["final_loss"], paired=True).to_dict()


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains bf16-mixed and each recipe, every seed; final losses and paired gaps.

    Returns:
      ``{"baseline": row, "recipes": {name: row | {"gap", "recipe", "tiles", "formats",
      "delayed"}}, "g128_vs_blockwise": gap or None, "seeds", ...}``: each row a
      ``SeedsResult.summary()`` (per-seed final losses and histories), each gap a
      ``stats.Gap.to_dict()`` (paired, per-seed values included).

    Raises:
      StudyError: a non-finite loss.
    """
    from studies import training

    tcfg = config.train
    data = training.load_data(tcfg)
    params = multiseed.seed_params(tcfg)  # seed k of every setup starts from these
    names = [BASELINE, *dict.fromkeys(config.recipes)]
    rows: dict[str, dict[str, Any]] = {}
    for name in progress(names, total=len(names), desc="setups"):
        rows[name] = multiseed.train_seeds(setup_of(name), tcfg, progress, data=data,
                                           params=params).summary()
    base = rows[BASELINE]
    recipes = {}
    for name in names[1:]:
        rec = recipe_of(name)
        recipes[name] = {
            **rows[name],
            "gap": _paired(base, rows[name]),
            "recipe": rec.name,
            "tiles": {"x": rec.x_tile, "w": rec.w_tile, "grad": rec.grad_tile},
            "formats": {"x": rec.x_format, "w": rec.w_format, "grad": rec.grad_format},
            "delayed": rec.delayed,
        }
    ref, cand = G128_PAIR
    mcfg = tcfg.model_config()
    return {
        "steps": tcfg.steps,
        "seeds": list(tcfg.seed_list),
        "regime": tcfg.regime,
        "model": {"d_model": mcfg.d_model, "num_layers": mcfg.num_layers, "d_ff": mcfg.d_ff},
        "tokens_per_step": tcfg.batch * tcfg.seq_len,
        "baseline": base,
        "recipes": recipes,
        "g128_vs_blockwise": (_paired(rows[ref], rows[cand]) if {ref, cand} <= rows.keys()
                              else None),
        "deepseek_v3_bar": 0.0025,
    }


def g128_verdict(gap: stats.Gap) -> str:
    """One sentence on blockwise-g128 minus blockwise against DeepSeek-V3's finding."""
    sign = ("128x128 worse: DeepSeek-V3's sign" if gap.gap > 0 else
            "128x128 not worse: DeepSeek-V3's sign (128x128 worse) is not reproduced")
    sig = (f"significant (> {gap.threshold:g} SE)" if gap.significant else
           f"not significant (<= {gap.threshold:g} SE)")
    return (f"blockwise-g128 vs blockwise (paired): {stats.format_gap(gap)} "
            f"({gap.gap:+.5f} nats, SE {gap.se:.5f}); {sign}; {sig}.")


def summarize(results: dict[str, Any]) -> str:
    """Final loss (mean ± std over seeds) and the paired gap to bf16-mixed per recipe."""
    b = results["baseline"]
    rows = [[b["setup"], "-", stats.format_mean_std(b["final_loss"]), "-",
             f"{b['step_ms']:.0f}"]]
    for name, r in results["recipes"].items():
        t = r["tiles"]
        rows.append([f"fp8 {name}", f"x {t['x']} / w {t['w']} / g {t['grad']}",
                     stats.format_mean_std(r["final_loss"]),
                     stats.format_gap(stats.Gap.from_dict(r["gap"])), f"{r['step_ms']:.0f}"])
    m = results["model"]
    out = [format_table(
        ["setup", "tiles", "final loss", "gap vs bf16", "ms/step (all seeds)"], rows,
        title=(f"{results['steps']} steps, d_model {m['d_model']}, layers {m['num_layers']}, "
               f"{results['tokens_per_step']} tokens/step, regime {results['regime']}, seeds "
               f"{results['seeds']}; DeepSeek-V3 at scale: gap < 0.25%"))]
    if results.get("g128_vs_blockwise"):
        out.append(g128_verdict(stats.Gap.from_dict(results["g128_vs_blockwise"])))
    out += ["final loss: mean training loss (nats/byte) of the last 10% of the steps, mean ± "
            "std over seeds; gap relative to bf16-mixed's mean.", stats.PAIRED_NOTE]
    return "\n".join(out)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``fp8_recipes_loss.png``: loss curves, mean ± std over seeds; ``fp8_recipes_gaps.png``:
    each recipe's final-loss gap to bf16-mixed (and blockwise-g128's to blockwise) with ±3 SE
    whiskers."""
    rows = [results["baseline"], *results["recipes"].values()]
    paths = [stats.plot_seed_bands(
        multiseed.seed_curves(rows), out_dir, "fp8_recipes_loss", smooth=10,
        title=f"training loss, mean ± std over seeds {results['seeds']}")]
    gaps = {f"fp8 {n} vs bf16": stats.Gap.from_dict(r["gap"])
            for n, r in results["recipes"].items()}
    if results.get("g128_vs_blockwise"):
        gaps["g128 vs blockwise"] = stats.Gap.from_dict(results["g128_vs_blockwise"])
    paths.append(stats.plot_gap_bars(
        gaps, out_dir, "fp8_recipes_gaps",
        title="final-loss gap over seeds (paired, ±3 SE; DeepSeek-V3: < 0.25%)"))
    return paths
