"""Study ``ablate`` (the main job): a small transformer LM under each precision setup.

Trains ``studies.lib.models.TransformerLM`` (byte level) under the setups of
``studies.training.SETUPS`` (fp32, bf16-mixed, pure-bf16 with plain / stochastically rounded /
Kahan updates, bf16 with f32 master weights, fp16 without and with dynamic loss scaling, the
five FP8 recipes), several seeds per setup (``--seeds``, default 3) trained together by one
vmapped step (``studies.training.multiseed``); seed k of every setup starts from the same
initial parameters and sees the same batches.

The default run shows three contrasts, each in the regime (``studies.lib.regimes``)
where the literature finds it, against a reference setup of its group:

=====================  ======================================  ==============================
regime                 setups (reference first)                expected (literature)
=====================  ======================================  ==============================
late-training          bf16-master, pure-bf16, pure-bf16-sr,   pure bf16 stalls and ends
                       pure-bf16-kahan                         worse; SR and Kahan recover
tokens-per-update      bf16-mixed, fp16, fp16-dynamic          fp16 flushes gradients; loss
                                                               scaling matches bf16
outlier-features       bf16-mixed, fp8-current, fp8-delayed,   per-tensor worse than rowwise,
                       fp8-rowwise, fp8-blockwise, fp8-mxfp8   blockwise, MX
=====================  ======================================  ==============================

The outlier group runs at d_model 256 (``OUTLIER_GROUP``: at the tiny model's 128 a 1x128
tile is a whole row and blockwise cannot differ from rowwise) with its outlier channel at
1e5x; ``fmtkit study outlier-dose`` traces the gaps over magnitudes 1e2..1e5.

``--policies`` (and/or ``--regime``) instead runs one group: those setups (default all but
the FP4 ones) in that regime (default none), reference fp32 when it is among them, else the
first. ``--regime fp4-training`` runs ``studies.training.fp4_training.GROUP`` by default:
bf16-mixed, fp8-blockwise, NVFP4 with and without each ingredient, every layer in FP4, and
MXFP4, on a 4-block model, 60 steps of 32 bytes (``FP4_BUDGET``: within the main job's
time), with per-GEMM FP4 telemetry (``studies.training.fp4_training``). ``--full`` runs the
contrasts longer and larger (the "small" model, 400 steps, 5 seeds).

Per setup: final loss (mean training loss, nats/byte, of the last 10% of the steps) as mean
± std over seeds; its gap to the group's reference, relative, ± the std of one seed's gap,
marked ``*`` when larger than 3 standard errors of the difference (``studies.lib.stats``; the
SE of the per-seed differences, since seed k of both setups shares its parameters and
batches); skipped steps, gradient flush share, share of parameters moved, the median
update-to-weight ratio, compile time, time per vmapped step, bytes per parameter. Under
outlier features a line gives the block's GEMM input (channel amax ratio; SQNR of its
normal channels in bf16 and under each recipe's activation quantization), so the table
shows whether the recipes differ where the regime acts even where the loss does not. With
``--data stdlib`` the held-out loss (bits per byte) of the standard library's held-out
files sits next to the training loss. Plots: seed bands of the loss curves per group and a
bar chart of the gaps with ±3 SE whiskers.

A setup expected to diverge (fp16 without loss scaling) is marked "diverged k/n" instead
of stopping the study; any other non-finite loss stops it with an error (exit 1).

    fmtkit ablate [--seeds N] [--full] [--policies fp32,bf16-mixed,...] [--regime NAME]
                  [--steps N] [--model-size tiny|small|base] [--data FILE|stdlib]
                  [--checkpoint-every K] [--resume RUN_OR_CHECKPOINT_DIR]

Checkpoints (``--checkpoint-every K``): the stacked train state of each group's setup goes
to ``CHECKPOINT_DIR/<timestamp>/<regime>/<setup>/checkpoints/<step>/`` (orbax); ``--resume``
with that folder, or with the earlier run's results folder, continues every setup from its
latest checkpoint with the same options, and ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmtkit import fp8, qdq
from fmtkit.telemetry import compare
from studies.lib import corpus, regimes, stats
from studies.lib.common import format_table, no_progress
from studies.lib.models import TransformerLM
from studies.training import (
    DEFAULT_SETUPS,
    SETUPS,
    TrainConfig,
    batch_at,
    distributed,
    fp4_training,
    load_data,
    mesh,
    multiseed,
)
from studies.training.setups import FP4_SETUPS

# How the command line lists this study (studies.app.registry).
NAME = "ablate"
SUMMARY = "the main job: a small LM trained under each precision setup (fmtkit ablate)"
ORDER = 70

__all__ = ["CONTRASTS", "FP4_BUDGET", "OUTLIER_GROUP", "Config", "gap_curves", "main",
           "outlier_config", "plot", "run", "run_order", "summarize"]

CONTRASTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("late-training", ("bf16-master", "pure-bf16", "pure-bf16-sr", "pure-bf16-kahan")),
    ("tokens-per-update", ("bf16-mixed", "fp16", "fp16-dynamic")),
    ("outlier-features", ("bf16-mixed", "fp8-current", "fp8-delayed", "fp8-rowwise",
                          "fp8-blockwise", "fp8-mxfp8")),
)
"""The default groups: (regime, setups with the reference first) (module docstring)."""

FULL = dict(model_size="small", steps=400, seeds=5)
"""``--full``: the contrasts with the 4-layer "small" model, longer, more seeds."""

FP4_BUDGET = dict(steps=60, seq_len=32)
"""``--regime fp4-training`` without ``--full``: fewer steps of shorter sequences, within
the main job's time. The FP4 emulation costs several times a BF16 step and each FP4 setup
compiles its own step, so 150 steps of 64 bytes took well over it; 60 steps of 32 bytes keep
the 4-block stack (the last block in BF16 by position), 3 seeds and the paired gaps (MXFP4 vs
NVFP4 resolves at 60 steps; the FP4-vs-BF16 gaps keep their sign on every seed), within the
main job's wall time (docs/results/main-job.md, "Time budget of the FP4 regime"). Applied to
the fields left at the main job's defaults (``Config().train``); a ``--steps`` or
``--seq-len`` set to another value wins."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``ablate`` study.

    Attributes:
      policies: the setups to train (comma- or space-separated), in table order; see
        studies.training.SETUPS. Empty (default): the contrast groups (module docstring), or
        with ``--regime`` every setup but the FP4 ones (fp4-training: its own group).
      full: the contrasts with the "small" model, 400 steps and 5 seeds (longer).
      checkpoint_dir: checkpoints go to CHECKPOINT_DIR/<timestamp>/<regime>/<setup>/.
      resume: continue an earlier run: its checkpoint folder, or its results folder.
      parallel: setups of a group trained at once, each in its own thread (XLA runs one
        small step on about one core, so two setups fill a 2-core machine); 0 (default):
        the machine's core count, at most 2; always 1 under several processes (every
        process must issue its collectives in the same order). Results do not depend on it.
      train: the training settings of every setup (model size, steps, seeds, regime, batch,
        lr, data, checkpoints).
    """

    policies: tuple[str, ...] = ()
    full: bool = False
    checkpoint_dir: str = "runs/ablate-checkpoints"
    resume: str | None = None
    parallel: int = 0
    train: TrainConfig = TrainConfig(steps=150, seeds=3)

    def __post_init__(self):
        if isinstance(self.policies, str):
            object.__setattr__(self, "policies", (self.policies,))
        if not isinstance(self.policies, tuple):
            raise TypeError(f"policies must be a tuple of setup names, got "
                            f"{type(self.policies).__name__}.")
        # "fp32,bf16-mixed" and "fp32 bf16-mixed" (one name per argument) both work.
        object.__setattr__(self, "policies", tuple(
            p.strip() for item in self.policies for p in item.split(",") if p.strip()))
        unknown = [p for p in self.policies if p not in SETUPS]
        if unknown:
            raise ValueError(f"unknown policies {', '.join(map(repr, unknown))}; valid: "
                             f"{', '.join(SETUPS)}.")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies lists a setup twice: {', '.join(self.policies)}.")
        if not isinstance(self.train, TrainConfig):
            raise TypeError(f"train must be a studies.training.TrainConfig, got "
                            f"{type(self.train).__name__}.")
        if self.train.data is not None and self.train.data != corpus.STDLIB:
            p = Path(self.train.data)
            if not p.exists():
                raise ValueError(f"--data {self.train.data!r}: no such file.")
            if not p.is_file():
                raise ValueError(f"--data {self.train.data!r} is not a file; give a UTF-8 "
                                 "text file.")
            if p.stat().st_size == 0:
                raise ValueError(f"--data {self.train.data!r} is empty; give a non-empty "
                                 "UTF-8 text file.")
        if isinstance(self.parallel, bool) or not isinstance(self.parallel, int) or \
                self.parallel < 0:
            raise ValueError(f"parallel must be an int >= 0 (0: automatic), got "
                             f"{self.parallel!r}.")
        if self.resume is not None and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume!r}: no such folder (give the checkpoint "
                             "folder or the results folder of an earlier ablate run).")

    def groups(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(regime, setups) of each group to run (reference first); without policies the
        fp4-training regime runs ``studies.training.fp4_training.GROUP``, the others every setup but
        the FP4 ones."""
        if not self.policies and self.train.regime == "none":
            return CONTRASTS
        default = (fp4_training.GROUP if self.train.regime == "fp4-training"
                   else DEFAULT_SETUPS)
        return ((self.train.regime, self.policies or default),)

    def workers(self) -> int:
        """Setups trained at once (``parallel`` resolved)."""
        if jax.process_count() > 1:
            return 1
        return self.parallel or max(1, min(2, os.cpu_count() or 1))

    def train_config(self) -> TrainConfig:
        """``train`` with the ``--full`` preset applied, or for the fp4-training regime
        without it, ``FP4_BUDGET`` on the fields left at their defaults."""
        if self.full:
            return dataclasses.replace(self.train, **FULL)
        if self.train.regime == "fp4-training":
            default = Config().train
            return dataclasses.replace(self.train, **{
                k: v for k, v in FP4_BUDGET.items()
                if getattr(self.train, k) == getattr(default, k)})
        return self.train


def _checkpoint_root(config: Config) -> Path | None:
    """The folder holding one sub-folder of checkpoints per setup (None: no checkpoints)."""
    if config.resume is not None:
        root = Path(config.resume)
        results = root / "results.json"
        if results.is_file():  # an earlier run's results folder: it names its checkpoints
            ckpt = json.loads(results.read_text())["results"].get("checkpoint_dir")
            if not ckpt:
                raise ValueError(f"--resume {config.resume!r}: that run kept no checkpoints "
                                 "(it ran with --checkpoint-every 0).")
            root = Path(ckpt)
            if not root.is_dir():
                raise ValueError(f"--resume {config.resume!r}: its checkpoint folder {ckpt!r} "
                                 "no longer exists.")
        return root
    if config.train_config().checkpoint_every > 0:
        # One folder for all processes of a multi-process run: process 0's clock names it.
        stamp = distributed.same_on_all(int(time.time()))
        return Path(config.checkpoint_dir) / time.strftime("%Y%m%d-%H%M%S",
                                                           time.localtime(stamp))
    return None


def _group_rows(regime: str, names: tuple[str, ...], cfg: TrainConfig, data: np.ndarray,
                params: list[Any], root: Path | None, resume: bool, progress, workers: int
                ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Trains one group; its rows and the regime's info (late-training: the calibration;
    outlier-features: ``_gemm_input_sqnr``)."""
    gcfg = dataclasses.replace(cfg, regime=regime)
    info = None
    if regime == "late-training":
        gcfg, params, info = multiseed.late_training(gcfg, progress, data=data)
    elif regime in ("outlier-features", "fp4-training"):
        if regime == "outlier-features":
            gcfg = outlier_config(gcfg)
        params = multiseed.seed_params(gcfg)  # the regime changes the model's config

    fp4 = regime == "fp4-training"
    keep = fp4_training.noise_steps(gcfg.steps) if fp4 else ()
    batch = batch_at(data, gcfg, gcfg.steps) if fp4 else None
    tokens = mesh.replicate(batch, gcfg.data_parallel) if fp4 else None

    def train(name: str) -> tuple[multiseed.SeedsResult, float, dict[str, Any] | None]:
        t0 = time.perf_counter()
        tele_fp4 = fp4 and name in FP4_SETUPS
        # The noise curve's FP4 gradients come from the training step's own compile.
        res = multiseed.train_seeds(
            name, gcfg, progress, run_dir=None if root is None else root / regime / name,
            resume=resume, data=data, params=params,
            snapshot_steps=keep if tele_fp4 else (), grad_batch=batch if tele_fp4 else None)
        wall = time.perf_counter() - t0
        tele = None
        if tele_fp4:  # in this thread, while the other workers train
            tele = fp4_training.setup_telemetry(gcfg, name, res.snapshots,
                                                res.snapshot_grads, tokens, ref_grad.result)
            if tele is not None:
                tele["seconds"] = time.perf_counter() - t0 - wall
        return res, wall, tele

    with ThreadPoolExecutor(workers) as pool:
        if fp4:  # one reference gradient for every setup's telemetry, compiled first
            ref_grad = pool.submit(fp4_training.reference_grad, gcfg, params[0], tokens)
        order = run_order(names)
        done = dict(zip(order, pool.map(train, order)))
    results = [done[n] for n in names]  # table order
    rows = []
    for res, wall, _ in results:
        row = res.summary()
        row["regime"] = regime
        row["wall_seconds"] = wall
        rows.append(row)
    if regime == "outlier-features":
        info = _gemm_input_sqnr(gcfg, multiseed.unstack(results[0][0].state)[0].params, data,
                                names)
        info["per_tensor_vs_fine"] = _per_tensor_vs_fine(rows)
        info["magnitude"] = float(max(gcfg.model_config().outlier_scale))
        info["d_model"] = gcfg.model_config().d_model
    elif fp4:
        info = {n: tele for n, (_, _, tele) in zip(names, results) if tele is not None}
    ref = rows[0]["final_loss"]
    for r in rows:
        gap = stats.compare(ref, r["final_loss"], paired=True)
        r["reference"] = rows[0]["setup"]
        r["gap"] = gap.to_dict()
        r["gap_welch"] = stats.compare(ref, r["final_loss"]).to_dict()
        held = [p["heldout_loss"] for p in r["per_seed"]]
        r["heldout_bits_per_byte"] = (None if any(h is None for h in held) else
                                      [corpus.bits_per_byte(h) for h in held])
    return rows, info


OUTLIER_GROUP = dict(d_model=256, magnitude=1e5)
"""The outlier-features group's width and outlier magnitude. At the tiny model's d_model
128 a 1x128 tile is the whole row, so fine-grained scaling cannot separate the outlier
channel from the others and blockwise equals rowwise; at 256 the outlier channel holds one
of two tiles per row (``studies.lm.outlier_dose``). 1e5 is the top of the literature's range
(``studies.lib.regimes.OutlierFeatures``) and the magnitude at which per-tensor scaling hurts
the GEMM input most there (SQNR of the normal tile 9 dB against FP8's own 32 dB)."""


OUTLIER_NOTE = (
    "`fmtkit study outlier-dose` (100 steps, seeds 0-2) traces it over magnitudes: "
    "per-tensor minus 1x128 blockwise is within +-0.06% from 1e2 to 3e4 and first "
    "significant (> 3 SE) at 1e5 (fp8-delayed +0.16% +- 0.06%); this group's 150 steps at "
    "1e5 resolved it for both per-tensor setups when measured (about +0.3%).")
"""What the outlier-dose study found (printed under the group's table): the smallest
magnitude at which it found the per-tensor vs fine-grained contrast significant."""


def outlier_config(cfg: TrainConfig) -> TrainConfig:
    """The outlier group's training config: ``cfg``'s model widened to
    ``OUTLIER_GROUP["d_model"]`` when narrower (d_ff at least twice that), with the outlier
    channel at ``OUTLIER_GROUP["magnitude"]`` (``OutlierFeatures(magnitude=...)``: the
    regime's channel, so the readers it holds at zero are the same)."""
    base = dataclasses.replace(cfg, regime="none").model_config()
    d = max(base.d_model, OUTLIER_GROUP["d_model"])
    if d != base.d_model:
        base = dataclasses.replace(base, d_model=d, d_ff=max(base.d_ff, 2 * d))
    model = regimes.OutlierFeatures(magnitude=OUTLIER_GROUP["magnitude"]).apply(base)
    return dataclasses.replace(cfg, model=model, regime="outlier-features")


def run_order(names: tuple[str, ...]) -> tuple[str, ...]:
    """The order in which a group's setups start: the FP4 setups first (each compiles for
    longer than an FP8 or BF16 step, and runs its telemetry after training), then the
    others, each part in table order. With two setups at a time the longest jobs then
    start first and the short ones fill the end, so both cores stay busy to the last
    (longest-first scheduling); the results do not depend on the order."""
    return tuple(sorted(names, key=lambda n: n not in FP4_SETUPS))


def _gemm_input_sqnr(cfg: TrainConfig, params: Any, data: np.ndarray,
                     names: tuple[str, ...]) -> dict[str, Any]:
    """Outlier features: what the FP8 recipes do to the GEMM input the regime shapes.

    The first block's attention input (``ln_1``'s output times the regime's channel scale)
    of ``params`` (the reference's seed 0 after training) on the batch after the last
    training step, flattened to [tokens, d_model]: its channel amax ratio, and the SQNR (dB)
    of its normal channels after bf16 rounding and after each FP8 setup's activation
    quantization (``Fp8Recipe.scaling("x")``; delayed as current: its history's amax is at
    least the current one). Shows whether the recipes differ where the regime acts, whatever
    the loss does.
    """
    mcfg = cfg.model_config()
    tokens = mesh.replicate(batch_at(data, cfg, cfg.steps), cfg.data_parallel)  # as params
    _, inter = TransformerLM(mcfg).apply({"params": params}, tokens, mutable=["intermediates"],
                                         capture_intermediates=True)
    (y,) = inter["intermediates"]["Block_0"]["ln_1"]["__call__"]
    scale = np.asarray(mcfg.outlier_scale, np.float32)
    x = y.reshape(-1, mcfg.d_model) * jnp.asarray(scale)[None, :]
    normal = np.flatnonzero(scale == 1.0)

    def sqnr(q):
        return float(compare(x[:, normal], q[:, normal]).sqnr_db)

    out = {"channel_amax_ratio": float(regimes.channel_amax_ratio(x)),
           "sqnr_db": {"bf16": sqnr(x.astype(jnp.bfloat16).astype(jnp.float32))}}
    for name in names:
        if name.startswith("fp8-"):
            recipe = fp8.get_recipe(name.removeprefix("fp8-"))
            out["sqnr_db"][name] = sqnr(qdq(x, recipe.x_format, recipe.scaling("x")))
    return out


PER_TENSOR = ("fp8-current", "fp8-delayed")
"""The per-tensor FP8 setups; the others (rowwise, blockwise, MX) scale finer tiles."""


def _per_tensor_vs_fine(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Outlier features: each per-tensor setup against each finer-grained one, paired per
    seed (``stats.compare(fine, per_tensor)``: a positive gap means per-tensor is worse)."""
    by = {r["setup"]: r["final_loss"] for r in rows}
    fine = [n for n in by if n.startswith("fp8-") and n not in PER_TENSOR]
    return [{"per_tensor": a, "fine": b,
             "gap": stats.compare(by[b], by[a], paired=True).to_dict()}
            for a in PER_TENSOR if a in by for b in fine]


def _recovered(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Late training: the share of pure-bf16's gap to bf16-master that SR / Kahan recover,
    (loss(pure) - loss(x)) / (loss(pure) - loss(master)) on the seed means."""
    by = {r["setup"]: float(np.nanmean(r["final_loss"])) for r in rows}
    if not {"bf16-master", "pure-bf16"} <= by.keys():
        return None
    gap = by["pure-bf16"] - by["bf16-master"]
    return {k: (by["pure-bf16"] - by[k]) / gap if gap != 0 else float("nan")
            for k in ("pure-bf16-sr", "pure-bf16-kahan") if k in by}


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains every group of ``config.groups()`` and returns the tables and the curves.

    Writes nothing but checkpoints (when asked for). Returns a dict with ``groups`` (per
    group: ``regime``, ``reference``, ``rows`` (one per setup: ``SeedsResult.summary`` with
    every seed's numbers, ``gap`` (paired rule) and ``gap_welch`` as ``stats.Gap.to_dict``,
    ``heldout_bits_per_byte``), ``late_training`` calibration, ``recovered``),
    ``entropy_floor_nats`` (None with ``--data``), ``train_config``, ``checkpoint_dir``,
    ``descriptions``, ``parallel_setups`` (``Config.workers``) and ``wall_seconds``.
    """
    t0 = time.perf_counter()
    cfg = config.train_config()
    data = load_data(cfg)  # once for all setups
    params = multiseed.seed_params(cfg)  # seed k of every setup starts from these
    root = _checkpoint_root(config)
    floor = corpus.entropy_rate_nats() if cfg.data is None else None
    groups = []
    for regime, names in config.groups():
        rows, info = _group_rows(regime, names, cfg, data, params, root,
                                 config.resume is not None, progress, config.workers())
        groups.append({"regime": regime, "reference": names[0], "rows": rows,
                       "late_training": info if regime == "late-training" else None,
                       "gemm_input": info if regime == "outlier-features" else None,
                       "recovered": _recovered(rows) if regime == "late-training" else None,
                       "fp4": info if regime == "fp4-training" else None})
    names = [r["setup"] for g in groups for r in g["rows"]]
    return {
        "train_config": dataclasses.asdict(cfg),
        "seeds": list(cfg.seed_list),
        "entropy_floor_nats": floor,
        "checkpoint_dir": None if root is None else str(root),
        "descriptions": {n: SETUPS[n].description for n in names},
        "groups": groups,
        "parallel_setups": config.workers(),
        "wall_seconds": time.perf_counter() - t0,
    }


def _f(v: Any, fmt: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, fmt)


def summarize(results: dict[str, Any]) -> str:
    """The tables printed by ``fmtkit ablate`` (one per group)."""
    floor = results.get("entropy_floor_nats")
    c = results["train_config"]
    out = [f"ablate: {c['model_size']} model, {c['steps']} steps of {c['batch']}x"
           f"{c['seq_len']} bytes, lr {c['lr']}, seeds {results['seeds']}, "
           f"{results['wall_seconds']:.0f} s in all", ""]
    held = any(r.get("heldout_bits_per_byte") for g in results["groups"] for r in g["rows"])
    for g in results["groups"]:
        header = ["setup", "final loss", f"vs {g['reference']}", "skipped", "grad flush",
                  "params moved", "upd/weight", "compile s", "step ms", "s/seed",
                  "bytes/param"]
        if held:
            header[2:2] = ["train bpb", "held-out bpb"]
        rows = []
        for r in g["rows"]:
            vals = r["final_loss"]
            n_bad = sum(1 for v in vals if not math.isfinite(v))
            loss = (f"diverged {n_bad}/{len(vals)}" if n_bad else
                    stats.format_mean_std(vals))
            gap = ("-" if r["setup"] == g["reference"] else
                   stats.format_gap(stats.Gap.from_dict(r["gap"])))
            ps = r["per_seed"]
            row = [r["setup"], loss, gap,
                   f"{np.mean([p['skipped_steps'] for p in ps]):.1f}",
                   f"{100 * np.mean([p['grad_flush'] for p in ps]):.3g}%",
                   f"{100 * np.mean([p['update_frac'] for p in ps]):.1f}%",
                   f"{np.median([p['update_ratio'] for p in ps]):.1e}",
                   _f(r["compile_seconds"], ".1f"), _f(r["step_ms"], ".1f"),
                   _f(r["wall_seconds"] / len(ps), ".1f"), _f(r["bytes_per_param"], ".1f")]
            if held:
                bpb = r.get("heldout_bits_per_byte")
                row[2:2] = [stats.format_mean_std([corpus.bits_per_byte(v) for v in vals]),
                            "-" if not bpb else stats.format_mean_std(bpb)]
            rows.append(row)
        title = f"regime: {g['regime']} (reference {g['reference']})"
        out += [format_table(header, rows, title=title)]
        if g.get("late_training"):
            lt = g["late_training"]
            out.append(f"  late phase: constant lr {lt['lr']:.3g} (update-to-weight "
                       f"{lt['update_to_weight_target']:g} for fresh Adam), from fp32 "
                       f"pretrained for {c['steps']} steps (loss "
                       f"{stats.format_mean_std(lt['pretrain_final_loss'])}).")
        if g.get("gemm_input"):
            gi = g["gemm_input"]
            out.append(
                f"  GEMM input (block 0 attention, {g['reference']} seed 0 after training): "
                f"channel amax ratio {gi['channel_amax_ratio']:.3g}; SQNR of its normal "
                "channels: " + ", ".join(f"{k} {v:.1f} dB" for k, v in gi["sqnr_db"].items()))
            out.append(f"  outlier channel {gi.get('magnitude', 0):g}x at d_model "
                       f"{gi.get('d_model')} (1x128 tiles per row: "
                       f"{gi.get('d_model', 0) // 128}). {OUTLIER_NOTE}")
            if gi.get("per_tensor_vs_fine"):
                out.append("  per-tensor vs finer tiles (paired; > 0: per-tensor worse): " +
                           ", ".join(f"{c['per_tensor']} - {c['fine']} "
                                     f"{stats.format_gap(stats.Gap.from_dict(c['gap']))}"
                                     for c in gi["per_tensor_vs_fine"]))
        if g.get("fp4"):
            out.append("  FP4 telemetry (seed 0, batch after the last step; median over the "
                       "setup's FP4 layers):")
            out += fp4_training.summary_lines(g["fp4"])
        if g.get("recovered"):
            out.append("  share of pure-bf16's gap to bf16-master recovered: " + ", ".join(
                f"{k} {100 * v:.0f}%" for k, v in g["recovered"].items()))
        out.append("")
    out += [
        "final loss: mean training cross entropy (nats/byte) of the last 10% of the steps, "
        "mean ± std over seeds.",
        "vs <reference>: mean over seeds of (setup - reference) relative to the reference "
        f"mean, ± the std of one seed's gap; {stats.MARK}: |gap| > {stats.THRESHOLD:g} "
        "standard errors of the per-seed differences (paired: seed k of both setups shares "
        "its parameters and batches); results.json also has Welch's unpaired SE.",
        ("entropy floor of the corpus: "
         f"{floor:.4f} nats/byte (the best any model can do)." if floor is not None else
         "no known entropy floor for --data."),
        "grad flush: mean share of nonzero gradient values (as the optimizer receives them, "
        "scaled if the loss is) that round to 0 in the setup's gradient format.",
        "params moved: mean share of parameter elements an update changes; upd/weight: "
        "median update-to-weight ratio of the weight matrices per step.",
        "step ms: one vmapped step of all seeds; s/seed: the setup's wall time per seed "
        f"({results.get('parallel_setups', 1)} setup(s) trained at a time, sharing the "
        "cores).",
    ]
    return "\n".join(out)


def gap_curves(rows: list[dict[str, Any]], reference: str) -> dict[str, list[list[float]]]:
    """Setup -> each seed's relative loss gap to the reference over the steps, paired:
    ``(loss_setup[k, t] - loss_ref[k, t]) / mean_k loss_ref[k, t]`` for seed k (which shares
    its initial parameters and batches with the reference's seed k). The reference and
    setups without curves are left out."""
    curves = multiseed.seed_curves(rows)
    if reference not in curves:
        return {}
    ref = np.asarray(curves[reference], np.float64)
    out = {}
    for name, runs in curves.items():
        if name == reference:
            continue
        y = np.asarray(runs, np.float64)
        n = min(y.shape[1], ref.shape[1])
        out[name] = ((y[:, :n] - ref[:, :n]) / ref[:, :n].mean(axis=0)).tolist()
    return out


def plot(results: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Per group: ``loss_<regime>.png`` (mean ± std bands of the loss curves, 10-step
    moving average), ``gapcurve_<regime>.png`` (each setup's relative loss gap to the
    reference over the steps, paired per seed, mean ± std band, 10-step moving average: the
    raw curves lie on top of each other when gaps are a fraction of a percent),
    ``gradnoise_<regime>.png`` (fp4-training: ``fp4_training.plot_noise``) and
    ``gaps_<regime>.png`` (final gap to the reference, ±3 SE whiskers)."""
    paths = []
    floor = results.get("entropy_floor_nats")
    for g in results["groups"]:
        paths.append(stats.plot_seed_bands(
            multiseed.seed_curves(g["rows"]), out_dir, f"loss_{g['regime']}", smooth=10,
            hline=floor,
            title=f"{g['regime']}: loss, mean ± std over seeds"))
        gc = gap_curves(g["rows"], g["reference"])
        if gc:
            paths.append(stats.plot_seed_bands(
                gc, out_dir, f"gapcurve_{g['regime']}", smooth=10, hline=0.0,
                ylabel=f"(loss - {g['reference']}) / {g['reference']}",
                title=f"{g['regime']}: loss gap to {g['reference']}, paired per seed, "
                      "mean ± std"))
        if g.get("fp4"):
            p = fp4_training.plot_noise(g["fp4"], out_dir, f"gradnoise_{g['regime']}")
            if p is not None:
                paths.append(p)
        gaps = {r["setup"]: stats.Gap.from_dict(r["gap"]) for r in g["rows"]
                if r["setup"] != g["reference"]}
        if gaps:
            paths.append(stats.plot_gap_bars(
                gaps, out_dir, f"gaps_{g['regime']}",
                title=f"{g['regime']}: gap to {g['reference']} (±3 SE, paired)"))
    return paths


def main(argv: list[str] | None = None) -> int:
    """``fmtkit ablate [options]``: ``fmtkit study ablate [options]``; returns the exit code."""
    import sys

    from studies.app.runner import main as runner_main

    argv = list(sys.argv[1:] if argv is None else argv)
    return runner_main(["ablate", *argv])


if __name__ == "__main__":
    raise SystemExit(main())
