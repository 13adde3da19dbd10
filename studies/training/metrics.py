"""The per-step metrics of a training step (all f32/int32 scalars, computed inside ``jit``).

* ``loss``: next-token cross entropy (nats/byte) of the batch before the update, in f32
  (the logits are cast to f32 first), *unscaled*.
* ``loss_scale``: the scale the loss was multiplied by for this step's gradients (1 without
  loss scaling).
* ``skipped``: 1 when the optimizer skipped the step (``dynamic_loss_scale`` found a
  non-finite gradient), else 0.
* ``grad_flush``: fraction of the nonzero gradient values that flush to zero in the setup's
  gradient format ``setup.grad_format``: with ``g`` every element of the gradient tree the
  optimizer receives (the gradient of the *scaled* loss when the loss is scaled, as stored,
  usually f32), pooled over all parameters,

      grad_flush = #(g != 0 and fmtkit.cast(g, grad_format) == 0) / #(g != 0)

  (0 when no gradient value is nonzero). For "fp16" this is the share of gradient values
  that fp16 cannot represent at all (below half its smallest subnormal, 2^-25): what loss
  scaling exists to rescue. Values already flushed inside the backward pass (the policy
  rounds cotangents through its gradient dtype at module boundaries) are zeros, so they are
  not counted: the metric is a lower bound of the total loss of gradient information.
  For FP8 setups it is measured in bf16 (the gradient dtype of the fp8-* presets); the FP8
  quantization inside the scaled dots is not part of it (``fmtkit.telemetry`` measures that).
* ``grad_norm``: global L2 norm of the unscaled gradients (``optax.tree.norm``, which
  replaces the deprecated ``optax.global_norm``, over the gradients in f32; inf/NaN on
  overflow).
* ``update_frac``: fraction of parameter elements whose stored value changed in this step
  (1.0 means every parameter moved; pure-bf16 loses small updates and scores lower).
* ``update_ratio``: the step's update-to-weight ratio ||p_after - p_before|| / ||p_before||
  over the weight matrices (``studies.lib.regimes.update_ratio``, "global"; differences in f32):
  what the late-training regime claims (1e-4 .. 1e-3).

A run's history (one list per metric) is summarized by ``final_loss`` (the mean of its
last tenth) and ``history_summary`` (skipped steps, mean flush and update fraction, the
last loss scale), for one seed (``studies.training.loop``) and per seed
(``studies.training.multiseed``) alike.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmtkit.casting import cast
from studies.lib.regimes import update_ratio

__all__ = ["METRIC_KEYS", "final_loss", "flush_counts", "history_summary", "skipped_steps",
           "step_metrics"]

F32 = jnp.float32

METRIC_KEYS = ("loss", "loss_scale", "skipped", "grad_flush", "grad_norm", "update_frac",
               "update_ratio")
"""The per-step metrics of a step and of ``TrainResult.history`` (module docstring)."""


def flush_counts(grads: Any, fmt: str) -> tuple[jax.Array, jax.Array]:
    """``(#nonzero, #nonzero that flush to zero in fmt)`` over all gradient leaves (f32)."""
    nonzero = jnp.zeros([], F32)
    flushed = jnp.zeros([], F32)
    for g in jax.tree.leaves(grads):
        nz = g != 0
        nonzero = nonzero + jnp.sum(nz, dtype=F32)
        flushed = flushed + jnp.sum(nz & (cast(g, fmt) == 0), dtype=F32)
    return nonzero, flushed


def skipped_steps(opt_state: Any) -> jax.Array:
    """The loss scaler's count of skipped steps in ``opt_state`` (0 without a loss scaler)."""
    count = optax.tree.get(opt_state, "skipped_steps", None)
    return jnp.zeros([], jnp.int32) if count is None else count.astype(jnp.int32)


def step_metrics(*, loss: jax.Array, scale: jax.Array, grads: Any, grad_format: str,
                 params_before: Any, params_after: Any, opt_state_before: Any,
                 opt_state_after: Any) -> dict[str, jax.Array]:
    """The metrics of one step (module docstring), from what the step saw and produced."""
    nonzero, flushed = flush_counts(grads, grad_format)
    changed = sum((jnp.sum(a != b, dtype=F32) for a, b in zip(
        jax.tree.leaves(params_after), jax.tree.leaves(params_before))), jnp.zeros([], F32))
    grad_norm = optax.tree.norm(optax.tree.cast(grads, F32)) / scale
    return {
        "loss": loss,
        "loss_scale": scale,
        "skipped": skipped_steps(opt_state_after) - skipped_steps(opt_state_before),
        "grad_flush": jnp.where(nonzero > 0, flushed / jnp.maximum(nonzero, 1.0), 0.0),
        "grad_norm": grad_norm,
        "update_frac": changed / jnp.float32(optax.tree.size(params_after)),
        "update_ratio": update_ratio(params_before, params_after)["global"],
    }


def final_loss(losses: list[float]) -> float:
    """Mean of the last ``max(1, len // 10)`` losses (nan for an empty list)."""
    if not losses:
        return float("nan")
    k = max(1, len(losses) // 10)
    return float(np.mean(losses[-k:]))


def history_summary(history: dict[str, list[float]]) -> dict[str, Any]:
    """A history's JSON-ready summary: ``skipped_steps`` (their count), ``grad_flush`` and
    ``update_frac`` (means over the steps) and ``final_loss_scale`` (None for no step)."""
    h = history
    return {
        "skipped_steps": int(np.sum(h["skipped"])) if h["skipped"] else 0,
        "grad_flush": float(np.mean(h["grad_flush"])) if h["grad_flush"] else 0.0,
        "update_frac": float(np.mean(h["update_frac"])) if h["update_frac"] else 0.0,
        "final_loss_scale": h["loss_scale"][-1] if h["loss_scale"] else None,
    }
