"""Study ``ablate`` (the main job): a small transformer LM under each precision setup.

Trains ``studies.models.TransformerLM`` (byte level) on the embedded corpus (or ``--data``)
once per setup of ``studies.train.SETUPS`` (fp32, bf16-mixed, pure-bf16 with plain /
stochastically rounded / Kahan updates, bf16 with f32 master weights, fp16 without and with
dynamic loss scaling, the five FP8 recipes), from the same initial parameters and on the same
batches, and reports per setup:

* final loss: mean training loss (nats/byte) of the last 10% of the steps; gap to fp32 in %;
  gap to the corpus's entropy rate (the irreducible loss; embedded corpus only);
* skipped steps (dynamic loss scaling), the mean fraction of gradient values that flush to
  zero in the setup's gradient format (``studies.train`` defines it), the mean fraction of
  parameters an update changes;
* compile time and steady-state step time (ms), bytes per parameter of params + gradients +
  optimizer state + master copy (``fmtkit.memory.ledger`` of the real state);
* the loss curves of all setups in one PNG (``loss_curves.png``).

A setup expected to diverge (fp16 without loss scaling) is marked "diverged" instead of
stopping the study; any other non-finite loss stops it with an error (exit 1).

    fmtkit ablate [--steps N] [--policies fp32,bf16-mixed,...] [--model-size tiny|small|base]
                  [--data FILE] [--checkpoint-every K] [--resume RUN_OR_CHECKPOINT_DIR]

(the training options are those of ``studies.train.TrainConfig``, nested as ``Config.train``).

Checkpoints (``--checkpoint-every K``): the full train state of each setup goes to
``CHECKPOINT_DIR/<timestamp>/<setup>/checkpoints/<step>/`` (orbax); ``--resume`` with that
folder, or with the earlier run's results folder (its results.json names the checkpoint
folder), continues every setup from its latest checkpoint with the same options, and ends
bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from studies import corpus
from studies._common import figure, format_table, no_progress, plot_style, save
from studies.train import DEFAULT_SETUPS, SETUPS, TrainConfig, init_params, load_data, train

__all__ = ["Config", "main", "plot", "run", "summarize"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the ``ablate`` study.

    Attributes:
      policies: the setups to train (comma- or space-separated), in table order; see
        studies.train.SETUPS. Default: all of them.
      checkpoint_dir: checkpoints go to CHECKPOINT_DIR/<timestamp>/<setup>/.
      resume: continue an earlier run: its checkpoint folder, or its results folder.
      train: the training settings of every setup (model size, steps, batch, lr, data,
        checkpoints, data parallelism).
    """

    policies: tuple[str, ...] = DEFAULT_SETUPS
    checkpoint_dir: str = "runs/ablate-checkpoints"
    resume: str | None = None
    train: TrainConfig = TrainConfig(steps=150)

    def __post_init__(self):
        if isinstance(self.policies, str):
            object.__setattr__(self, "policies", (self.policies,))
        if not isinstance(self.policies, tuple):
            raise TypeError(f"policies must be a tuple of setup names, got "
                            f"{type(self.policies).__name__}.")
        # "fp32,bf16-mixed" and "fp32 bf16-mixed" (one name per argument) both work.
        object.__setattr__(self, "policies", tuple(
            p.strip() for item in self.policies for p in item.split(",") if p.strip()))
        if not self.policies:
            raise ValueError(f"policies must name at least one setup; valid: "
                             f"{', '.join(SETUPS)}.")
        unknown = [p for p in self.policies if p not in SETUPS]
        if unknown:
            raise ValueError(f"unknown policies {', '.join(map(repr, unknown))}; valid: "
                             f"{', '.join(SETUPS)}.")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies lists a setup twice: {', '.join(self.policies)}.")
        if not isinstance(self.train, TrainConfig):
            raise TypeError(f"train must be a studies.train.TrainConfig, got "
                            f"{type(self.train).__name__}.")
        if self.train.data is not None:
            p = Path(self.train.data)
            if not p.exists():
                raise ValueError(f"--data {self.train.data!r}: no such file.")
            if not p.is_file():
                raise ValueError(f"--data {self.train.data!r} is not a file; give a UTF-8 "
                                 "text file.")
            if p.stat().st_size == 0:
                raise ValueError(f"--data {self.train.data!r} is empty; give a non-empty "
                                 "UTF-8 text file.")
        if self.resume is not None and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume!r}: no such folder (give the checkpoint "
                             "folder or the results folder of an earlier ablate run).")


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
    if config.train.checkpoint_every > 0:
        return Path(config.checkpoint_dir) / time.strftime("%Y%m%d-%H%M%S")
    return None


def _pct(a: float, b: float) -> float | None:
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return None
    return 100.0 * (a - b) / b


def run(config: Config, progress=no_progress) -> dict[str, Any]:
    """Trains every setup of ``config.policies`` and returns the table and the curves.

    Writes nothing but checkpoints (when asked for). Returns a dict with ``rows`` (one per
    setup: the numbers of ``studies.train.TrainResult.summary`` plus ``gap_to_fp32_pct`` and
    ``gap_to_floor_nats``), ``entropy_floor_nats`` (None with ``--data``), ``train_config``,
    ``checkpoint_dir`` and ``descriptions``.
    """
    cfg = config.train
    data = load_data(cfg)  # once for all setups
    params = init_params(cfg)  # every setup starts from these f32 parameters
    root = _checkpoint_root(config)
    floor = corpus.entropy_rate_nats() if cfg.data is None else None
    rows = []
    for name in config.policies:
        result = train(name, cfg, progress,
                       run_dir=None if root is None else root / name,
                       resume=config.resume is not None, data=data, params=params)
        rows.append(result.summary())
    ref = next((r["final_loss"] for r in rows if r["setup"] == "fp32"), None)
    for r in rows:
        r["gap_to_fp32_pct"] = None if ref is None else _pct(r["final_loss"], ref)
        r["gap_to_floor_nats"] = (None if floor is None or not math.isfinite(r["final_loss"])
                                  else r["final_loss"] - floor)
    return {
        "train_config": cfg,
        "entropy_floor_nats": floor,
        "checkpoint_dir": None if root is None else str(root),
        "descriptions": {name: SETUPS[name].description for name in config.policies},
        "rows": rows,
    }


def _f(v: Any, fmt: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, fmt)


def summarize(results: dict[str, Any]) -> str:
    """The table printed by ``fmtkit ablate``."""
    floor = results.get("entropy_floor_nats")
    header = ["setup", "final loss", "vs fp32", "vs floor", "skipped", "grad flush",
              "params moved", "compile s", "step ms", "bytes/param"]
    rows = []
    for r in results["rows"]:
        loss = ("diverged@" + str(r["diverged_at"]) if r["diverged_at"] is not None
                else _f(r["final_loss"], ".4f"))
        gap = r["gap_to_fp32_pct"]
        rows.append([
            r["setup"], loss, "-" if gap is None else f"{gap:+.2f}%",
            _f(r["gap_to_floor_nats"], "+.4f"), str(r["skipped_steps"]),
            f"{100 * r['grad_flush']:.3g}%", f"{100 * r['update_frac']:.1f}%",
            _f(r["compile_seconds"], ".1f"), _f(r["step_ms"], ".1f"),
            _f(r["bytes_per_param"], ".1f")])
    cfg = results["train_config"]
    c = cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg)
    title = (f"ablate: {c['model_size']} model, {c['steps']} steps of {c['batch']}x"
             f"{c['seq_len']} bytes, lr {c['lr']}, seed {c['seed']}")
    notes = [
        "final loss: mean training cross entropy (nats/byte) over the last 10% of the steps; "
        "vs fp32: relative gap.",
        ("vs floor: final loss minus the corpus entropy rate "
         f"{floor:.4f} nats/byte (the best any model can do)." if floor is not None else
         "vs floor: unknown for --data (no known entropy rate)."),
        "grad flush: mean share of nonzero gradient values (as the optimizer receives them, "
        "scaled if the loss is) that round to 0 in the setup's gradient format.",
        "params moved: mean share of parameter elements an update changes.",
    ]
    return "\n".join([format_table(header, rows, title=title), "", *notes])


def plot(results: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """``loss_curves.png``: the loss of every setup per step (left) and its gap to fp32
    (right, moving average over 10 steps)."""
    import matplotlib

    rows = results["rows"]
    cmap = matplotlib.colormaps["tab20"]
    floor = results.get("entropy_floor_nats")
    ref = next((np.asarray(r["history"]["loss"], np.float64) for r in rows
                if r["setup"] == "fp32"), None)
    with plot_style():
        fig, (ax, ax2) = figure(1, 2, width=12.0, height=4.6)
        for i, r in enumerate(rows):
            loss = np.asarray(r["history"]["loss"], np.float64)
            color = cmap(i % 20)
            style = "--" if i >= 10 else "-"
            label = r["setup"] + (" (diverged)" if r["diverged_at"] is not None else "")
            ax.plot(np.arange(loss.size), loss, style, color=color, label=label, lw=1.2)
            if ref is not None and r["setup"] != "fp32":
                n = min(loss.size, ref.size)
                gap = 100.0 * (loss[:n] - ref[:n]) / ref[:n]
                k = min(10, max(n, 1))
                smooth = np.convolve(gap, np.ones(k) / k, mode="valid") if n else gap
                ax2.plot(np.arange(smooth.size) + k - 1, smooth, style, color=color, lw=1.2,
                         label=r["setup"])
        if floor is not None:
            ax.axhline(floor, color="k", lw=0.8, ls=":", label=f"entropy floor {floor:.3f}")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats/byte)")
        ax.set_title("loss curves")
        ax.legend(fontsize=7, ncol=2)
        ax2.axhline(0.0, color="k", lw=0.8)
        ax2.set_xlabel("step")
        ax2.set_ylabel("loss gap to fp32 (%), 10-step mean")
        ax2.set_title("gap to fp32" if ref is not None else "gap to fp32 (no fp32 run)")
        return [save(fig, out_dir, "loss_curves")]


def main(argv: list[str] | None = None) -> int:
    """``fmtkit ablate [options]``: ``fmtkit study ablate [options]``; returns the exit code."""
    import sys

    from studies.runner import main as runner_main

    argv = list(sys.argv[1:] if argv is None else argv)
    return runner_main(["ablate", *argv])


if __name__ == "__main__":
    raise SystemExit(main())
