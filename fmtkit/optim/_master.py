"""Low-precision parameters: float32 master weights, stochastic rounding, Kahan summation.

Why a dedicated ``apply_updates``: ``optax.apply_updates`` adds an update to each parameter
in the parameter's dtype. With bf16 parameters ``p`` and a target ``n = round(master)``,
no bf16 delta ``d`` guarantees ``p + d == n``: ``n - p`` is exact only when
``n / 2 <= p <= 2 n`` (Sterbenz's lemma), and for ``p = 1``, ``n = 2**-30`` no bf16 ``d``
works at all. Measured: with bf16 parameters drawn from N(0, 1) and updates of relative size
0.1, about 3% of elements miss the target through ``optax.apply_updates``.

So ``master_weights`` keeps the truth in its state and ``fmtkit.optim.apply_updates(params,
updates, opt_state)`` writes ``params = round(master)`` for every parameter that has a master
(and ``p + u`` for the others). The ``updates`` it returns are still deltas
(``round(new_master) - params`` in the parameter dtype), so zero updates mean "no change" for
every optax wrapper (``MultiSteps``, ``apply_if_finite``, loss-scale skips), and a skipped
step leaves the master and therefore the parameters unchanged. ``param_mismatches(params,
opt_state)`` counts the parameter elements that differ from ``round(master)``: 0 when every
step was applied with ``fmtkit.optim.apply_updates`` and the new state. It is a debugging
check, not part of ``update``: it costs a full extra pass over parameters and masters.

Without master weights (pure low-precision training), ``stochastic_round_updates`` rounds
``p + u`` stochastically and ``kahan_updates`` carries the rounding error in a compensation
buffer; both return deltas meant for ``optax.apply_updates`` (or ``fmtkit.optim.apply_updates``,
which is the same there).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmtkit.casting import cast
from fmtkit.optim._common import (
    F32,
    check_float_leaves,
    check_seed,
    increment,
    is_low_precision,
    is_masked,
    leaf_keys,
    step_key,
)

__all__ = [
    "KahanUpdatesState",
    "MasterWeightsState",
    "StochasticRoundUpdatesState",
    "apply_updates",
    "kahan_updates",
    "master_weights",
    "param_mismatches",
    "stochastic_round_updates",
]

_ROUNDINGS = ("nearest", "stochastic")


class MasterWeightsState(NamedTuple):
    """State of ``master_weights``.

    Attributes:
      master: the float32 master copy: the parameters' tree structure, with an array for
        every low-precision parameter and ``optax.MaskedNode()`` for the others.
      count: int32, number of updates (seeds stochastic rounding).
      seed: int32 seed of the stochastic rounding, or ``None`` for round-to-nearest-even.
      inner_state: the inner optimizer's state (built on the float32 master).
    """

    master: Any
    count: jax.Array
    seed: jax.Array | None
    inner_state: Any


class StochasticRoundUpdatesState(NamedTuple):
    """State of ``stochastic_round_updates``: update count and seed (int32), inner state."""

    count: jax.Array
    seed: jax.Array
    inner_state: Any


class KahanUpdatesState(NamedTuple):
    """State of ``kahan_updates``: the compensation buffer (parameters' structure, an array
    per low-precision leaf, ``optax.MaskedNode()`` elsewhere) and the inner state."""

    compensation: Any
    inner_state: Any


def _check_rounding(rounding: str) -> str:
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}.")
    return rounding


def _require_params(params: Any, name: str) -> None:
    if params is None:
        raise ValueError(f"{name} needs the current parameters: call "
                         "opt.update(grads, state, params).")


def _round_masters(master: Any, params: Any, seed: jax.Array | None,
                   count: jax.Array) -> list[Any]:
    """``round(master)`` to each parameter's dtype, as a list in ``params``' leaf order
    (``MaskedNode`` where a parameter has no master)."""
    p_leaves, treedef = jax.tree.flatten(params)
    m_leaves = treedef.flatten_up_to(master)
    n = sum(not is_masked(m) for m in m_leaves)
    keys = iter(leaf_keys(step_key(seed, count), n) if seed is not None else [None] * n)
    out = []
    for p, m in zip(p_leaves, m_leaves):
        if is_masked(m):
            out.append(m)
        elif seed is None:
            out.append(m.astype(p.dtype))  # round to nearest even (= fmtkit.cast "nearest")
        else:
            out.append(cast(m, p.dtype, rounding="stochastic", key=next(keys)))
    return out


def master_weights(
    inner: optax.GradientTransformation,
    *,
    rounding: Literal["nearest", "stochastic"] = "nearest",
    seed: int = 0,
    master_dtype: jax.typing.DTypeLike = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
    """Keeps a float32 master copy of every low-precision parameter; ``inner`` updates it.

    Per update, for each bf16/fp16/FP8 parameter ``p`` with master ``m``:

        u, inner_state = inner.update(g.astype(f32), inner_state, params=masters)
        m = m + u                                  (float32)
        n = round(m)                               (to p.dtype: nearest-even, or stochastic)
        returned update = n - p                    (in p.dtype)

    Parameters that are already float32 (or wider) get no master: they pass through ``inner``
    unchanged. **Apply the updates with** ``fmtkit.optim.apply_updates(params, updates,
    new_state)``: it sets every mastered parameter to exactly ``round(m)``.
    ``optax.apply_updates`` computes ``p + (n - p)`` in bf16, which misses ``n`` wherever the
    subtraction is inexact (an update larger than half the parameter, or a sign change):
    the next update self-corrects towards the master (the delta is taken from the actual
    parameters), but in between the parameters were not ``round(m)``;
    ``param_mismatches(params, state)`` counts such elements.

    Place ``master_weights`` outside everything that shapes the update (learning rate,
    clipping, weight decay go in ``inner``) and inside loss scaling and gradient accumulation:
    ``dynamic_loss_scale(master_weights(optax.adamw(lr)))``.

    Args:
      inner: the optimizer; it is initialised on, and updates, the float32 masters.
      rounding: ``"nearest"`` (round half to even) or ``"stochastic"`` (unbiased;
        deterministic given ``seed`` and the step count).
      seed: int seed of the stochastic rounding (stored in the state).
      master_dtype: dtype of the master copy (default float32).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``MasterWeightsState``.

    Raises:
      ValueError: unknown ``rounding``; ``update`` called without ``params``.
      TypeError: a non-floating parameter, or ``master_dtype`` not wider than 16 bits.

    Warns:
      UserWarning: at ``init``, when no parameter is low precision (nothing to master; the
        transformation is then a pass-through around ``inner``).

    Example:
      >>> opt = master_weights(optax.sgd(1e-3))
      >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
      >>> state = opt.init(params)
      >>> for _ in range(1000):
      ...     updates, state = opt.update({"w": -jnp.ones(3, jnp.bfloat16)}, state, params)
      ...     params = apply_updates(params, updates, state)
      >>> params["w"].tolist()
      [2.0, 2.0, 2.0]
    """
    inner = optax.with_extra_args_support(inner)
    rounding = _check_rounding(rounding)
    seed = check_seed(seed)
    master_dtype = np.dtype(master_dtype)
    if not jnp.issubdtype(master_dtype, jnp.floating) or master_dtype.itemsize < 4:
        raise TypeError(f"master_dtype must be float32 or wider, got {master_dtype}.")

    def view(params, master):
        p_leaves, treedef = jax.tree.flatten(params)
        m_leaves = treedef.flatten_up_to(master)
        return treedef.unflatten([p if is_masked(m) else m for p, m in zip(p_leaves, m_leaves)])

    def init_fn(params):
        check_float_leaves(params, "params")
        master = jax.tree.map(
            lambda p: p.astype(master_dtype) if is_low_precision(p.dtype) else optax.MaskedNode(),
            params)
        if not jax.tree.leaves(master) and jax.tree.leaves(params):
            warnings.warn(
                "master_weights: no parameter is low precision (bf16/fp16/FP8), so there is "
                "nothing to keep a master copy of; it passes updates through to the inner "
                "optimizer unchanged.", UserWarning, stacklevel=2)
        return MasterWeightsState(
            master=master,
            count=jnp.zeros([], jnp.int32),
            seed=jnp.asarray(seed, jnp.int32) if rounding == "stochastic" else None,
            inner_state=inner.init(view(params, master)),
        )

    def update_fn(updates, state, params=None, **extra_args):
        _require_params(params, "master_weights")
        check_float_leaves(updates, "updates (gradients)")
        p_leaves, treedef = jax.tree.flatten(params)
        g_leaves = treedef.flatten_up_to(updates)
        m_leaves = treedef.flatten_up_to(state.master)
        grads = treedef.unflatten(
            [g if is_masked(m) else g.astype(m.dtype) for g, m in zip(g_leaves, m_leaves)])
        inner_updates, inner_state = inner.update(
            grads, state.inner_state, view(params, state.master), **extra_args)
        u_leaves = treedef.flatten_up_to(inner_updates)
        master = treedef.unflatten(
            [m if is_masked(m) else m + u.astype(m.dtype) for m, u in zip(m_leaves, u_leaves)])
        count = increment(state.count)
        rounded = _round_masters(master, params, state.seed, count)
        new_updates = treedef.unflatten(
            [u if is_masked(r) else r - p for p, u, r in zip(p_leaves, u_leaves, rounded)])
        return new_updates, MasterWeightsState(master, count, state.seed, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _master_states(opt_state: Any) -> list[MasterWeightsState]:
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MasterWeightsState))
    return [n for n in nodes if isinstance(n, MasterWeightsState)]


def apply_updates(params: Any, updates: Any, opt_state: Any) -> Any:
    """Applies updates; parameters with a master in ``opt_state`` become exactly round(master).

    Use this instead of ``optax.apply_updates`` whenever the optimizer contains
    ``master_weights``; pass the state returned by the same ``update`` call. Parameters
    without a master (or any tree when ``opt_state`` holds no ``master_weights``) get
    ``optax.apply_updates``' ``p + u``.

    Args:
      params: the parameters given to ``update``.
      updates: the updates it returned.
      opt_state: the state it returned (the new one).

    Returns:
      The new parameters, each in its own dtype.

    Example:
      >>> opt = master_weights(optax.sgd(0.5))
      >>> params = jnp.array([1.0, -1.0], jnp.bfloat16)
      >>> state = opt.init(params)
      >>> updates, state = opt.update(jnp.array([3.0, 1.0], jnp.bfloat16), state, params)
      >>> apply_updates(params, updates, state).tolist()
      [-0.5, -1.5]
    """
    new = optax.apply_updates(params, updates)
    n_leaves, treedef = jax.tree.flatten(new)
    for st in _master_states(opt_state):
        rounded = _round_masters(st.master, params, st.seed, st.count)
        n_leaves = [n if is_masked(r) else r for n, r in zip(n_leaves, rounded)]
    return treedef.unflatten(n_leaves)


def param_mismatches(params: Any, opt_state: Any) -> jax.Array:
    """Number of parameter elements that differ from ``round(master)`` (int32 scalar).

    0 whenever the parameters were produced by ``apply_updates(params, updates, new_state)``
    (or are the ones ``init`` saw); a nonzero count shows updates applied another way (e.g.
    ``optax.apply_updates``) or parameters changed behind the optimizer's back. NaN equals
    NaN here. 0 when ``opt_state`` holds no ``master_weights``.

    Example:
      >>> opt = master_weights(optax.sgd(1.0))
      >>> params = jnp.array([1.0, 1e-3], jnp.bfloat16)
      >>> state = opt.init(params)
      >>> updates, state = opt.update(jnp.array([1.0, 1e-3], jnp.bfloat16), state, params)
      >>> int(param_mismatches(apply_updates(params, updates, state), state))
      0
    """
    p_leaves = jax.tree.leaves(params)
    total = jnp.zeros([], jnp.int32)
    for st in _master_states(opt_state):
        for p, r in zip(p_leaves, _round_masters(st.master, params, st.seed, st.count)):
            if not is_masked(r):
                differ = (p != r) & ~(jnp.isnan(p) & jnp.isnan(r))
                total = total + jnp.sum(differ, dtype=jnp.int32)
    return total


def stochastic_round_updates(inner: optax.GradientTransformation, *,
                             seed: int = 0) -> optax.GradientTransformationExtraArgs:
    """Pure low-precision training: the new parameter is ``p + u`` rounded stochastically.

    For each low-precision parameter ``p`` (bf16/fp16/FP8) with inner update ``u``:

        n = stochastic_round(f32(p) + f32(u))      (E[n] = p + u; fmtkit.cast)
        returned update = n - p                    (in p.dtype)

    so small updates survive in expectation instead of vanishing under round-to-nearest.
    ``optax.apply_updates`` then lands exactly on ``n`` whenever ``n - p`` is representable
    (always when ``|u| < |p| / 2``, Sterbenz); otherwise on ``p + (n - p)`` rounded to
    nearest, within one ulp. ``inner`` is initialised on, and sees, the parameters and
    gradients as they are (its moments stay low precision unless it says otherwise).

    Args:
      inner: the optimizer.
      seed: seed of the rounding; with the step count it makes runs reproducible.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``StochasticRoundUpdatesState``.

    Raises:
      ValueError: ``update`` called without ``params``.

    Example:
      >>> opt = stochastic_round_updates(optax.sgd(1e-3))
      >>> p = jnp.ones(4096, jnp.bfloat16)
      >>> s = opt.init(p)
      >>> for _ in range(1000):
      ...     u, s = opt.update(-jnp.ones(4096, jnp.bfloat16), s, p)
      ...     p = optax.apply_updates(p, u)
      >>> bool(abs(p.astype(jnp.float32).mean() - 2.0) < 0.01)
      True
    """
    inner = optax.with_extra_args_support(inner)
    seed = check_seed(seed)

    def init_fn(params):
        check_float_leaves(params, "params")
        return StochasticRoundUpdatesState(jnp.zeros([], jnp.int32),
                                           jnp.asarray(seed, jnp.int32), inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        _require_params(params, "stochastic_round_updates")
        u, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        count = increment(state.count)
        p_leaves, treedef = jax.tree.flatten(params)
        u_leaves = treedef.flatten_up_to(u)
        low = [is_low_precision(p.dtype) for p in p_leaves]
        keys = iter(leaf_keys(step_key(state.seed, count), sum(low)))
        out = []
        for p, du, lp in zip(p_leaves, u_leaves, low):
            if not lp:
                out.append(du)
                continue
            n = cast(p.astype(F32) + du.astype(F32), p.dtype, rounding="stochastic",
                     key=next(keys))
            out.append(n - p)
        return (jax.tree.unflatten(treedef, out),
                StochasticRoundUpdatesState(count, state.seed, inner_state))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def kahan_updates(inner: optax.GradientTransformation, *,
                  compensation_dtype: jax.typing.DTypeLike | None = None
                  ) -> optax.GradientTransformationExtraArgs:
    """Pure low-precision training with Kahan-compensated parameter updates.

    For each low-precision parameter ``p`` with inner update ``u`` and compensation ``c``
    (Kahan 1965; the bf16 recipe of Zamirai et al. 2020, "Revisiting BFloat16 Training"):

        y = f32(u) + f32(c)
        d = round(round(f32(p) + y) - p)           (the delta, in p.dtype)
        a = p + d                                  (exactly what optax.apply_updates computes)
        c = round(y - (f32(a) - f32(p)))           (stored in compensation_dtype)

    The compensation is computed from the value ``optax.apply_updates`` will produce, so it
    carries every rounding error, including the rare inexact delta. The state costs one
    compensation element per low-precision parameter (2 bytes in bf16).

    Args:
      inner: the optimizer (initialised on the parameters as they are).
      compensation_dtype: dtype of the buffer; default: each parameter's dtype.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``KahanUpdatesState``.

    Raises:
      ValueError: ``update`` called without ``params``.

    Example:
      >>> opt = kahan_updates(optax.sgd(1e-3))
      >>> p = jnp.ones(2, jnp.bfloat16)
      >>> s = opt.init(p)
      >>> for _ in range(1000):
      ...     u, s = opt.update(-jnp.ones(2, jnp.bfloat16), s, p)
      ...     p = optax.apply_updates(p, u)
      >>> p.tolist()
      [2.0, 2.0]
    """
    inner = optax.with_extra_args_support(inner)
    if compensation_dtype is not None:
        compensation_dtype = np.dtype(compensation_dtype)
        if not jnp.issubdtype(compensation_dtype, jnp.floating):
            raise TypeError(f"compensation_dtype must be floating, got {compensation_dtype}.")

    def init_fn(params):
        check_float_leaves(params, "params")
        comp = jax.tree.map(
            lambda p: jnp.zeros(p.shape, compensation_dtype or p.dtype)
            if is_low_precision(p.dtype) else optax.MaskedNode(), params)
        return KahanUpdatesState(comp, inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        _require_params(params, "kahan_updates")
        u, inner_state = inner.update(updates, state.inner_state, params, **extra_args)

        def rnd(x32, dtype):  # explicit f32 -> dtype -> f32 rounding
            return x32.astype(dtype).astype(F32)

        def step(p, du, c):
            if is_masked(c):
                return du, c
            # All arithmetic in f32 with explicit roundings: XLA's default "excess precision"
            # may skip the rounding of bf16/f16 arithmetic results, never of explicit casts.
            p32 = p.astype(F32)
            y = du.astype(F32) + c.astype(F32)
            d = rnd(rnd(p32 + y, p.dtype) - p32, p.dtype)  # the delta, as stored in p.dtype
            a = rnd(p32 + d, p.dtype)  # what optax.apply_updates computes: round(p + d)
            return d.astype(p.dtype), (y - (a - p32)).astype(c.dtype)

        p_leaves, treedef = jax.tree.flatten(params)
        pairs = [step(p, du, c) for p, du, c in zip(
            p_leaves, treedef.flatten_up_to(u), treedef.flatten_up_to(state.compensation))]
        new_u = treedef.unflatten([d for d, _ in pairs])
        comp = treedef.unflatten([c for _, c in pairs])
        return new_u, KahanUpdatesState(comp, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
