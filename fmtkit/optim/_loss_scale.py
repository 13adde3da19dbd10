"""Dynamic and static loss scaling as optax wrapper transformations.

The loss is multiplied by a scale S before differentiation, so that small gradients survive a
float16 backward pass; the wrapper divides it back out before the inner optimizer sees it.
Per update, with ``finite`` = every element of the incoming (scaled) gradients is finite
(PyTorch ``torch.amp.GradScaler.update``; Megatron-LM ``DynamicGradScaler.update`` for
hysteresis):

    inv = 1 / S                           (f32; equals PyTorch's float64 reciprocal rounded
                                           to f32: double rounding is innocuous for division
                                           when 53 >= 2 * 24 + 2, Figueroa 1995)
    g32 = g.astype(f32) * inv
    if finite:
        updates, inner_state = inner.update(g32, inner_state, params)
        growth_tracker += 1
        if growth_tracker == growth_interval:
            S' = S * growth_factor;  S = min(S', max_scale) if S' is finite else S
            growth_tracker = 0;  hysteresis_tracker = hysteresis
    else:                                  (skip: zero updates, inner state untouched)
        growth_tracker = 0
        hysteresis_tracker = max(hysteresis_tracker - 1, 0)
        if hysteresis_tracker == 0:  S = max(S * backoff_factor, min_scale)

With ``hysteresis=1`` (default) every overflow backs off: PyTorch's rule, step for step. With
``hysteresis=h > 1`` it is Megatron's: the tracker is refilled only when the scale grows, so
the scale backs off on the h-th overflow since the last growth and on every overflow after
that (Megatron's docstring says "consecutive"; its code counts since the last growth).

The finiteness check is ``fmtkit.optim.all_finite`` on the scaled gradients: exact, like
PyTorch's elementwise test (a fast f32 sum per leaf; the exact test, a sum of ``x - x``,
runs only when the sum is not finite).

``last_step_skipped`` in the state says whether the update that produced it was skipped;
``skipped_steps`` counts all skips (and ``DynamicLossScaleState.consecutive_overflows`` the
current run of them).

The updates are the inner transformation's, in the dtypes it returns (float32 for an
optax optimizer given the float32 unscaled gradients; float32 deltas under
``master_weights``); a skipped step returns zeros of those dtypes.

**Gradient accumulation: use ``fmtkit.optim.multi_steps``, not ``optax.MultiSteps``.**
``optax.MultiSteps`` (0.2.8) resets its accumulator with ``(1 - emit) * acc``: after one
effective batch that overflowed, ``0 * inf = NaN`` stays in the accumulator, so every later
effective batch is non-finite and the loss scaler skips every step while the scale backs off
towards zero. ``dynamic_loss_scale`` and ``static_loss_scale`` detect being called from
``optax.MultiSteps`` (at ``init`` and when ``update`` is traced, by looking for
``optax.MultiSteps.init`` / ``update`` on the Python call stack: nothing is passed down that
would tell otherwise) and warn.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmtkit.optim._common import (
    F32,
    all_finite,
    check_float_leaves,
    increment,
    positive_float,
    positive_int,
)

_F32_MAX = float(np.finfo(np.float32).max)

__all__ = [
    "DynamicLossScaleState",
    "StaticLossScaleState",
    "dynamic_loss_scale",
    "loss_scale",
    "scale_loss",
    "static_loss_scale",
    "unscale_grads",
]


class DynamicLossScaleState(NamedTuple):
    """State of ``dynamic_loss_scale``.

    Attributes:
      loss_scale: f32 scalar, the scale to multiply the loss by in the next step.
      growth_tracker: int32, finite steps since the last growth or overflow (PyTorch's
        ``_growth_tracker``).
      hysteresis_tracker: int32, overflows still tolerated before a backoff (Megatron's
        ``_hysteresis_tracker``, floored at 0).
      skipped_steps: int32, total steps skipped for non-finite gradients.
      last_step_skipped: bool scalar, whether the update that returned this state was
        skipped (False after ``init``). Log it, or test it to drop a step's metrics.
      consecutive_overflows: int32, non-finite steps in a row (0 after a finite step); a value
        that keeps growing means the gradients are NaN for a reason the scale cannot fix.
      inner_state: the wrapped transformation's state.

    Example:
      >>> state = dynamic_loss_scale(optax.sgd(1e-3)).init({"w": jnp.ones(2)})
      >>> float(state.loss_scale), int(state.skipped_steps)
      (65536.0, 0)
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_tracker: jax.Array
    skipped_steps: jax.Array
    last_step_skipped: jax.Array
    consecutive_overflows: jax.Array
    inner_state: Any


class StaticLossScaleState(NamedTuple):
    """State of ``static_loss_scale``: the constant f32 scale, the skipped-step count (int32),
    whether the last update was skipped (bool scalar) and the wrapped transformation's
    state.

    Example:
      >>> state = static_loss_scale(optax.sgd(1e-3), scale=1024.0).init({"w": jnp.ones(2)})
      >>> float(state.loss_scale)
      1024.0
    """

    loss_scale: jax.Array
    skipped_steps: jax.Array
    last_step_skipped: jax.Array
    inner_state: Any


def _unscale(updates: Any, scale: jax.Array) -> Any:
    inv = jnp.float32(1.0) / scale
    return jax.tree.map(lambda g: g.astype(F32) * inv, updates)


def _guarded_update(inner: optax.GradientTransformationExtraArgs, updates: Any,
                    scale: jax.Array, inner_state: Any, params: Any, extra_args: dict
                    ) -> tuple[Any, Any, jax.Array]:
    """Unscales, checks finiteness, and runs the inner update only on a finite step."""
    check_float_leaves(updates, "updates (gradients)")
    inv = jnp.float32(1.0) / scale
    finite = all_finite(updates)

    def apply(grads, state, params, inv, dyn_args):
        # Unscaled inside the branch, so XLA fuses it into the inner update.
        unscaled = jax.tree.map(lambda g: g.astype(F32) * inv, grads)
        new_updates, new_state = inner.update(unscaled, state, params, **dyn_args,
                                              **static_args)
        _check_inner_state(state, new_state)
        return new_updates, new_state

    # The skip branch returns zeros in the dtypes of the inner updates (float32 deltas under
    # master_weights), found by tracing the inner update abstractly, as optax.MultiSteps does.
    static_args = {k: v for k, v in extra_args.items() if not isinstance(v, jax.Array)}
    dyn_args = {k: v for k, v in extra_args.items() if isinstance(v, jax.Array)}
    split = getattr(inner.update, "fmtkit_split", None)
    if split is not None and params is not None:
        return (*_split_guarded_update(split, updates, inv, finite, inner_state, params,
                                       static_args, dyn_args), finite)
    shapes, _ = jax.eval_shape(apply, updates, inner_state, params, inv, dyn_args)

    def skip(grads, state, params, inv, dyn_args):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), state

    new_updates, new_inner = jax.lax.cond(finite, apply, skip, updates, inner_state, params,
                                          inv, dyn_args)
    return new_updates, new_inner, finite


def _split_guarded_update(split: tuple, updates: Any, inv: jax.Array, finite: jax.Array,
                          inner_state: Any, params: Any, static_args: dict, dyn_args: dict
                          ) -> tuple[Any, Any]:
    """``_guarded_update`` for an inner update in two parts (``master_weights``):
    ``advance`` (new state, plus the updates of parameters without a master) under the
    ``lax.cond``, ``finish`` (the deltas, from the new state and the parameters) after it.

    Why: on XLA:CPU a ``lax.cond`` that returns fresh parameter-sized updates makes the whole
    optimizer step about 2x slower than the same update without the cond (measured with
    ``fmtkit bench optim``); a cond that returns only the state (updated in place in the
    donated buffers) costs nothing, and the deltas computed after it fuse into
    ``optax.apply_updates``. On a skipped step the state is untouched and the updates are
    selected to exact zeros, as the one-part path returns.
    """
    advance, finish = split

    def apply(grads, state, params, inv, dyn_args):
        unscaled = jax.tree.map(lambda g: g.astype(F32) * inv, grads)
        new_state, passthrough = advance(unscaled, state, params, **dyn_args, **static_args)
        _check_inner_state(state, new_state)
        return new_state, passthrough

    _, shapes = jax.eval_shape(apply, updates, inner_state, params, inv, dyn_args)

    def skip(grads, state, params, inv, dyn_args):
        return state, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    new_state, passthrough = jax.lax.cond(finite, apply, skip, updates, inner_state, params,
                                          inv, dyn_args)
    new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros((), u.dtype)),
                               finish(params, new_state, passthrough))
    return new_updates, new_state


def _warn_if_in_optax_multisteps(name: str) -> None:
    """Warns when called (at any depth) from ``optax.MultiSteps.init`` or ``.update``.

    The transformation cannot see its caller through its arguments, so this looks at the
    Python call stack (init, and update at trace time: no runtime cost). Remove it when
    ``test_optax_multisteps_overflow_poisons_the_accumulator`` starts failing (optax fixed).
    """
    codes = {getattr(getattr(optax.MultiSteps, m, None), "__code__", None)
             for m in ("init", "update")} - {None}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            warnings.warn(
                f"{name} is wrapped by optax.MultiSteps, whose accumulator is reset with "
                "(1 - emit) * acc: after one micro-batch with an inf gradient it holds NaN "
                "for good, and every later step is skipped while the loss scale backs off "
                "to zero (optax 0.2.8). Use fmtkit.optim.multi_steps(..., every_k=k) "
                "instead: same semantics and state, reset by selection.",
                UserWarning, stacklevel=2)
            return
        frame = frame.f_back


def _check_inner_state(old: Any, new: Any) -> None:
    """Trace-time check that float32 gradients did not change the inner state's dtypes."""
    old_l, new_l = jax.tree.leaves(old), jax.tree.leaves(new)
    if jax.tree.structure(old) != jax.tree.structure(new) or any(
            jnp.result_type(a) != jnp.result_type(b) for a, b in zip(old_l, new_l)):
        raise TypeError(
            "The inner transformation changed its state's structure or dtypes when given the "
            "unscaled float32 gradients (its state was built for low-precision parameters). "
            "Keep low-precision parameters behind a float32 master copy: "
            "dynamic_loss_scale(master_weights(inner)), or use float32 parameters.")


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with dynamic loss scaling (PyTorch GradScaler semantics by default).

    The update receives the gradients of the *scaled* loss (``scale_loss(loss, state)``),
    unscales them in float32, and either skips the step (any non-finite element: zero
    updates, inner state untouched, scale backed off) or passes the float32 unscaled
    gradients to ``inner``. The algorithm is in this module's docstring.

    Defaults are PyTorch's ``torch.amp.GradScaler``: ``init_scale=2**16``, ``growth_factor=2``,
    ``backoff_factor=0.5``, ``growth_interval=2000``, no bounds. ``hysteresis`` and
    ``min_scale`` are Megatron-LM's ``DynamicGradScaler`` options (Megatron's typical
    ``hysteresis`` is 2).

    ``inner`` receives float32 gradients. Put low-precision parameters behind
    ``master_weights`` (whose inner optimizer runs on the float32 master); an optax optimizer
    whose state was built on bf16/fp16 parameters is rejected at trace time with a
    ``TypeError`` instead of silently changing its state's dtypes. The returned updates are
    ``inner``'s, in the dtypes it returns (zeros of those dtypes on a skipped step).

    Gradient accumulation: ``fmtkit.optim.multi_steps(dynamic_loss_scale(...), every_k=k)``:
    the scale stays constant across the micro-steps and the unscale, the finiteness check
    and the scale update happen once per effective batch. **Not** ``optax.MultiSteps``: one
    overflowing micro-batch leaves NaN in its accumulator for good (optax 0.2.8), and every
    later step is skipped; this transformation warns when it finds itself inside one.

    ``optax.inject_hyperparams(dynamic_loss_scale)(inner, growth_interval=...)`` works: each
    numeric hyperparameter may be a scalar array, validated where it is concrete (at
    ``init``) and used as given where it is traced (``update`` under ``jit``), so it can be
    scheduled or changed in the state between steps (``init_scale`` only sets the first
    scale). A schedule of ``inner``'s own hyperparameters goes inside, or around the whole
    chain: ``optax.inject_hyperparams(lambda learning_rate: dynamic_loss_scale(
    master_weights(optax.adamw(learning_rate))))`` (a ``def`` with that signature).

    Args:
      inner: the optimizer to protect.
      init_scale: initial scale, finite and > 0 (kept as an f32 array in the state).
      growth_factor: factor applied after ``growth_interval`` finite steps; > 1.
      backoff_factor: factor applied on an overflow; in (0, 1).
      growth_interval: number of consecutive finite steps before growing; >= 1.
      min_scale: optional lower bound of the scale (Megatron); <= ``init_scale``.
      max_scale: optional upper bound of the scale; >= ``init_scale``.
      hysteresis: overflows tolerated (since the last growth) before backing off; >= 1.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``DynamicLossScaleState``.

    Raises:
      TypeError, ValueError: on a hyperparameter outside the ranges above.

    Warns:
      UserWarning: at ``init`` / ``update`` tracing inside ``optax.MultiSteps`` (see above).

    Example:
      >>> opt = dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0)
      >>> state = opt.init({"w": jnp.zeros(2)})
      >>> float(loss_scale(state))
      1024.0
    """
    inner = optax.with_extra_args_support(inner)
    init_scale = positive_float(init_scale, "init_scale")
    growth_factor = positive_float(growth_factor, "growth_factor")
    if isinstance(growth_factor, float) and growth_factor <= 1.0:
        raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}.")
    backoff_factor = positive_float(backoff_factor, "backoff_factor")
    if isinstance(backoff_factor, float) and not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in the open interval (0, 1), got "
                         f"{backoff_factor!r}.")
    growth_interval = positive_int(growth_interval, "growth_interval")
    hysteresis = positive_int(hysteresis, "hysteresis")
    min_scale = positive_float(min_scale, "min_scale", allow_none=True)
    max_scale = positive_float(max_scale, "max_scale", allow_none=True)
    # Checks between values run where both are concrete (Python numbers, or arrays at
    # ``init`` under optax.inject_hyperparams); traced values were checked at ``init``.
    if isinstance(init_scale, float):
        if isinstance(min_scale, float) and min_scale > init_scale:
            raise ValueError(f"min_scale={min_scale} must be <= init_scale={init_scale}.")
        if isinstance(max_scale, float) and max_scale < init_scale:
            raise ValueError(f"max_scale={max_scale} must be >= init_scale={init_scale}.")
        if init_scale > _F32_MAX:
            raise ValueError(f"init_scale={init_scale} overflows float32 (max "
                             f"{_F32_MAX:.4g}).")

    def init_fn(params):
        _warn_if_in_optax_multisteps("dynamic_loss_scale")
        # Separate arrays (not one shared zero), so that the state can be donated.
        return DynamicLossScaleState(
            loss_scale=jnp.asarray(init_scale, F32),
            growth_tracker=jnp.zeros([], jnp.int32),
            hysteresis_tracker=jnp.asarray(hysteresis, jnp.int32),
            skipped_steps=jnp.zeros([], jnp.int32),
            last_step_skipped=jnp.zeros([], jnp.bool_),
            consecutive_overflows=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        _warn_if_in_optax_multisteps("dynamic_loss_scale")
        scale = state.loss_scale
        new_updates, new_inner, finite = _guarded_update(
            inner, updates, scale, state.inner_state, params, extra_args)

        # Overflow: PyTorch / Megatron backoff.
        hyst_o = jnp.maximum(state.hysteresis_tracker - 1, 0)
        backed = scale * jnp.asarray(backoff_factor, F32)
        if min_scale is not None:
            backed = jnp.maximum(backed, jnp.asarray(min_scale, F32))
        scale_o = jnp.where(hyst_o == 0, backed, scale)
        # Finite step: growth every growth_interval steps, never to inf.
        tracker = state.growth_tracker + 1
        grow = tracker >= growth_interval
        grown = scale * jnp.asarray(growth_factor, F32)
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        if max_scale is not None:
            grown = jnp.minimum(grown, jnp.asarray(max_scale, F32))
        scale_f = jnp.where(grow, grown, scale)
        tracker_f = jnp.where(grow, 0, tracker)
        hyst_f = jnp.where(grow, jnp.asarray(hysteresis, jnp.int32), state.hysteresis_tracker)

        zero = jnp.zeros([], jnp.int32)
        new_state = DynamicLossScaleState(
            loss_scale=jnp.where(finite, scale_f, scale_o),
            growth_tracker=jnp.where(finite, tracker_f, zero).astype(jnp.int32),
            hysteresis_tracker=jnp.where(finite, hyst_f, hyst_o).astype(jnp.int32),
            skipped_steps=jnp.where(finite, state.skipped_steps,
                                    increment(state.skipped_steps)),
            last_step_skipped=~finite,
            consecutive_overflows=jnp.where(finite, zero,
                                            increment(state.consecutive_overflows)),
            inner_state=new_inner,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def static_loss_scale(inner: optax.GradientTransformation, *,
                      scale: float) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with a constant loss scale.

    Gradients are unscaled in float32 (``g * (1 / scale)``) before ``inner``; a step with any
    non-finite gradient is skipped (zero updates, inner state untouched), as Megatron-LM's
    ``ConstantGradScaler`` optimizer does. The scale never changes. Wrap it in
    ``fmtkit.optim.multi_steps``, not ``optax.MultiSteps`` (see ``dynamic_loss_scale``).

    Args:
      inner: the optimizer to protect (receives float32 gradients, as in
        ``dynamic_loss_scale``).
      scale: the loss scale, finite and > 0.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``StaticLossScaleState``.

    Raises:
      TypeError, ValueError: ``scale`` is not a finite positive number.

    Example:
      >>> opt = static_loss_scale(optax.sgd(0.1), scale=128.0)
      >>> float(loss_scale(opt.init(jnp.zeros(2))))
      128.0
    """
    inner = optax.with_extra_args_support(inner)
    scale = positive_float(scale, "scale")
    if isinstance(scale, float) and scale > _F32_MAX:
        raise ValueError(f"scale={scale} overflows float32 (max {_F32_MAX:.4g}).")

    def init_fn(params):
        _warn_if_in_optax_multisteps("static_loss_scale")
        return StaticLossScaleState(loss_scale=jnp.asarray(scale, F32),
                                    skipped_steps=jnp.zeros([], jnp.int32),
                                    last_step_skipped=jnp.zeros([], jnp.bool_),
                                    inner_state=inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        _warn_if_in_optax_multisteps("static_loss_scale")
        new_updates, new_inner, finite = _guarded_update(
            inner, updates, state.loss_scale, state.inner_state, params, extra_args)
        return new_updates, StaticLossScaleState(
            loss_scale=state.loss_scale,
            skipped_steps=jnp.where(finite, state.skipped_steps,
                                    increment(state.skipped_steps)),
            last_step_skipped=~finite,
            inner_state=new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def loss_scale(opt_state: Any, *, default: float | None = None) -> jax.Array:
    """The f32 scale to multiply the loss by this step, found anywhere in ``opt_state``.

    Looks for the ``loss_scale`` field (``optax.tree_utils.tree_get``) through chains,
    ``optax.MultiSteps``, ``optax.apply_if_finite`` and any other wrapper.

    Args:
      opt_state: an optimizer state containing one ``dynamic_loss_scale`` or
        ``static_loss_scale`` state.
      default: returned (as an f32 array) when there is none; without it that is an error.

    Returns:
      A scalar f32 array.

    Raises:
      ValueError: no loss scale in the state (and no ``default``), or more than one.

    Example:
      >>> # Clipping goes inside the scaler, where the gradients are unscaled: chained before
      >>> # it, optax.clip would clip the 2^16-times scaled gradients (PyTorch's AMP notes).
      >>> inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
      >>> state = optax.chain(dynamic_loss_scale(inner)).init(jnp.zeros(2))
      >>> float(loss_scale(state))
      65536.0
    """
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "loss_scale")
    if not found:
        if default is None:
            raise ValueError(
                "This optimizer state has no loss scale: wrap the optimizer with "
                "fmtkit.optim.dynamic_loss_scale or static_loss_scale, or pass default=1.0.")
        return jnp.asarray(default, F32)
    if len(found) > 1:
        paths = ", ".join(str(p) for p, _ in found)
        raise ValueError(f"This optimizer state has {len(found)} loss scales (at {paths}); "
                         "nest at most one dynamic_loss_scale / static_loss_scale.")
    return jnp.asarray(found[0][1], F32)


def scale_loss(loss: jax.typing.ArrayLike, opt_state: Any, *,
               default: float | None = None) -> jax.Array:
    """``loss * loss_scale(opt_state, default=default)``, in f32.

    Differentiate this: the cotangent entering the (possibly float16) loss computation is the
    scale itself, cast to the loss dtype (so a 2**16 scale and a float16 loss overflow on
    the first step, and the dynamic scale backs off, as in PyTorch). ``default=1.0`` lets one
    train step serve optimizers with and without loss scaling.

    Example:
      >>> state = static_loss_scale(optax.sgd(1.0), scale=8.0).init(jnp.zeros(2))
      >>> float(scale_loss(jnp.float16(0.5), state))
      4.0
    """
    loss = jnp.asarray(loss)
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"loss must be floating point, got dtype {loss.dtype}.")
    return loss.astype(F32) * loss_scale(opt_state, default=default)


def unscale_grads(grads: Any, opt_state: Any, *, default: float | None = None) -> Any:
    """Gradients of the scaled loss divided by the scale: an f32 tree (``g * (1 / scale)``).

    For logging or clipping outside the optimizer; ``dynamic_loss_scale`` unscales by
    itself, so do not feed it unscaled gradients.

    Example:
      >>> state = static_loss_scale(optax.sgd(1.0), scale=8.0).init(jnp.zeros(2))
      >>> unscale_grads({"w": jnp.full(2, 4.0, jnp.float16)}, state)["w"].tolist()
      [0.5, 0.5]
    """
    check_float_leaves(grads, "grads")
    return _unscale(grads, loss_scale(opt_state, default=default))
