"""Optax transformations for low-precision training (no flax in this package).

* Loss scaling: ``dynamic_loss_scale`` (PyTorch GradScaler semantics; Megatron hysteresis),
  ``static_loss_scale``, and ``loss_scale`` / ``scale_loss`` / ``unscale_grads``;
  ``all_finite``, the finiteness test they skip steps by.
* Master weights: ``master_weights`` keeps f32 masters and returns f32 deltas that
  ``optax.apply_updates`` (and ``nnx.Optimizer``) turn into exactly round(master);
  ``param_mismatches`` checks it; ``add_updates`` is ``optax.apply_updates`` that also runs
  under strict dtype promotion.
* Pure low-precision updates: ``stochastic_round_updates``, ``kahan_updates``.
* Optimizer-state precision: ``scale_by_adam`` / ``adam`` / ``adamw`` with bf16, fp16 or FP8
  (scaled) moments.
* Gradient accumulation that survives an overflow: ``multi_steps`` (use it, not
  ``optax.MultiSteps``, around a loss scaler).

A training step (params in bf16 or fp16)::

    opt = dynamic_loss_scale(master_weights(optax.adamw(1e-3)))
    state = opt.init(params)

    def step(params, state, batch):
        grads = jax.grad(lambda p: scale_loss(loss_fn(p, batch), state))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state
"""

from fmtkit.optim._accumulate import multi_steps
from fmtkit.optim._adam import ScaleByAdamState, adam, adamw, scale_by_adam
from fmtkit.optim._common import all_finite
from fmtkit.optim._loss_scale import (
    DynamicLossScaleState,
    StaticLossScaleState,
    dynamic_loss_scale,
    loss_scale,
    scale_loss,
    static_loss_scale,
    unscale_grads,
)
from fmtkit.optim._master import (
    KahanUpdatesState,
    MasterWeightsState,
    StochasticRoundUpdatesState,
    add_updates,
    kahan_updates,
    master_weights,
    param_mismatches,
    stochastic_round_updates,
)

__all__ = [
    "DynamicLossScaleState",
    "KahanUpdatesState",
    "MasterWeightsState",
    "ScaleByAdamState",
    "StaticLossScaleState",
    "StochasticRoundUpdatesState",
    "adam",
    "adamw",
    "add_updates",
    "all_finite",
    "dynamic_loss_scale",
    "kahan_updates",
    "loss_scale",
    "master_weights",
    "multi_steps",
    "param_mismatches",
    "scale_by_adam",
    "scale_loss",
    "static_loss_scale",
    "stochastic_round_updates",
    "unscale_grads",
]
