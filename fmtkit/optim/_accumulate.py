"""Gradient accumulation that recovers from a non-finite micro-batch (``optax.MultiSteps`` fix).

``optax.MultiSteps`` (0.2.8) resets its accumulator with ``(1 - emit) * acc``: after an
effective batch whose accumulated gradient holds an inf, ``0 * inf = NaN`` stays in the
accumulator, so every later effective batch is non-finite. Under ``dynamic_loss_scale`` that
means: skip every step, back off until the scale underflows. (It also mixes int32 and float
arithmetic, so it does not trace under ``jax_numpy_dtype_promotion="strict"``.)

``multi_steps`` has the same semantics and state (``optax.MultiStepsState``) with the
accumulator reset by selection, a ``lax.cond`` that runs the inner update only on the last
micro-step, and strict-promotion-clean arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fmtkit.optim._common import check_dtype_arg, check_float_leaves, increment, positive_int

__all__ = ["multi_steps"]


def multi_steps(inner: optax.GradientTransformation, *, every_k: int,
                use_grad_mean: bool = True,
                accumulator_dtype: jax.typing.DTypeLike = "float32",
                ) -> optax.GradientTransformationExtraArgs:
    """Accumulates ``every_k`` micro-batch gradients, then calls ``inner`` once.

    Micro-steps return zero updates and leave ``inner``'s state untouched; the k-th passes
    the mean (or sum) of the k gradients, cast back to the gradients' dtype, to ``inner``,
    and returns ``inner``'s updates in the dtypes ``inner`` gives them (float32 deltas under
    ``master_weights``; the micro-steps' zeros have the same dtypes). The accumulator is
    reset to zeros after each effective batch even when it held inf/NaN.
    ``multi_steps(dynamic_loss_scale(...), every_k=k)`` gives PyTorch's documented AMP
    accumulation: constant scale across the micro-batches, one unscale + finiteness check +
    scale update per effective batch.

    Args:
      inner: the optimizer to call once per effective batch.
      every_k: micro-batches per effective batch (>= 1).
      use_grad_mean: average (True, Welford update as in optax) or sum the gradients.
      accumulator_dtype: dtype of the accumulator (default float32; a string such as
        ``"float32"`` under ``optax.inject_hyperparams``, which treats callables such as
        ``jnp.float32`` as schedules).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``optax.MultiStepsState``.

    Raises:
      TypeError, ValueError: ``every_k`` is not a positive int; non-floating gradients.

    Example:
      >>> opt = multi_steps(optax.sgd(1.0), every_k=2)
      >>> s = opt.init(jnp.zeros(1))
      >>> u, s = opt.update(jnp.array([1.0]), s)
      >>> u, s = opt.update(jnp.array([3.0]), s)
      >>> u.tolist()
      [-2.0]
    """
    inner = optax.with_extra_args_support(inner)
    every_k = positive_int(every_k, "every_k")
    acc_dtype = check_dtype_arg(accumulator_dtype, "accumulator_dtype")
    if not jnp.issubdtype(acc_dtype, jnp.floating):
        raise TypeError(f"accumulator_dtype must be floating, got {acc_dtype}.")

    def init_fn(params):
        return optax.MultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=jnp.zeros([], jnp.int32),
            inner_opt_state=inner.init(params),
            acc_grads=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), acc_dtype), params),
            skip_state=(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        check_float_leaves(updates, "updates (gradients)")
        n = state.mini_step
        if use_grad_mean:
            denom = (n + 1).astype(acc_dtype)
            acc = jax.tree.map(lambda g, a: a + (g.astype(acc_dtype) - a) / denom,
                               updates, state.acc_grads)
        else:
            acc = jax.tree.map(lambda g, a: a + g.astype(acc_dtype), updates, state.acc_grads)
        emit = n == every_k - 1

        def do_emit(acc, inner_state, params, dyn_args):
            grads = jax.tree.map(lambda a, g: a.astype(g.dtype), acc, updates)
            new_updates, inner_state = inner.update(grads, inner_state, params, **dyn_args,
                                                    **static_args)
            return new_updates, inner_state, optax.tree.zeros_like(acc)

        # Micro-steps return zeros in the dtypes of the inner updates, found by tracing the
        # inner update abstractly (as optax.MultiSteps does).
        static_args = {k: v for k, v in extra_args.items() if not isinstance(v, jax.Array)}
        dyn_args = {k: v for k, v in extra_args.items() if isinstance(v, jax.Array)}
        shapes = jax.eval_shape(do_emit, acc, state.inner_opt_state, params, dyn_args)[0]

        def accumulate(acc, inner_state, params, dyn_args):
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return zeros, inner_state, acc

        new_updates, inner_state, acc = jax.lax.cond(
            emit, do_emit, accumulate, acc, state.inner_opt_state, params, dyn_args)
        return new_updates, optax.MultiStepsState(
            mini_step=jnp.where(emit, jnp.zeros([], jnp.int32), increment(n)),
            gradient_step=jnp.where(emit, increment(state.gradient_step),
                                    state.gradient_step),
            inner_opt_state=inner_state,
            acc_grads=acc,
            skip_state=(),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

