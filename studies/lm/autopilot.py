"""Study ``autopilot``: the precision autopilot (``fmtkit.debug.Autopilot``) on a run where
FP8 goes wrong for some GEMMs, against all-FP8 and all-BF16.

The run is the large-outlier regime of ``outlier-dose``: the one-block LM at d_model 256
(``studies.training.fp8_training.wide_model``) with one LayerNorm output channel scaled up to
``magnitude`` (default 1e5, grown geometrically from 1 over ``ramp_steps`` steps from
``ramp_start``: an emerging outlier) and its readers' kernel rows held at zero, so only the
quantizers see it. Under per-tensor current scaling (``fp8-current``) the scale follows the
outlier, and the GEMMs that read the norm outputs (the attention's query/key/value
projections and the MLP's first layer) flush the other entries of their activation to zero:
the activation's underflow share climbs, the other GEMMs are unaffected.

Three arms per seed, each from the same initial parameters and batches:

* ``bf16-mixed``: no FP8 (the reference);
* ``fp8-current``: every linear layer in FP8 with per-tensor current scaling;
* ``autopilot``: ``fp8-current`` watched by an ``Autopilot`` that moves a GEMM to its
  compute dtype (``"compute"``) once its watched operands' underflow share is above
  ``underflow_share`` on ``patience`` consecutive logged steps (every ``freq`` steps), or at
  once on a non-finite element.

Reported per arm: the final loss (mean of the last tenth of the steps) and its paired gap
to bf16-mixed over the seeds with the 3-SE mark (``studies.lib.stats``), and the FP8 FLOP share:
the share of the training GEMM FLOPs (forward and both backward GEMMs, which have the same
FLOPs as their forward GEMM) run in FP8, counted per GEMM from the shapes the policy runs and
the steps it spent in FP8. The autopilot's decisions (step, GEMM, statistic, value) are
listed per seed.

Every run checkpoints every ``--checkpoint-every`` steps (its parameters, optimizer and
autopilot state, losses and decisions); ``--resume`` continues an interrupted study from
them, with the same results bit for bit.

    fmtkit study autopilot [--magnitude 1e5] [--seeds 3] [--steps 100] [--underflow-share 0.05]
                           [--checkpoint-every 25] [--resume CHECKPOINT_FOLDER]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fmtkit
import fmtkit.debug as debug
from fmtkit.policy import intercept_gemms
from studies.lib import regimes, stats
from studies.lib.common import figure, format_table, no_progress, plot_style, save
from studies.lib.models import TransformerLM, lm_loss
from studies.training import checkpoint
from studies.training import fp8_training as ft
from studies.training.config import TrainConfig
from studies.training.data import batch_at, load_data
from studies.training.metrics import final_loss
from studies.training.optimizer import make_optimizer
from studies.training.setups import get_setup
from studies.training.step import init_params

# How the command line lists this study (studies.app.registry).
NAME = "autopilot"
SUMMARY = "the precision autopilot vs all-FP8 and all-BF16 as a large outlier emerges"
ORDER = 150

__all__ = ["ARMS", "Config", "gemm_flops", "plot", "run", "summarize"]

ARMS = ("bf16-mixed", "fp8-current", "autopilot")
"""The arms: the reference, all-FP8, and all-FP8 under the autopilot."""

QUANTIZED_SETTINGS = ("current", "blockwise")
"""The ladder settings under which a moved GEMM still runs in FP8."""

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``autopilot`` study.

    Attributes:
      magnitude: the outlier channel's final magnitude (>= 1).
      ramp_start: the step the outlier starts to grow (before it: magnitude 1).
      ramp_steps: steps over which it grows geometrically to ``magnitude`` (0: at once).
      underflow_share: the autopilot's underflow-share threshold, in [0, 1].
      patience: consecutive logged steps above it that move a GEMM (>= 1).
      freq: the autopilot reads the statistics every ``freq`` steps (>= 1).
      tensors: the operands it watches, from activation, weight, output_grad.
      ladder: the settings a moved GEMM climbs (``fmtkit.debug.Autopilot.ladder``). The
        study's is ``("compute",)``, not the autopilot's default ``("blockwise",
        "compute")``: each row's 1x128 tile that holds the outlier channel still flushes
        its other entries, so finer scaling would only delay the move by ``patience``
        logged steps.
      d_model: the model's width (a multiple of 128, at least 256, as in outlier-dose).
      checkpoint_dir: with ``train.checkpoint_every > 0`` every run (arm and seed) saves
        its state (parameters, optimizer and autopilot state, the losses and decisions so
        far) under CHECKPOINT_DIR/<timestamp>/<arm>/seed<k>/ every that many steps and at
        its end.
      resume: an earlier run's checkpoint folder (CHECKPOINT_DIR/<timestamp>): every run
        continues from its latest checkpoint (a finished one is read back, one without a
        checkpoint starts afresh), and the results equal an uninterrupted run's bit for bit.
      train: the training settings (steps, batch, seq_len, lr, seeds, data,
        checkpoint_every).
    """

    magnitude: float = 1e5
    ramp_start: int = 20
    ramp_steps: int = 20
    underflow_share: float = 0.05
    patience: int = 2
    freq: int = 5
    tensors: tuple[str, ...] = ("activation",)
    ladder: tuple[str, ...] = ("compute",)
    d_model: int = 256
    checkpoint_dir: str = "runs/autopilot-checkpoints"
    resume: str | None = None
    train: TrainConfig = TrainConfig(steps=100, seeds=3, checkpoint_every=25)

    def __post_init__(self):
        ft.check_magnitudes((self.magnitude,))
        ft.Ramp(self.ramp_start, self.ramp_steps)
        if isinstance(self.d_model, bool) or not isinstance(self.d_model, int) or \
                self.d_model < 256 or self.d_model % 128:
            raise ValueError(f"d_model must be a multiple of 128 and >= 256, got "
                             f"{self.d_model!r}.")
        self.autopilot()  # validates the thresholds, patience, freq and tensors
        if self.resume is not None and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume!r}: no such folder (give the checkpoint "
                             "folder of an earlier autopilot run).")

    def autopilot(self) -> debug.Autopilot:
        """The study's ``Autopilot``."""
        return debug.Autopilot(underflow_share=self.underflow_share, patience=self.patience,
                               freq=self.freq, tensors=self.tensors, ladder=self.ladder)

    def train_config(self) -> TrainConfig:
        """``train`` on ``wide_model(seq_len, d_model)``."""
        return ft.replace_model(self.train, ft.wide_model(self.train.seq_len, self.d_model,
                                                          2 * self.d_model))


def gemm_flops(model: Any, variables: Any, tokens: jax.Array) -> dict[str, tuple[float, bool]]:
    """``{f"{module_path}/{gemm}": (forward FLOPs, runs in FP8)}`` of every GEMM the policied
    ``model`` runs on ``tokens`` (traced abstractly): 2 x output size x contraction size
    (for a grouped GEMM the contraction of one row with its group's matrix)."""
    out: dict[str, tuple[float, bool]] = {}

    def hook(site, run, lhs, rhs):
        y = run(lhs, rhs, site.fp8)
        if site.primitive == "ragged_dot_general":  # each row meets one group's matrix
            k = lhs.shape[-1]
        elif site.dimension_numbers is None:
            raise ValueError(f"GEMM {site.path!r}/{site.name}: the autopilot study counts "
                             "matmul FLOPs only (no convolutions).")
        else:
            (lc, _), _ = site.dimension_numbers
            k = math.prod(lhs.shape[d] for d in lc)
        out[f"{site.path}/{site.name}"] = (2.0 * math.prod(y.shape) * k, site.fp8 is not None)
        return y

    with intercept_gemms(hook):
        jax.eval_shape(model.apply, variables, tokens)
    return out


class _RunState(NamedTuple):
    """What a checkpoint of one run holds as arrays (``studies.training.checkpoint``)."""

    params: Any
    opt_state: Any
    step: jax.Array  # steps done = the index of the next batch


def _record(arm: str, seed: int, config: Config) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed: the arm, the seed and the study's
    configuration (less where checkpoints go and how often)."""
    c = dataclasses.asdict(config)
    for k in ("checkpoint_dir", "resume"):
        c.pop(k)
    c["train"].pop("checkpoint_every")
    return {"setup": f"autopilot study, arm {arm}, seed {seed}",
            "config": json.loads(json.dumps(c, default=str))}


def _encode(state: debug.AutopilotState | None) -> dict | None:
    """An ``AutopilotState`` as JSON: integers as they are, the float32 values by their bit
    patterns (exact, NaN included)."""
    if state is None:
        return None
    return {f: {k: np.asarray(v).view(np.int32).tolist() if f == "value" else
                np.asarray(v).tolist() for k, v in part.items()}
            for f, part in zip(debug.AutopilotState._fields, state)}


def _decode(data: dict, template: debug.AutopilotState) -> debug.AutopilotState:
    """``_encode``'s inverse, into the keys, shapes and dtypes of ``template``."""
    parts = []
    for f, part in zip(debug.AutopilotState._fields, template):
        if set(data[f]) != set(part):
            raise ValueError(f"the checkpoint's autopilot state watches {sorted(data[f])}, "
                             f"this run {sorted(part)}.")
        parts.append({k: (np.asarray(data[f][k], np.int32).view(np.float32) if f == "value"
                          else np.asarray(data[f][k], v.dtype)).reshape(v.shape)
                      for k, v in part.items()})
    return debug.AutopilotState(*parts)


def _train_run(arm: str, cfg: TrainConfig, config: Config, seed: int, data: np.ndarray,
               progress=no_progress, run_dir: Path | None = None, resume: bool = False
               ) -> dict[str, Any]:
    """Trains one arm for one seed; returns its losses, decisions and FP8 FLOP share. With
    ``run_dir`` it checkpoints there every ``cfg.checkpoint_every`` steps and at the end;
    ``resume`` continues from the latest checkpoint there (if any)."""
    setup = get_setup("bf16-mixed" if arm == "bf16-mixed" else "fp8-current")
    mcfg = cfg.model_config()
    d = mcfg.d_model
    ch = ft.outlier_channel(d)
    ramp = ft.Ramp(config.ramp_start, config.ramp_steps)
    model = fmtkit.with_policy(TransformerLM(mcfg), setup.rules())
    scfg = cfg.with_seed(seed)
    opt = make_optimizer(setup, scfg)
    dummy = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(seed), dummy)["params"]
    mask = regimes.OutlierFeatures().reader_mask(shapes, d)
    params = jax.tree.map(lambda x, m, s: (x * m).astype(s.dtype), init_params(scfg), mask,
                          shapes)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = opt.init(params)

    def loss_of(p, tokens, mag):
        logits = model.apply({"params": ft.with_outlier(p, mag, ch, d)}, tokens)
        return lm_loss(logits.astype(F32), tokens)

    @functools.partial(jax.jit, static_argnums=0)
    def step(dcfg, p, o, stats_state, tokens, i):
        mag = ft.ramp_magnitude(config.magnitude, i, ramp)
        if dcfg is None:
            loss, g = jax.value_and_grad(loss_of)(p, tokens, mag)
            st = None
        else:
            def f(p, s):
                with debug.capture(dcfg, s, i):
                    return loss_of(p, tokens, mag)

            loss, (g, st) = jax.value_and_grad(f, argnums=(0, 1))(p, stats_state)
        g = jax.tree.map(lambda x, m: x * m.astype(x.dtype), g, mask)
        with jax.numpy_dtype_promotion("standard"):
            updates, o = opt.update(g, o, p)
            p = optax.apply_updates(p, updates)
        return p, o, loss, st

    ap = config.autopilot() if arm == "autopilot" else None
    flops = gemm_flops(model, {"params": params}, dummy)
    apstate = None
    if ap is not None:
        probe = functools.partial(loss_of, tokens=dummy, mag=jnp.asarray(1.0, F32))
        apstate = ap.init(debug.init(ap.config(), probe, params))
    losses, decisions, configs = [], [], {}
    # Compilations: one per distinct debug configuration the steps run (the step is jitted
    # with it as a static argument): the first, and one after each step with a decision (a
    # rung only climbs, so every decision makes a new one) but the last step.
    compilations = 1
    start, mngr = 0, None
    record = _record(arm, seed, config)
    if run_dir is not None and (cfg.checkpoint_every > 0 or resume):
        mngr = checkpoint.open_manager(run_dir)
        if resume and mngr.latest_step() is not None:
            state, hist = checkpoint.restore(
                mngr, _RunState(params, opt_state, jnp.int32(0)), record)
            params, opt_state, start = state.params, state.opt_state, int(state.step)
            losses, decisions = hist["losses"], hist["decisions"]
            compilations = hist["compilations"]
            if ap is not None:
                apstate = _decode(hist["autopilot"], apstate)

    def save(i: int) -> None:
        hist = {"losses": losses, "decisions": decisions, "compilations": compilations,
                "autopilot": _encode(apstate)}
        checkpoint.save(mngr, _RunState(params, opt_state, jnp.int32(i)), hist, record)

    for i in progress(range(start, cfg.steps), total=cfg.steps - start,
                      desc=f"{arm} seed {seed}"):
        tokens = jnp.asarray(batch_at(data, scfg, i))
        dcfg = None if ap is None else ap.config(apstate)
        if dcfg is not None and dcfg not in configs:
            configs[dcfg] = debug.init(dcfg, probe, params)
        params, opt_state, loss, st = step(dcfg, params, opt_state, configs.get(dcfg),
                                           tokens, jnp.int32(i))
        losses.append(float(loss))
        if ap is not None and i >= ap.start_step and (i - ap.start_step) % ap.freq == 0:
            apstate, dec = ap.update(apstate, st, i)
            decisions += [dataclasses.asdict(x) for x in dec]
            if dec and i + 1 < cfg.steps:
                compilations += 1
        if mngr is not None and cfg.checkpoint_every > 0 and (i + 1) % cfg.checkpoint_every \
                == 0 and i + 1 < cfg.steps:
            save(i + 1)
    if mngr is not None:
        if cfg.checkpoint_every > 0 and mngr.latest_step() != cfg.steps:
            save(cfg.steps)
        mngr.close()
    # FP8 FLOP share: per GEMM, its FLOPs times the steps it ran in FP8 (until its move to a
    # setting that runs the GEMM in the compute dtype: "compute", "fake_quant:...").
    moved = {f"{x['module']}/{x['gemm']}": x["step"] for x in decisions
             if x["setting"] not in QUANTIZED_SETTINGS}
    total = sum(f for f, _ in flops.values()) * cfg.steps
    fp8 = sum(f * (moved[k] + 1 if k in moved else cfg.steps)
              for k, (f, q) in flops.items() if q)
    return {"arm": arm, "seed": seed, "losses": losses, "final_loss": final_loss(losses),
            "decisions": decisions, "fp8_flop_share": fp8 / total,
            "compilations": compilations}


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains the three arms for every seed.

    Returns:
      ``{"seeds", "arms": {arm: [per-seed run]}, "gaps": {arm: paired gap to bf16-mixed},
      "fp8_flop_share": {arm: mean over seeds}, "model", "train", "autopilot",
      "checkpoint_dir", "wall_seconds"}``; a run: ``{"seed", "losses", "final_loss", "decisions",
      "fp8_flop_share", "compilations"}``.
    """
    t0 = time.perf_counter()
    cfg = config.train_config()
    data = load_data(cfg)
    seeds = list(ft.seeds_of(cfg))
    root = Path(config.resume) if config.resume else (
        Path(config.checkpoint_dir) / time.strftime("%Y%m%d-%H%M%S")
        if cfg.checkpoint_every > 0 else None)
    arms = {a: [_train_run(a, cfg, config, s, data, progress,
                           run_dir=None if root is None else root / a / f"seed{s}",
                           resume=config.resume is not None) for s in seeds] for a in ARMS}
    ref = [r["final_loss"] for r in arms["bf16-mixed"]]
    gaps = {a: stats.compare(ref, [r["final_loss"] for r in arms[a]], paired=True).to_dict()
            for a in ARMS[1:]}
    mcfg = cfg.model_config()
    return {
        "seeds": seeds, "arms": arms, "gaps": gaps,
        "fp8_flop_share": {a: float(np.mean([r["fp8_flop_share"] for r in arms[a]]))
                           for a in ARMS},
        "magnitude": config.magnitude, "ramp": [config.ramp_start, config.ramp_steps],
        "model": {"d_model": mcfg.d_model, "num_layers": mcfg.num_layers, "d_ff": mcfg.d_ff},
        "train": {"steps": cfg.steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
                  "lr": cfg.lr},
        "autopilot": {"underflow_share": config.underflow_share,
                      "patience": config.patience, "freq": config.freq,
                      "tensors": list(config.tensors), "ladder": list(config.ladder)},
        "checkpoint_dir": None if root is None else str(root),
        "wall_seconds": time.perf_counter() - t0,
    }


def summarize(results: dict[str, Any]) -> str:
    """Final loss, paired gap to bf16-mixed and FP8 FLOP share per arm; the decisions."""
    rows = []
    for a in ARMS:
        fl = [r["final_loss"] for r in results["arms"][a]]
        gap = ("-" if a not in results["gaps"] else
               stats.format_gap(stats.Gap.from_dict(results["gaps"][a])))
        rows.append([a, stats.format_mean_std(fl), gap,
                     f"{100 * results['fp8_flop_share'][a]:.1f}%"])
    t, m = results["train"], results["model"]
    out = [format_table(
        ["arm", "final loss", "gap to bf16-mixed", "FP8 FLOP share"], rows,
        title=(f"autopilot vs all-FP8 (fp8-current) vs all-BF16, outlier {results['magnitude']:g}"
               f" (ramp from step {results['ramp'][0]} over {results['ramp'][1]}), d_model "
               f"{m['d_model']}, {t['steps']} steps of {t['batch']}x{t['seq_len']}, seeds "
               f"{results['seeds']}, paired"))]
    for r in results["arms"]["autopilot"]:
        moves = ", ".join(f"{d['module']}/{d['gemm']} to {d['setting']} at {d['step']} "
                          f"({d['tensor']} {d['stat']} {d['value']:.3f})"
                          for d in r["decisions"])
        out.append(f"seed {r['seed']}: {len(r['decisions'])} decision(s), "
                   f"{r['compilations']} compilation(s): {moves or '-'}")
    out.append(stats.PAIRED_NOTE)
    return "\n".join(out)


def plot(results: dict[str, Any], out_dir) -> list:
    """``autopilot.png``: the loss curves of the arms, mean ± std over seeds."""
    with plot_style():
        fig, ax = figure()
        for a in ARMS:
            runs = [r["losses"] for r in results["arms"][a]]
            stats.band(ax, np.arange(len(runs[0])), runs, label=a)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend()
        return [save(fig, out_dir, "autopilot")]
