"""Low-precision parameters: float32 master weights, stochastic rounding, Kahan summation.

``master_weights`` keeps the truth, a float32 master copy, in its state, and returns, for
every low-precision parameter ``p``, the delta ``f32(round(m)) - f32(p)`` **in float32**.
``optax.apply_updates(params, updates)`` adds in the wider dtype and casts back
(``(p + u).astype(p.dtype)``), so it lands exactly on ``round(m)``, and so does every
``nnx.Optimizer`` (its ``update`` calls ``optax.apply_updates``). A bf16 delta could not: no
bf16 ``d`` gives ``bf16(p + d) == n`` for ``p = 1``, ``n = 2**-30`` (``-1 + 2**-30`` needs 30
significand bits); with bf16 parameters drawn from N(0, 1) and updates of relative size 0.1,
about 3% of the elements missed ``round(m)`` that way.

Why the float32 delta is exact. ``p`` and ``n = round(m)`` are bf16 (8 significand bits),
so ``n - p`` is exact in float32 (24 bits) whenever the exponents of ``p`` and ``n`` differ
by at most 16, and then ``f32(p) + d = n`` exactly. When ``|n|`` is much larger than ``|p|``
the subtraction rounds, but by at most half an f32 ulp of ``n``, far below half a bf16 ulp
of ``n``, so the final cast still gives ``n``. When ``|n|`` is much smaller than ``|p|``,
the master moved by an f32 sum that cancelled (Sterbenz: exact), so ``n`` sits on the fine
f32 grid of ``p``'s binade and ``n - p`` is exact again, with one exception below. Measured
(tests/optim/test_master_weights.py): random bf16 and fp16 parameters with relative
updates log-uniform in ``[e**-30, e**3]`` of either sign: every element equal to
ml_dtypes' rounding of the f32 master.

The edge cases:

* **A parameter shrinking by more than about 2**16 in one step** (``|n| < |p| * 2**-16``;
  ``2**-13`` for fp16, whose 11-bit significand leaves 13 spare bits in f32), when ``p`` is a
  power of two whose master lay just below it: ``f32(n) - f32(p)`` then needs 25 bits and
  rounds, and the parameter lands within ``|p| * 2**-24`` of ``n`` (often on 0 or a
  neighbour of ``n``) instead of on it. Measured, over a million random masters shrunk by
  ``2**-k``, ``k`` uniform in [0, 40]: 168 of the 211,975 bf16 elements with
  ``|n| < |p| * 2**-16`` missed, all at powers of two, none above that ratio; the largest
  error was exactly ``|p| * 2**-24``; fp16: 22 misses, all with ``|n| < |p| * 2**-13``.
  Because every delta is taken from the master (``round(m) - p`` with the parameters
  actually held, whose difference is then small and exact), the next update lands exactly:
  0 misses after one more step, so the error never accumulates.
* **A parameter that became ±inf** (its master beyond the format's max, e.g. 65504 for fp16):
  ``inf + (finite - inf)`` is NaN, so it stays non-finite; NaN in, NaN out.

``param_mismatches(params, opt_state)`` counts the elements that differ from
``round(master)``; it is a debugging check, not part of ``update`` (a full extra pass over
parameters and masters). Zero updates still mean "no change" for every optax wrapper
(``MultiSteps``, ``apply_if_finite``, loss-scale skips): a skipped step leaves the master,
and therefore the parameters, unchanged.

Dtype promotion: ``optax.apply_updates`` computes ``p + u`` with jnp's implicit promotion,
which ``jax_numpy_dtype_promotion="strict"`` refuses for bf16 + f32. Under strict promotion
use ``add_updates(params, updates)``: the same sum with explicit casts, bit-identical to
``optax.apply_updates`` under standard promotion (for ``nnx.Optimizer.update``, call it
inside ``with jax.numpy_dtype_promotion("standard")``).

Wrappers with a skip branch of their own must return zeros in the dtypes of the updates
(float32 here), not of the gradients: ``dynamic_loss_scale``, ``static_loss_scale``,
``multi_steps`` and ``optax.MultiSteps`` do; ``optax.apply_if_finite`` does not (its
``lax.cond`` rejects the mismatch at trace time when gradients are bf16/fp16), so put it
inside: ``master_weights(optax.apply_if_finite(inner, n))``, or use the loss scalers, which
skip non-finite steps themselves.

Without master weights (pure low-precision training), ``stochastic_round_updates`` rounds
``p + u`` stochastically (float32 deltas, exact as above) and ``kahan_updates`` carries the
rounding error in a compensation buffer (deltas in the parameter dtype; the compensation
accounts for what ``optax.apply_updates`` makes of them).
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
    check_dtype_arg,
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
    "add_updates",
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

    Example:
      >>> state = master_weights(optax.sgd(1e-3)).init({"w": jnp.ones(2, jnp.bfloat16)})
      >>> state.master["w"].dtype                     # the f32 copy of the bf16 parameter
      dtype('float32')
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


def _round_masters(m_leaves: list[Any], p_leaves: list[Any], seed: jax.Array | None,
                   count: jax.Array) -> list[Any]:
    """``round(master)`` to each parameter's dtype, leaf by leaf (``MaskedNode`` where a
    parameter has no master)."""
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


def _delta(n: jax.Array, p: jax.Array, dtype: np.dtype) -> jax.Array:
    """``n - p`` computed and returned in ``dtype`` (the master dtype, float32 or wider):
    exact whenever it is representable, see the module docstring."""
    return n.astype(dtype) - p.astype(dtype)


def master_weights(
    inner: optax.GradientTransformation,
    *,
    rounding: Literal["nearest", "stochastic"] = "nearest",
    seed: int = 0,
    master_dtype: jax.typing.DTypeLike = "float32",
) -> optax.GradientTransformationExtraArgs:
    """Keeps a float32 master copy of every low-precision parameter; ``inner`` updates it.

    Per update, for each bf16/fp16/FP8 parameter ``p`` with master ``m``:

        u, inner_state = inner.update(g.astype(f32), inner_state, params=masters)
        m = m + u                                  (float32)
        n = round(m)                               (to p.dtype: nearest-even, or stochastic)
        returned update = f32(n) - f32(p)          (float32, the master dtype)

    ``optax.apply_updates(params, updates)`` (and so ``nnx.Optimizer.update``) then sets
    every mastered parameter to exactly ``round(m)``: it adds in float32 and casts back.
    The one exception, a parameter shrinking by more than about 2**16 in one step, and why
    the next step corrects it, are in this module's docstring; ``param_mismatches`` counts
    elements that differ from ``round(m)``. Under ``jax_numpy_dtype_promotion="strict"``
    apply with ``add_updates`` (``optax.apply_updates`` refuses bf16 + f32 there).

    Parameters that are already float32 (or wider) get no master: they pass through ``inner``
    unchanged, their updates in whatever dtype ``inner`` returns.

    Place ``master_weights`` outside everything that shapes the update (learning rate,
    clipping, weight decay, ``optax.apply_if_finite`` go in ``inner``) and inside loss
    scaling and gradient accumulation:
    ``multi_steps(dynamic_loss_scale(master_weights(optax.adamw(lr))), every_k=k)``.

    Args:
      inner: the optimizer; it is initialised on, and updates, the float32 masters.
      rounding: ``"nearest"`` (round half to even) or ``"stochastic"`` (unbiased;
        deterministic given ``seed`` and the step count).
      seed: int seed of the stochastic rounding (stored in the state).
      master_dtype: dtype of the master copy and of the returned deltas (default float32).
        Under ``optax.inject_hyperparams`` give it as a string (``"float32"``) or in
        ``static_args``: inject_hyperparams treats callables such as ``jnp.float32`` as
        schedules (a ``TypeError`` says so).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``MasterWeightsState``.

    Raises:
      ValueError: unknown ``rounding``; ``update`` called without ``params``.
      TypeError: a non-floating parameter, or ``master_dtype`` not a dtype or not wider than
        16 bits.

    Warns:
      UserWarning: at ``init``, when no parameter is low precision (nothing to master; the
        transformation is then a pass-through around ``inner``).

    Example:
      >>> opt = master_weights(optax.sgd(1e-3))
      >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
      >>> state = opt.init(params)
      >>> for _ in range(1000):
      ...     updates, state = opt.update({"w": -jnp.ones(3, jnp.bfloat16)}, state, params)
      ...     params = add_updates(params, updates)  # = optax.apply_updates, strict-clean
      >>> params["w"].tolist()
      [2.0, 2.0, 2.0]
    """
    inner = optax.with_extra_args_support(inner)
    rounding = _check_rounding(rounding)
    seed = check_seed(seed)
    master_dtype = check_dtype_arg(master_dtype, "master_dtype")
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

    def advance(updates, state, params=None, **extra_args):
        """The new state, and the inner updates of the parameters without a master."""
        _require_params(params, "master_weights")
        check_float_leaves(updates, "updates (gradients)")
        treedef = jax.tree.structure(params)
        g_leaves = treedef.flatten_up_to(updates)
        m_leaves = treedef.flatten_up_to(state.master)
        grads = treedef.unflatten(
            [g if is_masked(m) else g.astype(m.dtype) for g, m in zip(g_leaves, m_leaves)])
        inner_updates, inner_state = inner.update(
            grads, state.inner_state, view(params, state.master), **extra_args)
        u_leaves = treedef.flatten_up_to(inner_updates)
        passthrough = [u for m, u in zip(m_leaves, u_leaves) if is_masked(m)]
        m_leaves = [m if is_masked(m) else m + u.astype(m.dtype)
                    for m, u in zip(m_leaves, u_leaves)]
        new_state = MasterWeightsState(treedef.unflatten(m_leaves), increment(state.count),
                                       state.seed, inner_state)
        return new_state, passthrough

    def finish(params, new_state, passthrough):
        """The returned updates: ``f32(round(m)) - f32(p)`` per master, computed from the new
        state alone, and the passthrough updates of the other parameters."""
        p_leaves, treedef = jax.tree.flatten(params)
        m_leaves = treedef.flatten_up_to(new_state.master)
        rounded = _round_masters(m_leaves, p_leaves, new_state.seed, new_state.count)
        others = iter(passthrough)
        return treedef.unflatten(
            [next(others) if is_masked(n) else _delta(n, p, master_dtype)
             for p, n in zip(p_leaves, rounded)])

    def update_fn(updates, state, params=None, **extra_args):
        new_state, passthrough = advance(updates, state, params, **extra_args)
        return finish(params, new_state, passthrough), new_state

    # A loss-scale wrapper runs ``advance`` under its skip ``lax.cond`` and ``finish`` after
    # it (see ``fmtkit.optim._loss_scale``): the parameter-sized deltas then never leave the
    # cond as separate buffers, and XLA fuses them into ``optax.apply_updates``.
    update_fn.fmtkit_split = (advance, finish)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _master_states(opt_state: Any) -> list[MasterWeightsState]:
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MasterWeightsState))
    return [n for n in nodes if isinstance(n, MasterWeightsState)]


def add_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates`` with explicit casts, so it also runs under strict promotion.

    Each leaf is ``(p.astype(w) + u.astype(w)).astype(p.dtype)`` with ``w`` the dtype JAX's
    standard promotion gives ``p + u`` (float32 for a bf16 parameter and a float32 update):
    bit-identical to ``optax.apply_updates`` under ``jax_numpy_dtype_promotion="standard"``
    (the default), and usable under ``"strict"``, where ``optax.apply_updates`` refuses to
    add ``master_weights``' float32 deltas to bf16 parameters. ``None`` parameters stay
    ``None`` (as in optax).

    Args:
      params: a tree of parameters.
      updates: a tree of updates with the same structure and shapes.

    Returns:
      The new parameters, each in its own dtype.

    Example:
      >>> opt = master_weights(optax.sgd(0.5))
      >>> params = jnp.array([1.0, -1.0], jnp.bfloat16)
      >>> state = opt.init(params)
      >>> updates, state = opt.update(jnp.array([3.0, 1.0], jnp.bfloat16), state, params)
      >>> updates.dtype, add_updates(params, updates).tolist()
      (dtype('float32'), [-0.5, -1.5])
    """

    def add(p, u):
        if p is None:
            return None
        p, u = jnp.asarray(p), jnp.asarray(u)
        with jax.numpy_dtype_promotion("standard"):  # the dtype optax's p + u would have
            wide = jnp.promote_types(p.dtype, u.dtype)
        return (p.astype(wide) + u.astype(wide)).astype(p.dtype)

    return jax.tree.map(add, params, updates, is_leaf=lambda x: x is None)


def _array(x: Any) -> Any:
    """The array inside a state field: itself, or the one leaf of a wrapper such as an NNX
    ``OptArray`` / ``OptVariable`` (``nnx.Optimizer`` wraps every state array)."""
    leaves = jax.tree.leaves(x)
    return leaves[0] if len(leaves) == 1 else x


def param_mismatches(params: Any, opt_state: Any) -> jax.Array:
    """Number of parameter elements that differ from ``round(master)`` (int32 scalar).

    0 whenever the parameters were produced by applying ``master_weights``' updates with
    ``optax.apply_updates`` / ``add_updates`` / ``nnx.Optimizer.update`` (or are the ones
    ``init`` saw), except after the rare one-step miss described in this module's docstring;
    a count that stays nonzero shows parameters changed behind the optimizer's back. NaN
    equals NaN here. 0 when ``opt_state`` holds no ``master_weights``.

    Works on any tree whose leaves are in the parameters' order: linen/plain parameter
    trees, ``nnx.state(model, nnx.Param)`` (Variables or pure arrays), and optimizer states
    as ``nnx.Optimizer`` keeps them (every array wrapped in an ``OptVariable`` /
    ``OptArray``): the comparison is leaf by leaf.

    Args:
      params: the parameters.
      opt_state: an optimizer state that contains a ``MasterWeightsState``.

    Returns:
      An int32 scalar.

    Raises:
      ValueError: the master copy has a different number of leaves than ``params``.

    Example:
      >>> opt = master_weights(optax.sgd(1.0))
      >>> params = jnp.array([1.0, 1e-3], jnp.bfloat16)
      >>> state = opt.init(params)
      >>> updates, state = opt.update(jnp.array([1.0, 1e-3], jnp.bfloat16), state, params)
      >>> int(param_mismatches(optax.apply_updates(params, updates), state))
      0
    """
    p_leaves = [jnp.asarray(p) for p in jax.tree.leaves(params)]
    total = jnp.zeros([], jnp.int32)
    for st in _master_states(opt_state):
        m_leaves = [m if is_masked(m) else jnp.asarray(m)
                    for m in jax.tree.leaves(st.master, is_leaf=is_masked)]
        if len(m_leaves) != len(p_leaves):
            raise ValueError(
                f"params has {len(p_leaves)} leaves but the master copy in opt_state has "
                f"{len(m_leaves)} (one per parameter, masked or not): pass the parameters "
                "the optimizer was initialised on.")
        seed = None if st.seed is None else _array(st.seed)
        for p, r in zip(p_leaves, _round_masters(m_leaves, p_leaves, seed, _array(st.count))):
            if not is_masked(r):
                differ = (p != r) & ~(jnp.isnan(p) & jnp.isnan(r))
                total = total + jnp.sum(differ, dtype=jnp.int32)
    return total


def stochastic_round_updates(inner: optax.GradientTransformation, *,
                             seed: int = 0) -> optax.GradientTransformationExtraArgs:
    """Pure low-precision training: the new parameter is ``p + u`` rounded stochastically.

    For each low-precision parameter ``p`` (bf16/fp16/FP8) with inner update ``u``:

        n = stochastic_round(f32(p) + f32(u))      (E[n] = p + u; fmtkit.cast)
        returned update = f32(n) - f32(p)          (float32)

    so small updates survive in expectation instead of vanishing under round-to-nearest.
    ``optax.apply_updates`` (or ``add_updates``) then lands exactly on ``n``, with the
    exception described in this module's docstring. ``inner`` is initialised on, and sees,
    the parameters and gradients as they are (its moments stay low precision unless it says
    otherwise).

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
            out.append(_delta(n, p, np.dtype(F32)))
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
        compensation_dtype = check_dtype_arg(compensation_dtype, "compensation_dtype")
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
