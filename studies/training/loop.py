"""The training loop of one seed: ``train(setup, cfg)``.

``train`` runs one setup (``studies.training.setups``) under one ``TrainConfig``
(``studies.training.config``) on the byte-level ``studies.lib.models.TransformerLM``: it builds
the step (``studies.training.step.make_train_step``), feeds it the batches
(``studies.training.data``), records the metrics (``studies.training.metrics``), checkpoints
the whole state with orbax and resumes from it (``studies.training.checkpoint``), and returns
the loss curve and telemetry as a ``TrainResult``. Several seeds of one setup train together
in ``studies.training.multiseed``.

Determinism: batch ``k`` is drawn from ``numpy.random.default_rng([cfg.seed, k])``, the
parameters from ``jax.random.PRNGKey(cfg.seed)``, stochastic rounding from seeds in the
optimizer state. A run resumed from a checkpoint at step k sees the same batches and ends
bit-identical to an uninterrupted one (tested).

Example:
  >>> cfg = TrainConfig(steps=20)
  >>> result = train(get_setup("bf16-mixed"), cfg)          # doctest: +SKIP
  >>> result.final_loss, result.compile_seconds, result.step_ms  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fmtkit.memory import ledger
from studies.lib.common import Progress, StudyError, no_progress
from studies.training import checkpoint
from studies.training.config import TrainConfig
from studies.training.data import batch_at, load_data
from studies.training.mesh import put_batch
from studies.training.metrics import METRIC_KEYS, final_loss, history_summary
from studies.training.optimizer import make_optimizer
from studies.training.setups import Setup, get_setup
from studies.training.step import TrainState, make_train_step

__all__ = ["TrainResult", "train"]


@dataclasses.dataclass
class TrainResult:
    """What ``train`` returns.

    Attributes:
      setup: the setup's name.
      history: per-step metric lists (keys as in the module docstring), steps 0..n-1.
      steps_done: steps run (fewer than cfg.steps when the run diverged).
      diverged_at: the step whose loss was non-finite (only for ``may_diverge`` setups).
      compile_seconds: trace + compile time of the step function.
      step_ms: median wall time of a step after the first, metrics fetched (ms).
      first_step_seconds: the first call of the compiled step.
      bytes_per_param: ``fmtkit.memory.ledger(params, optimizer).bytes_per_param``.
      memory: that ledger as a dict.
      resumed_from: the checkpoint step a resumed run started from (None: from scratch).
      state: the final ``TrainState``.
    """

    setup: str
    history: dict[str, list[float]]
    steps_done: int
    diverged_at: int | None
    compile_seconds: float
    step_ms: float
    first_step_seconds: float
    bytes_per_param: float
    memory: dict[str, Any]
    resumed_from: int | None
    state: TrainState

    @property
    def diverged(self) -> bool:
        return self.diverged_at is not None

    @property
    def final_loss(self) -> float:
        """Mean loss of the last ``max(1, steps_done // 10)`` steps (nan if diverged)."""
        return float("nan") if self.diverged else final_loss(self.history["loss"])

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers (no state)."""
        return {
            "setup": self.setup, "final_loss": self.final_loss, "steps_done": self.steps_done,
            "diverged_at": self.diverged_at, **history_summary(self.history),
            "compile_seconds": self.compile_seconds, "step_ms": self.step_ms,
            "first_step_seconds": self.first_step_seconds,
            "bytes_per_param": self.bytes_per_param, "memory": self.memory,
            "resumed_from": self.resumed_from, "history": self.history,
        }


def train(setup: Setup | str, cfg: TrainConfig, progress: Progress = no_progress,
          run_dir: str | Path | None = None, resume: bool = False, *,
          data: np.ndarray | None = None, params: Any = None,
          step: tuple[Callable, Callable] | None = None) -> TrainResult:
    """Trains one setup for ``cfg.steps`` steps and returns its curve and telemetry.

    Compiles the step once (timed separately: ``compile_seconds``), then runs the steps,
    fetching each step's metrics (which waits for the device: ``step_ms`` is a real step).
    A non-finite loss raises ``StudyError``, unless ``setup.may_diverge``: then the run stops
    there and is marked diverged (``diverged_at``). With ``run_dir`` and
    ``cfg.checkpoint_every > 0`` the full ``TrainState`` (params, optimizer state with loss
    scale and master weights, fp8 state, step, rng) and the metric history are saved with
    orbax under ``run_dir/checkpoints/<step>/`` every ``checkpoint_every`` steps and at the
    end; ``resume=True`` continues from the latest one (from scratch if there is none), so
    that the final state and the loss curve equal an uninterrupted run's bit for bit.

    Args:
      setup: a ``Setup`` or a registered name.
      cfg: the training configuration.
      progress: progress-bar factory (``studies.lib.common.Progress``).
      run_dir: folder of this run's checkpoints (None: no checkpoints).
      resume: continue from the latest checkpoint in ``run_dir``.
      data: the training bytes (``load_data(cfg)`` if None; pass it to share one corpus).
      params: the f32 initial parameters (``init_params(cfg)`` if None; pass them to share
        one initialization between setups).
      step: the ``(init_fn, step_fn)`` pair of ``make_train_step(setup, cfg)`` to reuse, so
        that several runs of one setup compile its step once (built here when None; then
        ``params`` goes to ``make_train_step``).

    Returns:
      A ``TrainResult``.

    Raises:
      StudyError: non-finite loss in a setup not expected to diverge.
      ValueError: ``resume`` without ``run_dir``; a checkpoint of another setup/config.
      OSError, ValueError: a bad ``cfg.data`` (``load_data``).
    """
    setup = get_setup(setup)
    if jax.process_count() > 1 and jax.process_index() != 0:
        progress = no_progress  # progress is shown once, by process 0
    if resume and run_dir is None:
        raise ValueError("resume=True needs run_dir (the folder holding the checkpoints).")
    if data is None:
        data = load_data(cfg)
    init_fn, step_fn = step if step is not None else make_train_step(setup, cfg, params=params)
    state = init_fn()
    history: dict[str, list[float]] = {k: [] for k in METRIC_KEYS}
    record = checkpoint.config_record(setup, cfg)
    mngr = None
    resumed_from = None
    if run_dir is not None and (cfg.checkpoint_every > 0 or resume):
        mngr = checkpoint.open_manager(run_dir)
        if resume and mngr.latest_step() is not None:
            state, history = checkpoint.restore(mngr, state, record)
            resumed_from = int(state.step)

    def batch(i: int) -> jax.Array:
        return put_batch(batch_at(data, cfg, i), cfg.data_parallel)

    start = int(state.step)
    compiled, compile_seconds = None, 0.0
    if start < cfg.steps:  # (a resumed run that had finished has nothing left to compile)
        t0 = time.perf_counter()
        compiled = step_fn.lower(state, batch(start)).compile()
        compile_seconds = time.perf_counter() - t0

    times: list[float] = []
    diverged_at = None
    first_step = float("nan")
    for i in progress(range(start, cfg.steps), total=cfg.steps - start, desc=setup.name):
        tokens = batch(i)
        t = time.perf_counter()
        state, metrics = compiled(state, tokens)
        metrics = jax.device_get(metrics)
        dt = time.perf_counter() - t
        if i == start:
            first_step = dt
        else:
            times.append(dt)
        for k in METRIC_KEYS:
            history[k].append(float(metrics[k]))
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            if setup.may_diverge:
                diverged_at = i
                break
            raise StudyError(
                f"loss is {loss} at step {i} under setup {setup.name!r} "
                f"({setup.description}); a setup expected to train stably diverged. "
                f"Try a lower --lr (now {cfg.lr}).")
        if mngr is not None and cfg.checkpoint_every > 0 and (i + 1) % cfg.checkpoint_every \
                == 0 and i + 1 < cfg.steps:
            checkpoint.save(mngr, state, history, record)
    if mngr is not None and cfg.checkpoint_every > 0 and diverged_at is None \
            and mngr.latest_step() != int(state.step):
        checkpoint.save(mngr, state, history, record)
    if mngr is not None:
        mngr.close()

    with jax.numpy_dtype_promotion("standard"):
        mem = ledger(state.params, make_optimizer(setup, cfg))
    return TrainResult(
        setup=setup.name, history=history, steps_done=len(history["loss"]),
        diverged_at=diverged_at, compile_seconds=compile_seconds,
        step_ms=float(np.median(times) * 1e3) if times else float("nan"),
        first_step_seconds=first_step, bytes_per_param=mem.bytes_per_param,
        memory=mem.as_dict(), resumed_from=resumed_from, state=state)
