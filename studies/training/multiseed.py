"""Several seeds of one setup in one compiled step, and the late-training start.

**The seeds axis** (any ``step_fn(state, batch) -> (state, metrics)`` without I/O, as
``make_train_step`` returns): error bars need several seeds per setup (``studies.lib.stats``);
running them one after the other costs one compile each, or one process each. Here the
seeds are a leading axis of the train state and of the batch, and the step is
``jax.jit(jax.vmap(step_fn))``: one compile serves every seed, and on a CPU or an
accelerator the seeds share each kernel launch.

* ``init_seeds(init_fn, seeds)``: ``init_fn(seed)`` for each seed (host-side, so it may use
  Python-level caches and ``PRNGKey(seed)`` as it does for one run), stacked on axis 0;
* ``vmap_step(step_fn)``: the jitted, vmapped step: ``(states[n], batches[n]) ->
  (states[n], metrics[n])``;
* ``run_seeds(init_fn, step_fn, batch_fn, seeds, steps)``: the loop; ``batch_fn(seed,
  step)`` gives each seed's own batch (e.g. the trainer's ``batch_at`` with that seed);
* ``stack`` / ``unstack``: between a list of per-seed pytrees and one stacked pytree (to
  save, resume or report each seed's state).

Semantics: seed i of the vmapped run computes what ``step_fn`` computes for seed i alone,
up to the reduction order XLA picks for batched and unbatched kernels (equal to f32 rounding,
tested; in low precision the batched kernels' different rounding grows over the steps).
``lax.cond`` inside the step (e.g. skipping a step on overflow) becomes a select under
``vmap``: both branches run, each seed keeps its own decision. Anything the step closes
over is shared by all seeds: a seed baked into the optimizer as a Python constant (e.g. a
stochastic-rounding key from the config) must live in the state instead, or the seeds share
its random stream. On a CPU a vmapped step of n seeds costs about n single-seed steps; the
saving is one compile per setup instead of one per seed (``make_train_step`` compiles per
config, seed included).

**Training seeds together**: ``train_seeds(setup, cfg)`` trains the seeds ``cfg.seed_list``
of one setup: the per-seed train states (each from its own ``make_train_step(setup,
cfg.with_seed(s))`` init: own initial parameters, stochastic-rounding seed and regime key,
all in the state) are stacked and stepped by ``vmap_step``, one compile for all seeds. Seed
``s`` sees the batches ``batch_at(data, cfg.with_seed(s), k)``. Nothing seed-dependent is a
constant of the step: the stochastic-rounding seed lives in the optimizer state
(``fmtkit.optim.StochasticRoundUpdatesState.seed``), the regime's token positions come from
``TrainState.rng``, so the vmapped seeds have independent streams (tested against separate
single-seed runs: equal to 2e-3 relative in loss over 6 steps).

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
ratio of ``studies.lib.regimes.LateTraining().update_to_weight`` (3e-4) over the weight
matrices (the median over seeds of ``LateTraining.lr``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmtkit.memory import ledger
from studies.lib import regimes
from studies.lib.common import Progress, StudyError, no_progress
from studies.lib.models import lm_loss
from studies.training import checkpoint, mesh
from studies.training.config import TrainConfig
from studies.training.data import batch_at, heldout_tokens, load_data
from studies.training.metrics import METRIC_KEYS, final_loss, history_summary
from studies.training.optimizer import make_optimizer
from studies.training.setups import Setup, get_setup
from studies.training.step import build_model, init_params, make_train_step

__all__ = ["SeedsResult", "init_seeds", "late_training", "run_seeds", "seed_curves",
           "seed_params", "stack", "stack_batches", "train_seeds", "unstack", "vmap_step"]

F32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# The seeds axis


def _check_seeds(seeds: Sequence[int]) -> list[int]:
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds must hold at least one seed.")
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"seeds must be ints >= 0, got {s!r}.")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct (a repeated seed is not an independent "
                         f"run), got {seeds}.")
    return [int(s) for s in seeds]


def stack(trees: Sequence[Any]) -> Any:
    """Per-seed pytrees of one structure -> one pytree with a leading seeds axis."""
    if not trees:
        raise ValueError("stack needs at least one pytree.")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree: Any) -> list[Any]:
    """The inverse of ``stack``: a pytree with a leading seeds axis -> per-seed pytrees."""
    leaves, treedef = jax.tree.flatten(tree)
    n = leaves[0].shape[0]
    return [jax.tree.unflatten(treedef, [x[i] for x in leaves]) for i in range(n)]


def init_seeds(init_fn: Callable[[int], Any], seeds: Sequence[int]) -> Any:
    """``stack([init_fn(s) for s in seeds])``: each seed's initial state, stacked.

    Raises:
      ValueError: no seeds, a seed that is not an int >= 0, or a repeated seed.
    """
    return stack([init_fn(s) for s in _check_seeds(seeds)])


@functools.lru_cache(maxsize=32)
def vmap_step(step_fn: Callable[[Any, Any], tuple[Any, Any]], *,
              state_sharding: jax.sharding.Sharding | None = None,
              batch_sharding: jax.sharding.Sharding | None = None
              ) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``jax.jit(jax.vmap(step_fn))``: one compiled step for every seed.

    Cached per ``step_fn`` (by identity) and shardings, so ``run_seeds`` called again with
    the same step (e.g. to resume) reuses the compiled step.

    Args:
      step_fn: ``(state, batch) -> (state, metrics)`` for one seed (pure; may be jitted
        already: ``vmap`` of a jitted function is fine, its shardings gain the seeds axis
        unsplit).
      state_sharding: with ``batch_sharding``, the stacked states' (and the metrics')
        sharding on a mesh, e.g. replicated: the seeds then run data-parallel, each
        seed's batch split over the devices (and processes) of the mesh.
      batch_sharding: the stacked batches' sharding (e.g. ``PartitionSpec(None, "data")``).

    Returns:
      ``(states, batches) -> (states, metrics)`` with a leading seeds axis on all of them.
    """
    if state_sharding is None and batch_sharding is None:
        return jax.jit(jax.vmap(step_fn))
    return jax.jit(jax.vmap(step_fn), in_shardings=(state_sharding, batch_sharding),
                   out_shardings=(state_sharding, state_sharding))


def run_seeds(init_fn: Callable[[int], Any], step_fn: Callable[[Any, Any], tuple[Any, Any]],
              batch_fn: Callable[[int, int], Any], seeds: Sequence[int], steps: int,
              *, states: Any = None, start: int = 0) -> tuple[Any, dict[str, np.ndarray]]:
    """Trains every seed for ``steps`` steps with one vmapped step.

    Args:
      init_fn: ``seed -> state`` (ignored when ``states`` is given).
      step_fn: ``(state, batch) -> (state, metrics)``, metrics a dict of scalars.
      batch_fn: ``(seed, step) -> batch`` (a NumPy or JAX array or pytree): each seed's
        own data order.
      seeds: distinct ints >= 0.
      steps: steps to run (>= 0).
      states: stacked states to continue from (e.g. restored from a checkpoint).
      start: the index of the first step (the ``step`` passed to ``batch_fn``).

    Returns:
      ``(states, history)``: the stacked final states and, per metric, a float64 array
      [seeds, steps].

    Example:
      >>> init = lambda s: {"w": jnp.full((2,), float(s), jnp.float32)}
      >>> step = lambda st, b: ({"w": st["w"] - 0.5 * b}, {"w0": st["w"][0]})
      >>> batch = lambda s, t: np.ones(2, np.float32) * (s + t)
      >>> states, hist = run_seeds(init, step, batch, seeds=[0, 1], steps=2)
      >>> states["w"].tolist(), hist["w0"].tolist()
      ([[-0.5, -0.5], [-0.5, -0.5]], [[0.0, 0.0], [1.0, 0.5]])
    """
    seeds = _check_seeds(seeds)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}.")
    if states is None:
        states = init_seeds(init_fn, seeds)
    step = vmap_step(step_fn)
    rows: list[dict[str, Any]] = []
    for t in range(start, start + steps):
        batches = stack([jax.tree.map(jnp.asarray, batch_fn(s, t)) for s in seeds])
        states, metrics = step(states, batches)
        rows.append(metrics)
    history: dict[str, np.ndarray] = {}
    if rows:
        fetched = jax.device_get(rows)
        for k in fetched[0]:
            history[k] = np.stack([np.asarray(r[k], np.float64) for r in fetched], axis=1)
    return states, history


# ---------------------------------------------------------------------------------------------
# Training the seeds of one setup


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
                "steps_done": len(h["loss"]), **history_summary(h),
                "update_ratio": (float(np.median(h["update_ratio"])) if h["update_ratio"]
                                 else 0.0),
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
    curve are left out. What ``studies.lib.stats.plot_seed_bands`` draws."""
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
    state = mesh.replicate(stack(states), cfg.data_parallel)
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
        vstep = vmap_step(
            step_fn, state_sharding=mesh.state_sharding(cfg.data_parallel),
            batch_sharding=mesh.batch_sharding(cfg.data_parallel, seeds_axis=True))
    else:
        vstep = vmap_step(step_fn)
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
        mem = ledger(unstack(state)[0].params, make_optimizer(setup, cfg))
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
    params = [s.params for s in unstack(pre.state)]
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
