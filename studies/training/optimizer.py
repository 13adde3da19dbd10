"""The learning-rate schedule and the optax chain of each setup."""

from __future__ import annotations

import optax

from fmtkit import optim
from studies.training.config import TrainConfig
from studies.training.setups import Setup

__all__ = ["lr_schedule", "make_optimizer"]


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 over ``cfg.warmup_steps`` to ``cfg.lr``, then cosine decay to
    ``lr / 10`` at ``cfg.steps`` (``optax.warmup_cosine_decay_schedule``):
    ``lr(t) = lr * t / w`` for t < w, else ``lr * (0.1 + 0.45 * (1 + cos(pi * (t - w) /
    (steps - w))))``. Under the "late-training" regime: the constant ``cfg.lr`` (the end of
    a schedule, with ``lr`` calibrated by ``studies.training.multiseed.late_training``)."""
    if cfg.regime == "late-training":
        return optax.constant_schedule(cfg.lr)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps, end_value=cfg.lr / 10)


def make_optimizer(setup: Setup, cfg: TrainConfig) -> optax.GradientTransformation:
    """The optimizer of a setup: clip + ``fmtkit.optim.adamw`` (moments in the parameters'
    dtype), wrapped per ``setup.update`` and ``setup.loss_scaling``:
    ``dynamic_loss_scale(master_weights(chain(clip, adamw)))`` at the most."""
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(optim.adamw(lr_schedule(cfg), b1=0.9, b2=0.95, eps=1e-8,
                             weight_decay=cfg.weight_decay))
    opt: optax.GradientTransformation = optax.chain(*parts)
    if setup.update == "master":
        opt = optim.master_weights(opt)
    elif setup.update == "stochastic":
        opt = optim.stochastic_round_updates(opt, seed=cfg.seed)
    elif setup.update == "kahan":
        opt = optim.kahan_updates(opt)
    if setup.loss_scaling == "dynamic":
        opt = optim.dynamic_loss_scale(opt, init_scale=setup.init_scale,
                                       growth_interval=setup.growth_interval)
    elif setup.loss_scaling == "static":
        opt = optim.static_loss_scale(opt, scale=setup.init_scale)
    return opt
