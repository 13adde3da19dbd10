"""A divergence monitor for training loops: gradient norm, non-finite counts, loss spikes.

FP8 validation needs long loss curves watched for the ways low precision fails: a
gradient whose norm explodes, values that become inf/NaN, and a loss that jumps above its
recent level (DeepSeek-V3's 128x128 activation-gradient blocks made a 16B MoE diverge;
arXiv 2412.19437, App. B.2). The in-step parts (``nonfinite_count``, ``grad_norm``) run
inside ``jit``; the spike detector (``loss_spikes``) runs on the host over the recorded
curve, so the threshold can be changed after the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SPIKE_FACTOR", "SPIKE_WINDOW", "grad_norm", "loss_spikes", "monitor_summary",
           "nonfinite_count"]

F32 = jnp.float32

SPIKE_WINDOW = 20
"""Steps of the running median a loss is compared with: long enough that one outlier
step does not move the median, short enough to follow the falling curve of early
training (over 20 steps the tiny model's loss falls by ~1-3%)."""

SPIKE_FACTOR = 1.1
"""A spike is a loss more than 10% above the running median: several times the
step-to-step noise of a batch-8 byte-level loss (~2-4%), far below a divergence (which
multiplies the loss or makes it non-finite)."""


def nonfinite_count(tree: Any) -> jax.Array:
    """The number of inf/NaN elements over every leaf of ``tree`` (int32 scalar)."""
    total = jnp.zeros([], jnp.int32)
    for x in jax.tree.leaves(tree):
        total = total + jnp.sum(~jnp.isfinite(jnp.asarray(x)), dtype=jnp.int32)
    return total


def grad_norm(tree: Any) -> jax.Array:
    """The global L2 norm of ``tree`` in f32 (inf/NaN when an element is)."""
    leaves = [jnp.asarray(x).astype(F32) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum((jnp.sum(jnp.square(x)) for x in leaves), jnp.zeros([], F32)))


def loss_spikes(losses: Sequence[float] | np.ndarray, *, window: int = SPIKE_WINDOW,
                factor: float = SPIKE_FACTOR) -> list[int]:
    """The steps whose loss exceeds ``factor`` times the median of the ``window`` losses
    before it (only once ``window`` finite losses precede it), plus every step whose
    loss is not finite.

    Args:
      losses: the loss per step.
      window: steps of the running median (>= 1).
      factor: the spike threshold over the median (> 1).

    Returns:
      The spike steps, ascending.

    Raises:
      ValueError: ``window`` < 1 or ``factor`` <= 1.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}.")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
        raise ValueError(f"factor must be a finite number > 1, got {factor!r}.")
    y = np.asarray(losses, np.float64)
    out = []
    for t, v in enumerate(y):
        if not np.isfinite(v):
            out.append(t)
            continue
        past = y[max(0, t - window):t]
        past = past[np.isfinite(past)]
        if len(past) == window and v > factor * float(np.median(past)):
            out.append(t)
    return out


def monitor_summary(history: dict[str, Sequence[float]], *, window: int = SPIKE_WINDOW,
                    factor: float = SPIKE_FACTOR) -> dict[str, Any]:
    """One run's monitor: ``{"spikes": steps, "nonfinite_steps": steps with a non-finite
    gradient element or loss, "first_nonfinite": the first of them or None,
    "max_grad_norm": the largest finite gradient norm, "diverged": a non-finite loss}``,
    from a history with ``loss``, ``grad_norm`` and ``nonfinite`` per step."""
    loss = np.asarray(history["loss"], np.float64)
    nonfinite = np.asarray(history["nonfinite"], np.float64)
    gn = np.asarray(history["grad_norm"], np.float64)
    bad = [int(t) for t in np.flatnonzero((nonfinite > 0) | ~np.isfinite(loss))]
    finite_gn = gn[np.isfinite(gn)]
    return {"spikes": loss_spikes(loss, window=window, factor=factor),
            "nonfinite_steps": bad, "first_nonfinite": bad[0] if bad else None,
            "max_grad_norm": float(finite_gn.max()) if finite_gn.size else float("nan"),
            "diverged": bool(np.any(~np.isfinite(loss)))}
