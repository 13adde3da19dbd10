"""Several seeds of one setup in one compiled step, and the late-training start.

``train_seeds(setup, cfg)`` trains the seeds ``cfg.seed_list`` of one setup together: the
per-seed train states (each from its own ``make_train_step(setup, cfg.with_seed(s))``
init: own initial parameters, stochastic-rounding seed and regime key, all in the state) are
stacked on a leading axis and stepped by ``jax.jit(jax.vmap(step))`` (``studies.seeds``),
one compile for all seeds. Seed ``s`` sees the batches ``batch_at(data, cfg.with_seed(s),
k)``. Nothing seed-dependent is a constant of the step: the stochastic-rounding seed lives
in the optimizer state (``fmtkit.optim.StochasticRoundUpdatesState.seed``), the regime's
token positions come from ``TrainState.rng``, so the vmapped seeds have independent
streams (tested against separate single-seed runs).

Data-parallel (``cfg.data_parallel > 1``, or several processes under ``jax.distributed``):
the stacked state is replicated over the mesh (``studies.training.mesh``) and each seed's
batch split along its rows (stacked batches ``[seeds, batch, seq_len]`` sharded as
``PartitionSpec(None, "data")``); each process supplies its rows of every seed's batch.
Still one compile; the seeds' results equal a single-process run over as many devices.

Divergence: a seed's run is marked diverged at its first non-finite loss (``may_diverge``
setups; any other setup raises ``StudyError``); its history stops there, while the other
seeds go on (the run stops once every seed has diverged). Checkpoints hold the stacked
state and every seed's history (``studies.training.checkpoint``); a resumed run ends
bit-identical to an uninterrupted one (tested).

Late training (``cfg.regime == "late-training"``, ``late_training``): each seed is first
trained in fp32 for ``cfg.steps`` steps with the normal schedule (warmup + cosine), then
every setup continues from those parameters, with fresh optimizer state, on the batches
that follow (steps ``cfg.steps`` .. ``2 cfg.steps - 1``) for ``cfg.steps`` steps at a
constant learning rate calibrated so that fresh Adam's first update has an update-to-weight
ratio of ``studies.regimes.LateTraining().update_to_weight`` (3e-4) over the weight
matrices (the median over seeds of ``LateTraining.lr``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmtkit.memory import ledger
from studies import regimes
from studies import seeds as seeds_lib
from studies._common import Progress, StudyError, no_progress
from studies.models import lm_loss
from studies.training import checkpoint, mesh
from studies.training.config import TrainConfig
from studies.training.data import batch_at, heldout_tokens, load_data
from studies.training.metrics import METRIC_KEYS
from studies.training.optimizer import make_optimizer
from studies.training.setups import Setup, get_setup
from studies.training.step import build_model, init_params, make_train_step

__all__ = ["SeedsResult", "final_loss", "late_training", "seed_curves", "seed_params",
           "stack_batches", "train_seeds"]

F32 = jnp.float32


def final_loss(losses: list[float]) -> float:
    """Mean of the last ``max(1, len // 10)`` losses (nan for an empty list)."""
    if not losses:
        return float("nan")
    k = max(1, len(losses) // 10)
    return float(np.mean(losses[-k:]))


@dataclasses.dataclass
class SeedsResult:
    """What ``train_seeds`` returns.

    Attributes:
      setup: the setup's name.
      seeds: the seeds, in order.
      histories: per seed, the per-step metric lists (``METRIC_KEYS``).
      diverged_at: per seed, the step of its first non-finite loss (None: finite).
      compile_seconds: trace + compile of the vmapped step.
      step_ms: median wall time of one vmapped step (all seeds) after the first (ms).
      bytes_per_param: ``fmtkit.memory.ledger`` of one seed's state.
      memory: that ledger as a dict.
      resumed_from: the checkpoint step a resumed run started from (None: from scratch).
      heldout_loss: per seed, the held-out loss (nats/byte) at the end (None: no held-out
        text).
      state: the final stacked ``TrainState`` (leading seeds axis).
      snapshots: step -> the first seed's parameters after that many steps, for the steps
        ``train_seeds`` was asked to keep (``snapshot_steps``; empty by default).
      snapshot_grads: step -> the first seed's parameter gradient on ``grad_batch`` at
        ``snapshots[step]``, from the training step's own compile (empty without
        ``grad_batch``).
    """

    setup: str
    seeds: tuple[int, ...]
    histories: list[dict[str, list[float]]]
    diverged_at: list[int | None]
    compile_seconds: float
    step_ms: float
    bytes_per_param: float
    memory: dict[str, Any]
    resumed_from: int | None
    heldout_loss: list[float] | None
    state: Any
    snapshots: dict[int, Any] = dataclasses.field(default_factory=dict)
    snapshot_grads: dict[int, Any] = dataclasses.field(default_factory=dict)

    @property
    def final_losses(self) -> list[float]:
        """Per seed: mean loss of its last 10% of steps (nan if it diverged)."""
        return [float("nan") if d is not None else final_loss(h["loss"])
                for h, d in zip(self.histories, self.diverged_at)]

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers, every seed's included (no state)."""
        per_seed = []
        for i, (s, h, d) in enumerate(zip(self.seeds, self.histories, self.diverged_at)):
            per_seed.append({
                "seed": s, "final_loss": self.final_losses[i], "diverged_at": d,
                "steps_done": len(h["loss"]),
                "skipped_steps": int(np.sum(h["skipped"])),
                "grad_flush": float(np.mean(h["grad_flush"])) if h["grad_flush"] else 0.0,
                "update_frac": float(np.mean(h["update_frac"])) if h["update_frac"] else 0.0,
                "update_ratio": (float(np.median(h["update_ratio"])) if h["update_ratio"]
                                 else 0.0),
                "final_loss_scale": h["loss_scale"][-1] if h["loss_scale"] else None,
                "heldout_loss": None if self.heldout_loss is None else self.heldout_loss[i],
                "history": h,
            })
        return {"setup": self.setup, "seeds": list(self.seeds),
                "final_loss": self.final_losses, "per_seed": per_seed,
                "compile_seconds": self.compile_seconds, "step_ms": self.step_ms,
                "bytes_per_param": self.bytes_per_param, "memory": self.memory,
                "resumed_from": self.resumed_from}


def seed_params(cfg: TrainConfig) -> list[Any]:
    """Each seed's f32 initial parameters (``init_params(cfg.with_seed(s))``)."""
    return [init_params(cfg.with_seed(s)) for s in cfg.seed_list]


def seed_curves(summaries: list[dict[str, Any]], key: str = "loss"
                ) -> dict[str, list[list[float]]]:
    """Setup -> each seed's per-step ``key`` curve, cut to the shortest seed's length (a
    diverged seed stops early), from ``SeedsResult.summary`` dicts; setups with an empty
    curve are left out. What ``studies.stats.plot_seed_bands`` draws."""
    curves = {}
    for row in summaries:
        hs = [p["history"][key] for p in row["per_seed"]]
        n = min(len(h) for h in hs)
        if n:
            curves[row["setup"]] = [h[:n] for h in hs]
    return curves


def stack_batches(data: np.ndarray, cfg: TrainConfig, step: int) -> jax.Array:
    """Every seed's batch of ``step``, ``[seeds, batch, seq_len]``, each seed's rows split
    over the mesh (``studies.training.mesh``) when there is one."""
    if cfg.regime == "late-training":  # after the pretraining's batches
        step += cfg.steps
    return mesh.put_batch(np.stack([batch_at(data, cfg.with_seed(s), step)
                                    for s in cfg.seed_list]), cfg.data_parallel,
                          seeds_axis=True)


def train_seeds(setup: Setup | str, cfg: TrainConfig, progress: Progress = no_progress,
                run_dir: str | Path | None = None, resume: bool = False, *,
                data: np.ndarray | None = None, params: list[Any] | None = None,
                snapshot_steps: tuple[int, ...] = (),
                grad_batch: np.ndarray | None = None) -> SeedsResult:
    """Trains ``cfg.seeds`` seeds of one setup with one vmapped step (module docstring).

    Args:
      setup: a ``Setup`` or a registered name.
      cfg: the training configuration (``seed_list`` gives the seeds).
      progress: progress-bar factory.
      run_dir: folder of this run's checkpoints (None: none).
      resume: continue from the latest checkpoint in ``run_dir``.
      data: the training bytes (``load_data(cfg)`` if None).
      params: per seed, the f32 initial parameters (``seed_params(cfg)`` if None).
      snapshot_steps: step counts after which the first seed's parameters are kept
        (``SeedsResult.snapshots``; 0: the initial ones, also when resumed; other steps
        before a resumed run's start are not kept): telemetry over training, read without
        changing it (a copy to the host, nothing recomputed).
      grad_batch: one batch ``[batch, seq_len]``: at each of ``snapshot_steps`` the
        compiled training step also runs on it (every seed), and the first seed's gradient
        is kept (``SeedsResult.snapshot_grads``) while its new state is dropped: the
        setup's gradient at those parameters without a compile of its own, and the
        training unchanged.

    Raises:
      StudyError: non-finite loss in a setup not expected to diverge.
      ValueError: ``resume`` without ``run_dir``, ``params`` of the wrong length, a
        checkpoint of another run; ``cfg.data_parallel`` that the devices (of every
        process) do not match (``studies.training.mesh``).
    """
    setup = get_setup(setup)
    if resume and run_dir is None:
        raise ValueError("resume=True needs run_dir (the folder holding the checkpoints).")
    seeds = cfg.seed_list
    if params is None:
        params = seed_params(cfg)
    if len(params) != len(seeds):
        raise ValueError(f"params must hold one tree per seed ({len(seeds)}), got "
                         f"{len(params)}.")
    if data is None:
        data = load_data(cfg)
    step_fn = None
    states = []
    for s, p in zip(seeds, params):
        init_fn, fn = make_train_step(setup, cfg.with_seed(s), params=p,
                                      with_grads=grad_batch is not None)
        step_fn = step_fn or fn
        states.append(init_fn())
    state = mesh.replicate(seeds_lib.stack(states), cfg.data_parallel)
    histories: list[dict[str, list[float]]] = [{k: [] for k in METRIC_KEYS} for _ in seeds]
    diverged_at: list[int | None] = [None] * len(seeds)
    record = checkpoint.config_record(setup, cfg)
    initial = state
    mngr, resumed_from = None, None
    if run_dir is not None and (cfg.checkpoint_every > 0 or resume):
        mngr = checkpoint.open_manager(run_dir)
        if resume and mngr.latest_step() is not None:
            state, saved = checkpoint.restore(mngr, state, record)
            histories, diverged_at = saved["per_seed"], saved["diverged_at"]
            resumed_from = int(state.step[0])

    if mesh.is_sharded(cfg.data_parallel):  # every seed data-parallel over the mesh
        vstep = seeds_lib.vmap_step(
            step_fn, state_sharding=mesh.state_sharding(cfg.data_parallel),
            batch_sharding=mesh.batch_sharding(cfg.data_parallel, seeds_axis=True))
    else:
        vstep = seeds_lib.vmap_step(step_fn)
    start = int(state.step[0])
    snapshots: dict[int, Any] = {}
    snapshot_grads: dict[int, Any] = {}
    compiled, compile_seconds = None, 0.0
    if start < cfg.steps or grad_batch is not None:
        t0 = time.perf_counter()
        compiled = vstep.lower(state, stack_batches(data, cfg, start)).compile()
        compile_seconds = time.perf_counter() - t0
    if grad_batch is not None:  # every seed's copy of it, laid out as its training batches
        grad_batches = mesh.put_batch(np.stack([np.asarray(grad_batch)] * len(seeds)),
                                      cfg.data_parallel, seeds_axis=True)

    def keep(step: int, at: Any) -> None:
        if step in snapshot_steps:
            snapshots[step] = jax.device_get(jax.tree.map(lambda x: x[0], at.params))
            if grad_batch is not None:
                grads = compiled(at, grad_batches)[1]["grads"]
                snapshot_grads[step] = jax.device_get(jax.tree.map(lambda x: x[0], grads))

    if start > 0:  # resumed: the initial parameters are known all the same
        keep(0, initial)
    keep(start, state)
    times: list[float] = []
    for i in progress(range(start, cfg.steps), total=cfg.steps - start, desc=setup.name):
        tokens = stack_batches(data, cfg, i)
        t = time.perf_counter()
        state, metrics = compiled(state, tokens)
        metrics.pop("grads", None)  # not needed on the host
        metrics = jax.device_get(metrics)
        if i > start:
            times.append(time.perf_counter() - t)
        keep(i + 1, state)
        for j in range(len(seeds)):
            if diverged_at[j] is not None:
                continue
            for k in METRIC_KEYS:
                histories[j][k].append(float(metrics[k][j]))
            loss = float(metrics["loss"][j])
            if not math.isfinite(loss):
                if not setup.may_diverge:
                    raise StudyError(
                        f"loss is {loss} at step {i} under setup {setup.name!r} "
                        f"({setup.description}), seed {seeds[j]}; a setup expected to train "
                        f"stably diverged. Try a lower --lr (now {cfg.lr}).")
                diverged_at[j] = i
        if all(d is not None for d in diverged_at):
            break
        if mngr is not None and cfg.checkpoint_every > 0 and (i + 1) % cfg.checkpoint_every \
                == 0 and i + 1 < cfg.steps:
            checkpoint.save(mngr, state, {"per_seed": histories, "diverged_at": diverged_at},
                            record)
    if mngr is not None and cfg.checkpoint_every > 0 and mngr.latest_step() != int(
            state.step[0]):
        checkpoint.save(mngr, state, {"per_seed": histories, "diverged_at": diverged_at},
                        record)
    if mngr is not None:
        mngr.close()

    heldout = heldout_loss(setup, cfg, state)
    with jax.numpy_dtype_promotion("standard"):
        mem = ledger(seeds_lib.unstack(state)[0].params, make_optimizer(setup, cfg))
    return SeedsResult(
        setup=setup.name, seeds=seeds, histories=histories, diverged_at=diverged_at,
        compile_seconds=compile_seconds,
        step_ms=float(np.median(times) * 1e3) if times else float("nan"),
        bytes_per_param=mem.bytes_per_param, memory=mem.as_dict(),
        resumed_from=resumed_from, heldout_loss=heldout, state=state, snapshots=snapshots,
        snapshot_grads=snapshot_grads)


def heldout_loss(setup: Setup | str, cfg: TrainConfig, state: Any) -> list[float] | None:
    """Per seed, the mean next-byte loss (nats/byte, f32) of the stacked ``state``'s model
    (the setup's policy) on ``heldout_tokens(cfg)``; None when there is no held-out text."""
    tokens = heldout_tokens(cfg)
    if tokens is None:
        return None
    model = build_model(get_setup(setup), cfg)

    def one(params, fp8_state, tokens):
        variables = {"params": params}
        if fp8_state:
            variables["fp8_state"] = fp8_state
        return lm_loss(model.apply(variables, tokens).astype(F32), tokens)

    losses = jax.jit(jax.vmap(one, in_axes=(0, 0, None)))(
        state.params, state.fp8_state, mesh.replicate(tokens, cfg.data_parallel))
    return [float(x) for x in np.asarray(losses)]


def late_training(cfg: TrainConfig, progress: Progress = no_progress, *,
                  data: np.ndarray | None = None
                  ) -> tuple[TrainConfig, list[Any], dict[str, Any]]:
    """The start of the late-training regime (module docstring).

    Args:
      cfg: a config with ``regime == "late-training"``; ``cfg.lr`` is the pretraining's
        peak learning rate.

    Returns:
      ``(late_cfg, params, info)``: the config of the late phase (``lr`` replaced by the
      calibrated constant), each seed's fp32-pretrained parameters, and ``info`` (the
      pretraining's final losses per seed, the calibrated lr per seed and the one used).
    """
    if cfg.regime != "late-training":
        raise ValueError(f"late_training needs cfg.regime='late-training', got "
                         f"{cfg.regime!r}.")
    if data is None:
        data = load_data(cfg)
    pre_cfg = dataclasses.replace(cfg, regime="none", checkpoint_every=0)
    pre = train_seeds("fp32", pre_cfg, progress, data=data)
    params = [s.params for s in seeds_lib.unstack(pre.state)]
    regime = regimes.LateTraining()
    lrs = []
    model = build_model(get_setup("fp32"), cfg)

    def loss(q, tokens):
        return lm_loss(model.apply({"params": q}, tokens), tokens)

    grad_fn = jax.jit(jax.grad(loss))  # one compile for every seed
    for s, p in zip(cfg.seed_list, params):
        tokens = mesh.replicate(batch_at(data, cfg.with_seed(s), cfg.steps),
                                cfg.data_parallel)
        grads = grad_fn(p, tokens)
        adam = optax.adam(1.0, b1=0.9, b2=0.95, eps=1e-8)
        with jax.numpy_dtype_promotion("standard"):  # optax's f32 lr times int32 counts
            direction, _ = adam.update(grads, adam.init(p), p)
        lrs.append(float(regime.lr(p, direction)))
    lr = float(np.median(lrs))
    info = {"pretrain_final_loss": pre.final_losses, "calibrated_lr_per_seed": lrs,
            "lr": lr, "update_to_weight_target": regime.update_to_weight,
            "pretrain_compile_seconds": pre.compile_seconds, "pretrain_step_ms": pre.step_ms}
    return dataclasses.replace(cfg, lr=lr), params, info
